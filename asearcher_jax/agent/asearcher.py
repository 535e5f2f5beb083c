"""The ASearcher base-model agent: one growing token context, act turns and read turns.

An act turn stops on the closing tag of each of its ToolBox's tools (`</search>`, `</access>`, and
any registered tool's) or `</answer>` (or EOS). A tool result becomes read jobs (search results:
one; a page: one per 25k-char chunk; another tool's output: one); each job is appended in full
followed by an opened `<think>` for exactly one read turn that stops on `</think>`, and the context
policy (chunk-and-compact by default) then swaps it for its stub. Turn and token budgets are checked
before every call; read turns count as turns, as in the original.
"""

from __future__ import annotations

import collections
import dataclasses

from asearcher_jax.agent import prompts, protocol
from asearcher_jax.agent.base import Agent, Limits
from asearcher_jax.agent.context import ChunkAndCompact, Context, ContextPolicy, Segment
from asearcher_jax.agent.trajectory import ToolEvent, Trajectory
from asearcher_jax.serving.types import GenerationClient, SamplingParams
from asearcher_jax.tokenizer import Tokenizer
from asearcher_jax.tools import registry as tool_registry
from asearcher_jax.tools.toolbox import NO_RESULTS, ToolBox, ToolBoxConfig, ToolJob, ToolResult


@dataclasses.dataclass(frozen=True, kw_only=True)
class AsearcherAgentConfig:
  """Budgets and rendering of the base-model agent (defaults: the 7B training setup)."""

  # LLM calls (act and read turns) per episode; up to 128 and beyond is supported.
  max_turns: int = 32
  # Context budget in tokens: stop before a call when len(input) + max_new_tokens > max_tokens.
  max_tokens: int = 32000
  # Tokens one call may generate.
  max_new_tokens: int = 1024
  # Documents shown per search (at most what the ToolBox fetched).
  topk: int = 5
  # Characters of each document shown.
  doc_chars: int = 5000
  # Sentences of each document shown after its title (a snippet: its facts need `access`); 0: all.
  doc_sentences: int = 0
  # Characters per page chunk (one read turn each), chunks per page, page cap, stub length.
  page_chunk_chars: int = 25_000
  max_page_chunks: int = 10
  max_page_chars: int = 250_000
  stub_chars: int = 100
  # Also compact search results after their read turn (to a list of their URLs). The original
  # keeps them in full; long-horizon runs (100+ searches) need this or a history tail.
  compact_search_results: bool = False
  # Pending read jobs kept at most (the original's queue capacity); extra chunks are dropped.
  max_jobs: int = 128
  # Prompt: "train" (R1-style, with access sentence unless search_only), "eval", or "synthwiki"
  # (`prompts.synthwiki_prompt`: compact, for small models trained from scratch).
  prompt: str = "train"
  # SEARCH_ONLY training prompt (the released default); the agent still executes <access>.
  search_only: bool = False
  # End the episode at the first tool environment failure (the trajectory is excluded anyway).
  stop_on_environment_failure: bool = True

  def __post_init__(self) -> None:
    if self.max_turns < 1 or self.max_new_tokens < 1 or self.max_tokens < 1:
      raise ValueError("max_turns, max_new_tokens and max_tokens must be positive")
    if self.prompt not in ("train", "eval", "synthwiki"):
      raise ValueError(f"prompt must be 'train', 'eval' or 'synthwiki', got {self.prompt!r}")

  def toolbox_config(self) -> ToolBoxConfig:
    return ToolBoxConfig(
      topk=self.topk,
      doc_chars=self.doc_chars,
      doc_sentences=self.doc_sentences,
      max_page_chars=self.max_page_chars,
      page_chunk_chars=self.page_chunk_chars,
      max_page_chunks=self.max_page_chunks,
      stub_chars=self.stub_chars,
      compact_search_results=self.compact_search_results,
    )


@dataclasses.dataclass
class _Job:
  job: ToolJob
  label: str
  event: ToolEvent


class AsearcherAgent(Agent):
  name = "asearcher"
  config_class = AsearcherAgentConfig

  def __init__(
    self,
    *,
    client: GenerationClient,
    tokenizer: Tokenizer,
    toolbox: ToolBox | None,
    config: AsearcherAgentConfig | None = None,
    context_policy: ContextPolicy | None = None,
    sampling: SamplingParams | None = None,
    limits: Limits | None = None,
  ) -> None:
    super().__init__(
      client=client, tokenizer=tokenizer, toolbox=toolbox, sampling=sampling, limits=limits
    )
    self.config = config or AsearcherAgentConfig()
    self.policy = context_policy if context_policy is not None else ChunkAndCompact()

  def prompt(self, question: str, valid_inst: bool) -> str:
    if self.config.prompt == "eval":
      return prompts.asearcher_eval_prompt(question)
    if self.config.prompt == "synthwiki":
      return prompts.synthwiki_prompt(question)
    return prompts.asearcher_prompt(
      question, access=not self.config.search_only, valid_inst=valid_inst
    )

  async def _episode(self, traj: Trajectory) -> None:
    cfg = self.config
    traj.prompt_text = self.prompt(traj.question, traj.valid_inst)
    ctx = Context([Segment("prompt", self.tokenizer.encode(traj.prompt_text), pinned=True)])
    jobs: collections.deque[_Job] = collections.deque()
    tags = self.action_tags()
    act_stops = protocol.act_stops(tags)
    while True:
      if len(traj.calls) >= cfg.max_turns:
        traj.finish_reason = "turn_limit"
        return
      for r in self.policy.apply(ctx):
        traj.removals.append(dataclasses.replace(r, before_call=len(traj.calls)))
      kind, stop = "act", act_stops
      if jobs:
        kind, stop = "read", protocol.READ_STOPS
        ctx.append(self._job_segment(jobs.popleft()))
      input_ids = ctx.ids()
      if len(input_ids) + cfg.max_new_tokens > cfg.max_tokens:
        traj.finish_reason = "token_limit"
        return
      call = await self.generate(traj, kind, input_ids, cfg.max_new_tokens, stop)
      if call is None:
        return
      ctx.append(Segment("generation", call.output_ids.tolist(), label=kind))
      parsed = protocol.parse(call.text, tags=tags)
      call.format_problems = parsed.format.problems
      if call.stop_reason == "abort":
        self.fail(traj, "abort", "engine: generation aborted")
        return
      action = parsed.action
      if action is not None:
        call.action = action.tag
        if action.kind == protocol.ANSWER:
          traj.pred_answer = action.argument
          traj.finish_reason = "answer"
          return
        result, event = await self.call_tool(traj, action)
        if event.environment_failure and cfg.stop_on_environment_failure:
          traj.finish_reason = "environment_failure"
          return
        rendered = self._jobs(result, action)
        event.num_jobs = len(rendered)
        event.text = "\n\n".join(j.text for j, _ in rendered)
        for job, label in rendered:
          if len(jobs) < cfg.max_jobs:
            jobs.append(_Job(job, label, event))
      if self.ends_with_eos(call):
        traj.finish_reason = "eos"
        return

  def _jobs(self, result: ToolResult | None, action: protocol.Action) -> list[tuple[ToolJob, str]]:
    """Read jobs rendered with this agent's limits (the ToolBox's own rendering is its default)
    by the tool that ran (or the registered class of its tag, when the call never reached it)."""
    tools = getattr(self.toolbox, "tools", None) or {}
    tool = tools.get(action.kind)
    if tool is None:
      cls = tool_registry.get(action.kind)
      try:
        tool = cls() if cls is not None else None
      except TypeError:  # a tool that needs arguments to be built: shown as nothing found
        tool = None
    if tool is None:
      return [(ToolJob(NO_RESULTS, NO_RESULTS), action.kind)]
    value = result.value if result is not None else None
    rendered = tool.render(value, self.config.toolbox_config())
    return [(j, j.label or action.kind) for j in rendered.jobs]

  def _job_segment(self, job: _Job) -> Segment:
    """`\\n\\n` + text + `\\n<think>\\n`, tokenized once; the stub likewise, if it differs."""
    ids = self.tokenizer.encode(f"\n\n{job.job.text}\n<think>\n")
    stub = None
    if job.job.short_text != job.job.text:
      stub = self.tokenizer.encode(f"\n\n{job.job.short_text}\n<think>\n")
    job.event.num_tokens += len(ids)
    return Segment("tool", ids, stub=stub, label=job.label)
