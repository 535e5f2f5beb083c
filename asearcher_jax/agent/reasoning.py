"""The large-reasoning-model agent (QwQ style): a fresh single-turn chat per call.

The history is text (thoughts, actions, search results, page stubs), cut to its last 25,000
characters by a `HistoryTail` policy and rendered into an act or read prompt. A call cut off by the
per-call token cap is continued: the next input is the previous input plus its output ids, so the
two calls merge into one training sequence. Unlike the released code, the answer phase is reached:
read turns do not count towards `force_turns`, the episode does not stop at `force_turns`, and the
last `answer_reserve_turns` calls before the hard `max_turns` stop are answer-enabled act calls
(pending reads are skipped there).
"""

from __future__ import annotations

import collections
import dataclasses

from asearcher_jax.agent import prompts, protocol
from asearcher_jax.agent.base import Agent, Limits
from asearcher_jax.agent.context import Context, ContextPolicy, HistoryTail, Segment
from asearcher_jax.agent.trajectory import Trajectory
from asearcher_jax.serving.types import GenerationClient, SamplingParams
from asearcher_jax.tokenizer import Tokenizer
from asearcher_jax.tools.toolbox import ToolBox

NO_DOCS = "\n\n<information>\nNo Results Found.\n</information>\n\n"
NO_PAGE = "No More Information is Found for this URL."


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReasoningAgentConfig:
  """Budgets of the LRM agent (defaults: the released eval agent, with the answer phase fixed)."""

  # Hard stop: LLM calls (act, read and continuation calls) per episode.
  max_turns: int = 128
  # Search/access actions after which the answer-enabled prompt is used (read turns don't count).
  force_turns: int = 32
  # ...or after this many search results.
  force_documents: int = 20
  # The last this-many calls before max_turns always use the answer-enabled prompt.
  answer_reserve_turns: int = 2
  # Characters of history kept in prompts (the tail).
  history_chars: int = 25_000
  # Documents per search, page chunking (10k chars, at most 10 chunks, 250k cap), stub length.
  topk: int = 5
  page_chunk_chars: int = 10_000
  max_page_chunks: int = 10
  max_page_chars: int = 250_000
  stub_chars: int = 100
  # A read prompt longer than this is skipped (the content stays in the history as its stub).
  max_read_prompt_tokens: int = 28_000
  # Input + output tokens of one call at most; max_new_tokens = min(cap, this - input length).
  max_context_tokens: int = 31_000
  # Per-call generation cap (a cut-off call is continued by the next call).
  max_new_tokens: int = 31_000
  # Continuations of one cut-off call before it counts as a failure.
  max_continuations: int = 4
  # Calls that produced no <thought> at most, then the episode ends ("failures").
  max_failures: int = 32
  # Without an <answer>: use the original's fallback (last line mentioning "answer").
  fallback_answer: bool = False

  def __post_init__(self) -> None:
    if self.max_turns < 1 or self.force_turns < 0 or self.answer_reserve_turns < 0:
      raise ValueError("max_turns must be positive, force_turns/answer_reserve_turns >= 0")


@dataclasses.dataclass
class _Read:
  kind: str  # "documents" | "page"
  content: str
  short: str


@dataclasses.dataclass
class _State:
  """Episode state between calls."""

  history: Context
  # Content waiting for its read turn, and the page chunks after it.
  pending: _Read | None = None
  pages: collections.deque[_Read] = dataclasses.field(default_factory=collections.deque)
  # A cut-off call being continued: its input + output ids, and the text so far.
  cont_ids: list[int] | None = None
  cont_text: str = ""
  n_cont: int = 0
  failures: int = 0
  n_tool_acts: int = 0
  n_docs: int = 0
  phase: str = "search"
  # Kind of the last fresh call: act, answer or read.
  kind: str = "act"


class ReasoningAgent(Agent):
  name = "reasoning"
  config_class = ReasoningAgentConfig
  # The original's two tools: this agent renders documents and pages, not other tools' output.
  tools = ("search", "access")

  def __init__(
    self,
    *,
    client: GenerationClient,
    tokenizer: Tokenizer,
    toolbox: ToolBox | None,
    config: ReasoningAgentConfig | None = None,
    context_policy: ContextPolicy | None = None,
    sampling: SamplingParams | None = None,
    limits: Limits | None = None,
  ) -> None:
    super().__init__(
      client=client, tokenizer=tokenizer, toolbox=toolbox, sampling=sampling, limits=limits
    )
    self.config = config or ReasoningAgentConfig()
    self.policy = context_policy or HistoryTail(
      max_chars=self.config.history_chars, decode=tokenizer.decode
    )

  def _chat(self, prompt: str) -> list[int]:
    return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])

  def _add(self, history: Context, text: str, label: str) -> None:
    history.append(Segment("text", self.tokenizer.encode(text), label=label))

  async def _episode(self, traj: Trajectory) -> None:
    traj.prompt_text = traj.question
    st = _State(history=Context())
    while await self._step(traj, st):
      pass
    traj.extra["phase"] = st.phase
    traj.extra["failures"] = st.failures
    if traj.pred_answer is None and self.config.fallback_answer:
      traj.pred_answer = fallback_answer([c.text for c in traj.calls])

  async def _step(self, traj: Trajectory, st: _State) -> bool:
    """One LLM call and its consequences; False when the episode is over."""
    cfg = self.config
    if len(traj.calls) >= cfg.max_turns:
      traj.finish_reason = "turn_limit"
      return False
    self._update_phase(traj, st)
    input_ids = st.cont_ids if st.cont_ids is not None else self._fresh_input(traj, st)
    if input_ids is None:  # a read prompt was too long and skipped
      return True
    max_new = min(cfg.max_new_tokens, cfg.max_context_tokens - len(input_ids))
    if max_new <= 0:
      traj.finish_reason = "token_limit"
      return False
    kind = st.kind if st.cont_ids is None else "continue"
    call = await self.generate(traj, kind, input_ids, max_new)
    if call is None:
      return False
    if call.stop_reason == "abort":
      self.fail(traj, "abort", "engine: generation aborted")
      return False
    text = st.cont_text + call.text
    thought = protocol.last_match(text, "thought")
    if thought is None:
      return self._no_thought(traj, st, input_ids, call, text)
    st.cont_ids, st.cont_text, st.n_cont = None, "", 0
    if st.kind == "read" and st.pending is not None:
      self._add(st.history, st.pending.short, st.pending.kind)
      self._add(st.history, f"<think>{thought}</think>\n\n", "read")
      st.pending = st.pages.popleft() if st.pages else None
      return True
    action = self._choose(text, st.phase)
    self._add(st.history, f"<think>{thought}</think>\n\n" + (action.tag if action else ""), "act")
    if action is None:
      return True
    call.action = action.tag
    if action.kind == "answer":
      traj.pred_answer = action.argument
      traj.finish_reason = "answer"
      return False
    return await self._act(traj, st, action)

  def _update_phase(self, traj: Trajectory, st: _State) -> None:
    cfg = self.config
    left = cfg.max_turns - len(traj.calls)
    if st.phase == "search" and (
      st.n_tool_acts >= cfg.force_turns
      or st.n_docs >= cfg.force_documents
      or left <= cfg.answer_reserve_turns
    ):
      st.phase = "answer"
      traj.extra["answer_phase_at_call"] = len(traj.calls)
    if left <= cfg.answer_reserve_turns and st.pending is not None and st.cont_ids is None:
      # The last calls are for answering: unread content stays in the history as its stub.
      self._abandon_reads(st)

  def _fresh_input(self, traj: Trajectory, st: _State) -> list[int] | None:
    """A new single-turn chat: a read prompt for pending content, else an act prompt."""
    for r in self.policy.apply(st.history):
      traj.removals.append(dataclasses.replace(r, before_call=len(traj.calls)))
    hist = self.tokenizer.decode(st.history.ids())
    if st.pending is not None:
      read = st.pending
      template = (
        prompts.READ_PAGE_PROMPT if read.kind == "page" else prompts.READ_SEARCH_RESULTS_PROMPT
      )
      ids = self._chat(
        prompts.fill(template, question=traj.question, history=hist, content=read.content)
      )
      if len(ids) <= self.config.max_read_prompt_tokens:
        st.kind = "read"
        return ids
      traj.extra["skipped_reads"] = traj.extra.get("skipped_reads", 0) + 1
      self._add(st.history, read.short, read.kind)
      st.pending = st.pages.popleft() if st.pages else None
      return None
    answer = st.phase == "answer"
    template = prompts.THINK_AND_ACT_PROMPT_V1 if answer else prompts.THINK_AND_ACT_PROMPT
    st.kind = "answer" if answer else "act"
    return self._chat(
      prompts.fill(template, question=traj.question, history=hist, current_date=prompts.today())
    )

  def _no_thought(self, traj: Trajectory, st: _State, input_ids, call, text: str) -> bool:
    """Continue a cut-off call (same sequence), else count a failure and try afresh."""
    if (
      call.stop_reason == "length"
      and call.output_ids.size
      and st.n_cont < self.config.max_continuations
    ):
      st.cont_ids = [*input_ids, *call.output_ids.tolist()]
      st.cont_text, st.n_cont = text, st.n_cont + 1
      return True
    st.failures += 1
    st.cont_ids, st.cont_text, st.n_cont = None, "", 0
    if st.kind == "read" and st.pending is not None:  # as the original: a failed read ends it
      self._abandon_reads(st)
    if st.failures > self.config.max_failures:
      traj.finish_reason = "failures"
      return False
    return True

  async def _act(self, traj: Trajectory, st: _State, action: protocol.Action) -> bool:
    result, event = await self.call_tool(traj, action)
    if event.environment_failure:
      traj.finish_reason = "environment_failure"
      return False
    st.n_tool_acts += 1
    if action.kind == "search":
      st.n_docs += 1
      docs = list(result.documents)[: self.config.topk] if result is not None else []
      info = self._render_docs(docs)
      st.pending = _Read("documents", info, info)
      event.text, event.num_jobs = info, 1
    else:
      chunks = self._page_chunks(result.page if result is not None else None)
      event.text, event.num_jobs = "".join(c.content for c in chunks), len(chunks)
      st.pending, st.pages = chunks[0], collections.deque(chunks[1:])
    return True

  def _abandon_reads(self, st: _State) -> None:
    if st.pending is not None:
      self._add(st.history, st.pending.short, st.pending.kind)
    st.pending = None
    st.pages.clear()

  def _choose(self, text: str, phase: str) -> protocol.Action | None:
    """The first of search, access, answer present; an answer outside the answer phase is
    discarded (the model was not offered it)."""
    for a in protocol.extract_actions(text, protocol.action_tags(self.tools)):
      if a.kind != "answer" or phase == "answer":
        return a
    return None

  def _render_docs(self, docs) -> str:
    if not docs:
      return NO_DOCS
    body = "\n".join(f"[Doc {k}]({d.url}):\n{d.contents}" for k, d in enumerate(docs, 1))
    return f"\n\n<information>\n{body}\n</information>\n\n"

  def _page_chunks(self, page: str | None) -> list[_Read]:
    cfg = self.config
    if not page:
      return [_Read("page", NO_PAGE, NO_PAGE)]
    page = page[: cfg.max_page_chars]
    out = []
    for i in range(cfg.max_page_chunks):
      chunk = page[i * cfg.page_chunk_chars : (i + 1) * cfg.page_chunk_chars]
      if not chunk:
        break
      header = f">>>> Page {i + 1} >>>>\n\n"
      out.append(_Read("page", header + chunk, f"\n\n{header}{chunk[: cfg.stub_chars]}...\n\n"))
    return out


def fallback_answer(texts: list[str]) -> str | None:
  """The original `get_answer` fallback: the last line mentioning "answer" (any case) across
  the generations, else the text after the last `</think>`."""
  for text in reversed(texts):
    for line in reversed(text.splitlines()):
      if "answer" in line.lower():
        return line.strip()
  for text in reversed(texts):
    if "</think>" in text:
      return text.rsplit("</think>", 1)[1].strip() or None
  return None
