"""A trajectory: every LLM call with the exact ids the engine saw and produced, every tool call,
and the conversion into training sequences by the prefix-merge rule.

Tokens are the truth: a training sequence is literally the concatenation of one call's input ids
and output ids, extended by later calls whose input starts with it. After a context policy removes
tokens (compaction, truncation) the prefix breaks and a new sequence starts, so a trajectory
becomes 1..N sequences with no re-tokenized token anywhere.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from asearcher_jax.agent.context import Removal
from asearcher_jax.tools import registry as tool_registry

TrainStop = Literal["stop", "length", "abort", "turn_limit"]
# Why an episode ended. turn_limit / token_limit: a budget ran out before an answer.
FINISH_REASONS = (
  "answer",
  "eos",
  "turn_limit",
  "token_limit",
  "abort",
  "environment_failure",
  "failures",
)
_BUDGET_FINISH = ("turn_limit", "token_limit")


def _arr(x: Sequence, dtype) -> np.ndarray:
  return np.asarray(x, dtype=dtype)


@dataclasses.dataclass(kw_only=True)
class LLMCall:
  """One `generate` call.

  Attributes:
    index: position in the trajectory (0-based).
    kind: what the agent asked for: act, read, answer, continue.
    input_ids / output_ids: exactly what the engine received and returned.
    logprobs / versions: per output token, from the engine.
    stop_reason: the engine's: stop, length or abort.
    text: the decoded output, for inspection only (never fed back).
    started_s / latency_s: seconds since the episode started, and the call's duration.
    format_problems: the format gate's complaints about this output (empty = passes).
    action: the executed action tag, if any.
  """

  index: int
  kind: str
  input_ids: np.ndarray
  output_ids: np.ndarray
  logprobs: np.ndarray
  versions: np.ndarray
  stop_reason: str
  max_new_tokens: int
  text: str = ""
  started_s: float = 0.0
  latency_s: float = 0.0
  format_problems: tuple[str, ...] = ()
  action: str | None = None

  @property
  def format_ok(self) -> bool:
    return not self.format_problems

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    for k in ("input_ids", "output_ids", "logprobs", "versions"):
      d[k] = getattr(self, k).tolist()
    d["format_problems"] = list(self.format_problems)
    d["num_input_tokens"] = int(self.input_ids.size)
    d["num_output_tokens"] = int(self.output_ids.size)
    return d

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> LLMCall:
    d = dict(d)
    d.pop("num_input_tokens", None)
    d.pop("num_output_tokens", None)
    for k, dt in (("input_ids", np.int32), ("output_ids", np.int32), ("versions", np.int32)):
      d[k] = _arr(d[k], dt)
    d["logprobs"] = _arr(d["logprobs"], np.float32)
    d["format_problems"] = tuple(d.get("format_problems", ()))
    return cls(**d)


def tool_counts(events: Sequence[ToolEvent]) -> dict[str, float]:
  """`num_<tag>`: calls per tool, for every registered tool (zeros included, so every trajectory
  of a run has the same keys) and any other tag the episode called."""
  names = [e.name for e in events]
  tags = dict.fromkeys((*tool_registry.tags(), *names))
  return {f"num_{tag}": float(names.count(tag)) for tag in tags}


@dataclasses.dataclass(kw_only=True)
class ToolEvent:
  """One executed tool call and what the agent was shown.

  Attributes:
    after_call: index of the LLM call that asked for it.
    text: the full agent-visible text of all its read jobs.
    num_jobs: read turns it produced (1 for search results or a tool's output, 1..10 page
      chunks).
    num_tokens: tokens of `text` as tokenized into the context (0 if not shown yet).
    stats: the ToolBox's per-call stats (provider, latency, cache, errors...).
  """

  after_call: int
  name: str
  argument: str
  text: str
  num_jobs: int = 1
  num_tokens: int = 0
  latency_s: float = 0.0
  environment_failure: bool = False
  stats: dict[str, Any] = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> ToolEvent:
    return cls(**d)


PER_TOKEN_FIELDS = ("tokens", "loss_mask", "logprobs", "versions")


class TrainingSequence(Mapping[str, np.ndarray]):
  """Per-token arrays of one training sequence, a Mapping so `model.packing.pack` takes it as is;
  `stop_reason` and `calls` (indices of the LLM calls merged into it) ride along as attributes."""

  def __init__(
    self,
    *,
    tokens: np.ndarray,
    loss_mask: np.ndarray,
    logprobs: np.ndarray,
    versions: np.ndarray,
    stop_reason: TrainStop,
    calls: list[int],
  ) -> None:
    self.arrays = {
      "tokens": tokens.astype(np.int32),
      "loss_mask": loss_mask.astype(np.int32),
      "logprobs": logprobs.astype(np.float32),
      "versions": versions.astype(np.int32),
    }
    self.stop_reason = stop_reason
    self.calls = calls

  def __getitem__(self, key: str) -> np.ndarray:
    return self.arrays[key]

  def __iter__(self) -> Iterator[str]:
    return iter(PER_TOKEN_FIELDS)

  def __len__(self) -> int:
    return len(PER_TOKEN_FIELDS)

  @property
  def num_tokens(self) -> int:
    return int(self.arrays["tokens"].size)

  def __repr__(self) -> str:
    n_gen = int(self.arrays["loss_mask"].sum())
    return f"TrainingSequence({self.num_tokens} tokens, {n_gen} generated, {self.stop_reason})"


def merge_calls(
  calls: Sequence[LLMCall], *, final_stop: TrainStop | None = None
) -> list[TrainingSequence]:
  """The prefix-merge rule: a call extends the longest existing sequence that is an exact prefix
  of its input; otherwise it starts a new one. Non-generated tokens get loss_mask 0, logprob 0,
  version -1. `final_stop` overrides the stop reason of the sequence holding the last call."""
  seqs: list[dict[str, Any]] = []
  for call in calls:
    x = call.input_ids
    best = None
    for s in seqs:
      t = s["tokens"]
      longer = best is None or t.size > best["tokens"].size
      if longer and t.size <= x.size and np.array_equal(x[: t.size], t):
        best = s
    new = x if best is None else x[best["tokens"].size :]
    n_new, n_out = new.size, call.output_ids.size
    parts = {
      "tokens": np.concatenate([new, call.output_ids]).astype(np.int32),
      "loss_mask": np.concatenate([np.zeros(n_new, np.int32), np.ones(n_out, np.int32)]),
      "logprobs": np.concatenate([np.zeros(n_new, np.float32), call.logprobs]).astype(np.float32),
      "versions": np.concatenate([np.full(n_new, -1, np.int32), call.versions]).astype(np.int32),
    }
    if best is None:
      best = dict(parts, calls=[], stop=call.stop_reason)
      seqs.append(best)
    else:
      for k, v in parts.items():
        best[k] = np.concatenate([best[k], v])
    best["calls"].append(call.index)
    best["stop"] = call.stop_reason
  out = []
  last = calls[-1].index if calls else None
  for s in seqs:
    stop = s["stop"]
    if final_stop is not None and s["calls"][-1] == last:
      stop = final_stop
    out.append(
      TrainingSequence(
        tokens=s["tokens"],
        loss_mask=s["loss_mask"],
        logprobs=s["logprobs"],
        versions=s["versions"],
        stop_reason=stop,
        calls=s["calls"],
      )
    )
  return out


@dataclasses.dataclass(kw_only=True)
class Trajectory:
  """One episode of one agent on one question, complete enough to replay and to train on.

  Attributes:
    finish_reason: one of FINISH_REASONS.
    pred_answer: the last `<answer>` the policy generated (never the prompt's example tag).
    environment_failure: a tool failed (outage, timeout, budget): exclude, don't score 0.
    valid_inst: the prompt told the model the question is valid (invalid-answer penalty applies).
    score: the reward, once computed (None before, or when excluded).
    extra: agent-specific facts (phase switches, failures, ...).
  """

  agent: str
  question: str
  qid: str = ""
  answers: list[str] = dataclasses.field(default_factory=list)
  aug_answers: list[str] = dataclasses.field(default_factory=list)
  valid_inst: bool = False
  prompt_text: str = ""
  calls: list[LLMCall] = dataclasses.field(default_factory=list)
  tools: list[ToolEvent] = dataclasses.field(default_factory=list)
  removals: list[Removal] = dataclasses.field(default_factory=list)
  pred_answer: str | None = None
  finish_reason: str = ""
  environment_failure: bool = False
  errors: list[str] = dataclasses.field(default_factory=list)
  started_at: float = 0.0
  duration_s: float = 0.0
  score: float | None = None
  extra: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def format_ok(self) -> bool:
    """The all-generations format gate (reward is zeroed when it fails)."""
    return all(c.format_ok for c in self.calls)

  def training_sequences(self) -> list[TrainingSequence]:
    final: TrainStop | None = "turn_limit" if self.finish_reason in _BUDGET_FINISH else None
    return merge_calls(self.calls, final_stop=final)

  def stats(self) -> dict[str, float]:
    """Flat per-trajectory numbers for the metric writer."""
    kinds = [c.kind for c in self.calls]
    return {
      "num_llm_calls": float(len(self.calls)),
      "num_act_calls": float(sum(k in ("act", "answer") for k in kinds)),
      "num_read_calls": float(kinds.count("read")),
      "num_tool_calls": float(len(self.tools)),
      **tool_counts(self.tools),
      "num_tool_failures": float(sum(t.environment_failure for t in self.tools)),
      "num_output_tokens": float(sum(c.output_ids.size for c in self.calls)),
      "max_input_tokens": float(max((c.input_ids.size for c in self.calls), default=0)),
      "num_removed_tokens": float(sum(r.removed.size for r in self.removals)),
      "format_ok": float(self.format_ok),
      "answered": float(self.pred_answer is not None),
      "environment_failure": float(self.environment_failure),
      "duration_s": self.duration_s,
    }

  def to_json(self) -> dict[str, Any]:
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    d["calls"] = [c.to_json() for c in self.calls]
    d["tools"] = [t.to_json() for t in self.tools]
    d["removals"] = [r.to_json() for r in self.removals]
    d["stats"] = self.stats()
    return d

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> Trajectory:
    d = dict(d)
    d.pop("stats", None)
    d["calls"] = [LLMCall.from_json(c) for c in d.get("calls", [])]
    d["tools"] = [ToolEvent.from_json(t) for t in d.get("tools", [])]
    d["removals"] = [Removal.from_json(r) for r in d.get("removals", [])]
    return cls(**d)

  def save(self, path: str | Path) -> None:
    Path(path).write_text(json.dumps(self.to_json(), ensure_ascii=False), encoding="utf-8")

  @classmethod
  def load(cls, path: str | Path) -> Trajectory:
    return cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")))
