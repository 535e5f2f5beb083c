"""The Search-R1 baseline: one growing chat context, `<search>` and `<answer>`, ten turns.

Results come back as a numbered `<information>` block; a turn with neither a query nor an answer
gets Search-R1's "invalid action" hint and another try. Everything is appended as token ids.
"""

from __future__ import annotations

import dataclasses
import re

from asearcher_jax.agent import prompts, protocol
from asearcher_jax.agent.base import Agent, Limits
from asearcher_jax.agent.context import Context, ContextPolicy, NoOp, Segment
from asearcher_jax.agent.trajectory import Trajectory
from asearcher_jax.serving.types import GenerationClient, SamplingParams
from asearcher_jax.tokenizer import Tokenizer
from asearcher_jax.tools.toolbox import ToolBox

STOPS = ("</search>", "</answer>", "<|end_of_query|>")
INVALID_HINT = (
  "\nMy previous action is invalid. If I want to search, I should put the query between "
  "<search> and </search>. If I want to give the final answer, I should put the answer between "
  "<answer> and </answer>. Let me try again.\n"
)
_LEADING_DIGITS = re.compile(r"^\d+")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchR1AgentConfig:
  # Act turns (LLM calls) per episode.
  max_turns: int = 10
  # Context budget in tokens, checked before every call.
  max_tokens: int = 32000
  # Tokens one call may generate.
  max_new_tokens: int = 1024
  # Documents per search.
  topk: int = 5


def render_results(docs: list[str]) -> str:
  if not docs:
    return "\n\n<information>No relevant documents found.</information>\n\n"
  lines = "".join(f"{j}. {_LEADING_DIGITS.sub('', d)}\n" for j, d in enumerate(docs, 1))
  return f"\n\n<information>{lines}</information>\n\n"


def parse_query(text: str) -> str | None:
  """The last `<search>` or `<|begin_of_query|>` query; an unterminated one is auto-closed."""
  for open_tag, close_tag in (
    ("<search>", "</search>"),
    ("<|begin_of_query|>", "<|end_of_query|>"),
  ):
    matches = list(protocol.iter_matches(text, open_tag, close_tag))
    if matches:
      q = text[matches[-1][0] : matches[-1][1]]
    else:
      start = text.rfind(open_tag)
      q = text[start + len(open_tag) :] if start >= 0 else ""
      for special in ("<|im_end|>", "<|endoftext|>"):
        q = q.replace(special, "")
    if q.strip():
      return q.strip()
  return None


class SearchR1Agent(Agent):
  name = "search_r1"
  config_class = SearchR1AgentConfig

  def __init__(
    self,
    *,
    client: GenerationClient,
    tokenizer: Tokenizer,
    toolbox: ToolBox | None,
    config: SearchR1AgentConfig | None = None,
    context_policy: ContextPolicy | None = None,
    sampling: SamplingParams | None = None,
    limits: Limits | None = None,
  ) -> None:
    super().__init__(
      client=client, tokenizer=tokenizer, toolbox=toolbox, sampling=sampling, limits=limits
    )
    self.config = config or SearchR1AgentConfig()
    self.policy = context_policy if context_policy is not None else NoOp()

  async def _episode(self, traj: Trajectory) -> None:
    cfg, tok = self.config, self.tokenizer
    user = prompts.fill(prompts.SEARCH_R1_PROMPT, question=traj.question)
    traj.prompt_text = tok.format_chat([{"role": "user", "content": user}])
    ctx = Context([Segment("prompt", tok.encode(traj.prompt_text), pinned=True)])
    while True:
      if len(traj.calls) >= cfg.max_turns:
        traj.finish_reason = "turn_limit"
        return
      for r in self.policy.apply(ctx):
        traj.removals.append(dataclasses.replace(r, before_call=len(traj.calls)))
      input_ids = ctx.ids()
      if len(input_ids) + cfg.max_new_tokens > cfg.max_tokens:
        traj.finish_reason = "token_limit"
        return
      call = await self.generate(traj, "act", input_ids, cfg.max_new_tokens, STOPS)
      if call is None:
        return
      ctx.append(Segment("generation", call.output_ids.tolist(), label="act"))
      call.format_problems = protocol.check_format(
        call.text, tags=("search", "answer"), max_think_close=None
      ).problems
      if call.stop_reason == "abort":
        self.fail(traj, "abort", "engine: generation aborted")
        return
      answer = protocol.extract_answer(call.text)
      if answer is not None:
        call.action = f"<answer>{answer}</answer>"
        traj.pred_answer = answer
        traj.finish_reason = "answer"
        return
      query = parse_query(call.text)
      if query is not None:
        call.action = f"<search>{query}</search>"
        result, event = await self.call_tool(traj, protocol.Action("search", query))
        if event.environment_failure:
          traj.finish_reason = "environment_failure"
          return
        docs = [d.contents for d in (result.documents if result else ())][: cfg.topk]
        text = render_results(docs)
      elif self.ends_with_eos(call):
        traj.finish_reason = "eos"
        return
      else:
        text = INVALID_HINT
      ids = tok.encode(text)
      if query is not None:
        event.text, event.num_tokens = text, len(ids)
      ctx.append(Segment("tool" if query is not None else "text", ids, label="information"))
