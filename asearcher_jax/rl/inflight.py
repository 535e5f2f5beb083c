"""In-flight episodes survive a crash: a journal per episode, saved with each checkpoint, replayed
on restart.

An episode is a deterministic function of what its `generate` calls returned and what its tools
returned. So instead of making every agent resumable, the rollout controller wraps the agent's
generation client and ToolBox for each episode:

  record   every finished generate call (output tokens, logprobs, engine-stamped versions, stop
           reason, plus a hash of its input) and every tool result goes into an `EpisodeJournal`;
           the call in flight is readable too (`progress` of the in-process driver), so tokens
           generated before the checkpoint are kept;
  replay   after a restart the agent runs again from the start against `JournalClient` /
           `JournalToolBox`: recorded calls are answered from the journal (no engine, no tool
           server, the original versions and logprobs), the interrupted call continues from its
           partial tokens with the current weights, and from there the episode runs live.

A replayed call must see exactly the input it saw before (checked by hash, and tool calls by
name and argument); on the first mismatch the rest of the journal is dropped and the episode goes
on live, which is always correct, merely slower. Known edge: a stop string that straddles the
saved partial tokens and the continuation is not matched (stop tokens are).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from asearcher_jax import storage
from asearcher_jax.serving.types import GenerationClient, GenerationResult, SamplingParams
from asearcher_jax.tools.search import Document
from asearcher_jax.tools.toolbox import ToolCall, ToolJob, ToolResult, ToolStats

log = logging.getLogger(__name__)

# Where a run writes its ResumeLog, under its run directory (the trainer and the audit).
RESUME_LOG = "rollout/resumed.jsonl"

# (tokens, logprobs, versions) generated so far for a request id, or None if unknown.
Progress = Callable[[str], tuple[list[int], list[float], list[int]] | None]


def input_digest(token_ids: Sequence[int]) -> str:
  """Identifies a call's input without storing it (inputs grow with every turn)."""
  return hashlib.sha1(np.asarray(token_ids, np.int64).tobytes()).hexdigest()


@dataclasses.dataclass
class EpisodeJournal:
  """Everything one episode received from the engine and the tools so far (JSON-able).

  Attributes:
    calls: finished generate calls: {"input", "n_input", "tokens", "logprobs", "versions",
      "stop_reason"}.
    tools: finished tool calls: {"name", "argument", "result"} (a serialised ToolResult).
    partial: the generate call in flight at the last snapshot: {"input", "n_input", "tokens",
      "logprobs", "versions"}; None if none.
  """

  calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  tools: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  partial: dict[str, Any] | None = None
  # Live bookkeeping (not saved): the request in flight and where to read its progress.
  _inflight: tuple[str, str, int] | None = dataclasses.field(default=None, repr=False)
  _progress: Progress | None = dataclasses.field(default=None, repr=False)

  def snapshot(self) -> dict[str, Any]:
    """A JSON copy, including the tokens generated so far by the call in flight."""
    partial = self.partial
    if self._inflight is not None and self._progress is not None:
      request_id, digest, n_input = self._inflight
      got = self._progress(request_id)
      if got is not None:
        tokens, logprobs, versions = got
        n = min(len(tokens), len(logprobs), len(versions))  # the engine thread may be appending
        done = list(partial["tokens"]) if partial and partial["input"] == digest else []
        partial = {
          "input": digest,
          "n_input": n_input,
          "tokens": done + [int(t) for t in tokens[:n]],
          "logprobs": list(partial["logprobs"] if done else []) + [float(x) for x in logprobs[:n]],
          "versions": list(partial["versions"] if done else []) + [int(v) for v in versions[:n]],
        }
    return {"calls": list(self.calls), "tools": list(self.tools), "partial": partial}

  @classmethod
  def from_snapshot(cls, d: Mapping[str, Any]) -> EpisodeJournal:
    return cls(calls=list(d["calls"]), tools=list(d["tools"]), partial=d.get("partial"))

  @property
  def num_generated(self) -> int:
    n = sum(len(c["tokens"]) for c in self.calls)
    return n + (len(self.partial["tokens"]) if self.partial else 0)


class JournalClient:
  """A GenerationClient that answers from a saved journal first, then records live calls."""

  def __init__(
    self,
    inner: GenerationClient,
    journal: EpisodeJournal,
    saved: EpisodeJournal | None = None,
    *,
    default_stop_ids: Sequence[int] = (),
    on_replayed: Callable[[JournalClient], Awaitable[None]] | None = None,
  ) -> None:
    """`on_replayed` (resumed episodes) is awaited once, when the first call that the journal
    does not answer goes live: the replay is over and its counts are final."""
    self.inner = inner
    self.default_stop_ids = tuple(int(t) for t in default_stop_ids)
    self.journal = journal
    self._replay = list(saved.calls) if saved else []
    self._partial = saved.partial if saved else None
    progress = getattr(inner, "progress", None)
    self._with_id = callable(progress)  # the in-process driver: its progress is readable
    journal._progress = progress if self._with_id else None
    self.replayed_calls = 0
    self.live_calls = 0  # calls that reached the engine (a continued partial call included)
    self.resumed_tokens = 0
    self.mismatched = False
    self._on_replayed = on_replayed if saved is not None else None

  async def generate(
    self,
    token_ids: Sequence[int],
    sampling: SamplingParams,
    max_new_tokens: int,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] | None = None,
  ) -> GenerationResult:
    digest = input_digest(token_ids)
    if self._replay:
      rec = self._replay.pop(0)
      if rec["input"] == digest:
        self.journal.calls.append(rec)
        self.replayed_calls += 1
        return GenerationResult(
          tokens=list(rec["tokens"]),
          logprobs=list(rec["logprobs"]),
          versions=list(rec["versions"]),
          stop_reason=rec["stop_reason"],
        )
      self._diverged("generate")
    prefix = {"tokens": [], "logprobs": [], "versions": []}
    if self._partial is not None:
      if self._partial["input"] == digest:
        prefix = self._partial
        self.resumed_tokens += len(prefix["tokens"])
      else:
        self._diverged("partial generate")
      self._partial = None
    stop_ids = set(stop_token_ids) if stop_token_ids is not None else None
    ends = stop_ids if stop_ids is not None else set(self.default_stop_ids)
    done = _finished_prefix(prefix, max_new_tokens, ends)
    await self.replay_done()
    if done is not None:
      result = done
    else:
      self.live_calls += 1
      result = await self._live(token_ids, digest, prefix, sampling, max_new_tokens, stop, stop_ids)
    self.journal.calls.append({
      "input": digest, "n_input": len(token_ids), "tokens": list(result.tokens),
      "logprobs": [float(x) for x in result.logprobs], "versions": list(result.versions),
      "stop_reason": result.stop_reason,
    })  # fmt: skip
    return result

  async def replay_done(self) -> None:
    """Reports the end of the replay (once; also called when an episode ends inside it)."""
    hook, self._on_replayed = self._on_replayed, None
    if hook is not None:
      await hook(self)

  async def _live(self, token_ids, digest, prefix, sampling, max_new_tokens, stop, stop_ids):
    head = list(prefix["tokens"])
    request_id = f"ep-{uuid.uuid4().hex[:12]}"
    self.journal.partial = dict(prefix, input=digest, n_input=len(token_ids)) if head else None
    self.journal._inflight = (request_id, digest, len(token_ids))
    kwargs = {"request_id": request_id} if self._with_id else {}
    try:
      got = await self.inner.generate(
        [*token_ids, *head],
        sampling,
        max_new_tokens - len(head),
        stop=stop,
        stop_token_ids=None if stop_ids is None else sorted(stop_ids),
        **kwargs,
      )
    finally:
      self.journal._inflight = None
      self.journal.partial = None
    return GenerationResult(
      tokens=head + list(got.tokens),
      logprobs=list(prefix["logprobs"]) + list(got.logprobs),
      versions=list(prefix["versions"]) + list(got.versions),
      stop_reason=got.stop_reason,
    )

  def _diverged(self, what: str) -> None:
    if not self.mismatched:
      log.warning("resumed episode diverged from its journal at a %s call; continuing live", what)
    self.mismatched = True
    self._replay.clear()
    self._partial = None


def _finished_prefix(prefix, max_new_tokens: int, stop_ids: set[int]):
  """The saved partial call had already finished (stop token or length) when it was saved."""
  tokens = prefix["tokens"]
  if not tokens:
    return None
  ended = tokens[-1] in stop_ids
  if not ended and len(tokens) < max_new_tokens:
    return None
  return GenerationResult(
    tokens=list(tokens),
    logprobs=list(prefix["logprobs"]),
    versions=list(prefix["versions"]),
    stop_reason="stop" if ended else "length",
  )


class JournalToolBox:
  """Wraps a ToolBox: replays saved tool results in order, records live ones."""

  def __init__(self, inner: Any, journal: EpisodeJournal, saved: EpisodeJournal | None = None):
    self.inner = inner
    self.journal = journal
    self._replay = list(saved.tools) if saved else []
    self.replayed_tools = 0

  def __getattr__(self, name: str) -> Any:
    return getattr(self.inner, name)

  async def execute(self, call: ToolCall) -> ToolResult:
    if self._replay:
      rec = self._replay.pop(0)
      if rec["name"] == call.name and rec["argument"] == call.argument:
        self.journal.tools.append(rec)
        self.replayed_tools += 1
        return tool_result_from_json(rec["result"])
      log.warning("resumed episode diverged from its journal at a tool call; continuing live")
      self._replay.clear()
    result = await self.inner.execute(call)
    self.journal.tools.append(
      {"name": call.name, "argument": call.argument, "result": tool_result_to_json(result)}
    )
    return result


def tool_result_to_json(r: ToolResult) -> dict[str, Any]:
  return {
    "call": [r.call.name, r.call.argument],
    "jobs": [[j.text, j.short_text, j.label] for j in r.jobs],
    "stats": dataclasses.asdict(r.stats),
    "documents": [d.to_json() for d in r.documents],
    "page": r.page,
    "value": r.value,
  }


def tool_result_from_json(d: Mapping[str, Any]) -> ToolResult:
  return ToolResult(
    call=ToolCall(*d["call"]),
    jobs=tuple(ToolJob(*j) for j in d["jobs"]),
    stats=ToolStats(**d["stats"]),
    documents=tuple(Document.from_json(x) for x in d["documents"]),
    page=d["page"],
    value=d.get("value"),  # older journals: rebuilt from documents / page
  )


@dataclasses.dataclass(kw_only=True)
class GroupJournal:
  """A running group: its item, admission version and time, and one journal per episode."""

  key: str
  index: int
  version: int
  created_at: float
  episodes: list[EpisodeJournal]
  resumed: bool = False

  def snapshot(self) -> dict[str, Any]:
    return {
      "key": self.key,
      "index": self.index,
      "version": self.version,
      "created_at": self.created_at,
      "episodes": [e.snapshot() for e in self.episodes],
    }

  @classmethod
  def from_snapshot(cls, d: Mapping[str, Any]) -> GroupJournal:
    return cls(
      key=d["key"],
      index=int(d["index"]),
      version=int(d["version"]),
      created_at=float(d["created_at"]),
      episodes=[EpisodeJournal.from_snapshot(e) for e in d["episodes"]],
      resumed=True,
    )


class ResumeLog:
  """One JSON line per resumed episode, appended when its replay ends: what its journal held
  and how much of it was answered without the engine or the tools. Operators (and the crash
  tests) read from the run directory that a restart really continued its episodes."""

  def __init__(self, path: str | Path) -> None:
    self.path = Path(path)
    self.path.parent.mkdir(parents=True, exist_ok=True)

  def hook(
    self, key: str, episode: int, saved: EpisodeJournal, tools: Any
  ) -> Callable[[JournalClient], Awaitable[None]]:
    """The `on_replayed` callback of one resumed episode's JournalClient."""

    async def replayed(client: JournalClient) -> None:
      await self.record(key, episode, saved, client, tools)

    return replayed

  async def record(
    self, key: str, episode: int, saved: EpisodeJournal, client: JournalClient, tools: Any
  ) -> None:
    rec = {
      "pid": os.getpid(), "group": key, "episode": episode, "time": time.time(),
      "saved_calls": len(saved.calls), "replayed_calls": client.replayed_calls,
      "saved_tools": len(saved.tools),
      "replayed_tools": tools.replayed_tools if tools is not None else 0,
      "saved_partial_tokens": len(saved.partial["tokens"]) if saved.partial else 0,
      "continued_tokens": client.resumed_tokens, "diverged": client.mismatched,
      "live_calls_before": client.live_calls,
    }  # fmt: skip
    line = json.dumps(rec) + "\n"
    await asyncio.to_thread(self._append, line)

  def _append(self, line: str) -> None:
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(line)
      f.flush()
      os.fsync(f.fileno())


def read_resume_log(path: str | Path) -> list[dict[str, Any]]:
  """The records of a `ResumeLog` (a torn last line from a crash is skipped)."""
  out = []
  p = Path(path)
  for line in storage.jsonl_lines(p.read_text(encoding="utf-8")) if p.exists() else []:
    try:
      out.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return out
