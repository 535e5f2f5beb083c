"""An episode as a reader sees it, independent of where it is drawn (HTML or terminal).

Two views of the same tokens: the *turns* (what the agent thought, searched, read and answered,
with the compaction stubs it saw in place of removed text) and the *training sequences* token by
token (`Trajectory.training_sequences()`, exactly what the learner trains on: loss mask, policy
version, behaviour logprob). Plus the reward and its parts, and each tool call with the side a
failure is attributed to.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from asearcher_jax.agent.trajectory import LLMCall, ToolEvent, Trajectory
from asearcher_jax.evaluation import metrics as eval_metrics
from asearcher_jax.rl import reward as reward_lib
from asearcher_jax.tokenizer import Tokenizer
from asearcher_jax.tools import registry as tool_registry


def _tag_pattern() -> re.Pattern[str]:
  """Tags of a generation drawn as blocks of their own: think, every registered tool's, answer
  (read when drawn, so a tool registered after import is drawn too)."""
  tags = ("think", *tool_registry.tags(), "answer")
  return re.compile(rf"<({'|'.join(map(re.escape, tags))})>(.*?)</\1>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Block:
  """One piece of a turn. kind: think | a tool's tag | answer | text (untagged output) | a tool's
  result label (`Tool.result_label`: results, page, output) | compaction | failure."""

  kind: str
  text: str
  note: str = ""


@dataclasses.dataclass(frozen=True)
class Turn:
  """One LLM call, what it generated, and what the environment answered before the next."""

  index: int
  call: LLMCall
  blocks: tuple[Block, ...]


def generated_blocks(text: str) -> list[Block]:
  """Splits one generation into think / action / text blocks, in order. The prompt ends in an
  open `<think>`, so text before a first `</think>` without its own opening tag is thinking."""
  blocks: list[Block] = []
  close = text.find("</think>")
  if close >= 0 and "<think>" not in text[:close]:
    if text[:close].strip():
      blocks.append(Block("think", text[:close].strip()))
    text = text[close + len("</think>") :]
  pos = 0
  for m in _tag_pattern().finditer(text):
    if text[pos : m.start()].strip():
      blocks.append(Block("text", text[pos : m.start()].strip()))
    blocks.append(Block(m.group(1), m.group(2).strip()))
    pos = m.end()
  if text[pos:].strip():
    blocks.append(Block("text", text[pos:].strip()))
  return blocks


def tool_attribution(t: ToolEvent) -> str:
  """Whose fault a tool call's failure is: "environment" (outage, timeout, budget: the episode
  is excluded, not scored 0), "policy" (an invalid call: bad URL, empty query), or "" (none)."""
  if t.environment_failure or t.stats.get("environment_failure"):
    return "environment"
  cls = tool_registry.get(t.name)
  # Nothing found is the policy's mistake for some tools (a URL that does not exist).
  not_found = cls is not None and cls.missing_is_policy and t.stats.get("found") is False
  if t.stats.get("invalid_call") or t.stats.get("error") or not_found:
    return "policy"
  return ""


def _tool_block(t: ToolEvent) -> Block:
  who = tool_attribution(t)
  note = f"{t.name}({t.argument!r}) -> {t.num_jobs} read turn(s), {t.num_tokens} tokens"
  if who:
    err = t.stats.get("error") or ("not found" if t.stats.get("found") is False else "failed")
    return Block("failure", t.text, f"{note}; {who} failure: {err}")
  cls = tool_registry.get(t.name)
  return Block(cls.result_label if cls is not None else "output", t.text, note)


def turns(traj: Trajectory, tokenizer: Tokenizer | None = None) -> list[Turn]:
  """The episode turn by turn: each call's generated blocks, then the tool results it caused,
  then any compaction that ran before the next call (its stub decoded when a tokenizer is
  given)."""
  out = []
  for call in traj.calls:
    blocks = generated_blocks(call.text)
    blocks += [_tool_block(t) for t in traj.tools if t.after_call == call.index]
    for r in traj.removals:
      if r.before_call == call.index + 1:
        stub = tokenizer.decode(r.inserted.tolist()) if tokenizer is not None else ""
        note = f"{r.policy}: {r.label}, {r.removed.size} tokens removed at {r.offset}"
        blocks.append(Block("compaction", stub, note))
    out.append(Turn(call.index, call, tuple(blocks)))
  return out


@dataclasses.dataclass(frozen=True)
class TokenRow:
  """One token of a training sequence, as drawn."""

  seq: int
  pos: int
  token_id: int
  text: str
  mask: int
  version: int
  logprob: float


def token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
  """What a single token shows as: its decoded text (byte-level pieces that are not a whole
  character fall back to the vocabulary entry), or `<id>` without a tokenizer."""
  if tokenizer is None:
    return f"<{token_id}>"
  text = tokenizer.decode([token_id])
  if "\ufffd" in text or text == "":
    return tokenizer.id_to_token(token_id) or f"<{token_id}>"
  return text


def token_rows(traj: Trajectory, tokenizer: Tokenizer | None = None) -> list[list[TokenRow]]:
  """Per training sequence, every token with its loss mask, version and behaviour logprob."""
  cache: dict[int, str] = {}
  out = []
  for si, seq in enumerate(traj.training_sequences()):
    rows = []
    for pos, (tid, m, v, lp) in enumerate(
      zip(
        seq["tokens"].tolist(),
        seq["loss_mask"].tolist(),
        seq["versions"].tolist(),
        seq["logprobs"].tolist(),
      )
    ):
      if tid not in cache:
        cache[tid] = token_text(tokenizer, tid)
      rows.append(TokenRow(si, pos, tid, cache[tid], int(m), int(v), float(lp)))
    out.append(rows)
  return out


def reward_parts(traj: Trajectory, stored: float | None = None) -> dict[str, Any]:
  """The reward as the learner saw it (`stored`, when the run recorded one) and recomputed with
  its parts: answer metric (F1, with the alternative-answer blend), exact match, format gate,
  the invalid-question penalty, and exclusion for an environment failure."""
  r = reward_lib.trajectory_reward(traj)
  return {
    "stored_score": stored,
    "recomputed_score": r.score,
    "f1_blend": r.correctness,
    "em": eval_metrics.exact_match(traj.pred_answer, traj.answers) if traj.answers else None,
    "format_ok": r.format_ok,
    "format_problems": sorted({p for c in traj.calls for p in c.format_problems}),
    "judged_invalid": r.judged_invalid,
    "environment_failure": r.environment_failure,
    "pred_answer": traj.pred_answer,
    "gold": list(traj.answers),
    "finish_reason": traj.finish_reason,
  }


def tool_rows(traj: Trajectory) -> list[dict[str, Any]]:
  """One row per tool call: what was asked, how it went, and whose fault a failure was."""
  rows = []
  for t in traj.tools:
    s = t.stats
    rows.append({
      "after_call": t.after_call, "tool": t.name, "argument": t.argument,
      "provider": s.get("provider", ""), "latency_s": round(float(t.latency_s or s.get("latency_s", 0.0)), 3),
      "attempts": s.get("attempts", 1), "cache_hit": bool(s.get("cache_hit", False)),
      "tokens": t.num_tokens, "failure": tool_attribution(t), "error": s.get("error") or "",
    })  # fmt: skip
  return rows


def sequence_summary(traj: Trajectory) -> list[dict[str, Any]]:
  """Per training sequence: tokens, generated tokens, versions seen, stop reason, calls."""
  out = []
  for seq in traj.training_sequences():
    gen = seq["versions"][seq["loss_mask"] > 0]
    out.append({
      "tokens": seq.num_tokens, "generated": int(seq["loss_mask"].sum()),
      "versions": sorted({int(v) for v in gen.tolist()}), "stop": seq.stop_reason,
      "calls": list(seq.calls),
    })  # fmt: skip
  return out


def versions_of(rows: Sequence[Sequence[TokenRow]]) -> list[int]:
  return sorted({r.version for seq in rows for r in seq if r.mask})
