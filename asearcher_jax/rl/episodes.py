"""The episode export of a training run: every finished episode, with its score and fate, on disk.

The replay log keeps only what the learner needs (token arrays per accepted trajectory); to see
*why* an agent answered too early one needs the whole episode: every LLM call's text and tokens,
every tool call and what it returned, compaction, the reward and whether its group was trained.
`EpisodeLog` appends one JSON line per episode (accepted or rejected group alike) to
`episodes.jsonl.gz`, one gzip member per group, so a crash loses at most the group being written
and the reader simply stops at a torn last member.

One line: {"group_id", "item", "qid", "episode" (index in the group), "created_version" (policy
version at admission), "finished_version" (at scoring), "accepted", "rejection", "score",
"advantage", "trajectory" (`Trajectory.to_json()`), "time"}.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from asearcher_jax import storage
from asearcher_jax.agent.trajectory import Trajectory
from asearcher_jax.errors import AsearcherError

EPISODES_FILE = "episodes.jsonl.gz"


class EpisodeLog:
  """Appends episode records (thread-safe; call it off the event loop: it writes to disk)."""

  def __init__(self, path: str | Path) -> None:
    self.path = Path(path)
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self.lock = threading.Lock()  # held by an append and by `storage.ShippedLogs` shipping it

  def append_group(
    self,
    *,
    group_id: str,
    qid: str,
    trajectories: Sequence[Trajectory | None],
    versions: tuple[int, int],
    scores: Sequence[float | None],
    advantages: Sequence[float | None] | None,
    rejection: str | None,
  ) -> int:
    """One line per episode that ran (None entries never produced a trajectory); returns how
    many were written. `versions` = (at admission, at scoring)."""
    now = time.time()
    lines = []
    for i, t in enumerate(trajectories):
      if t is None:
        continue
      adv = advantages[i] if advantages is not None else None
      rec: dict[str, Any] = {
        "group_id": group_id,
        "item": "/".join(group_id.split("/")[:2]),
        "qid": qid,
        "episode": i,
        "created_version": versions[0],
        "finished_version": versions[1],
        "accepted": rejection is None and adv is not None,
        "rejection": rejection,
        "score": scores[i],
        "advantage": adv,
        "time": now,
        "trajectory": t.to_json(),
      }
      lines.append(json.dumps(rec, ensure_ascii=False))
    if not lines:
      return 0
    blob = gzip.compress(("\n".join(lines) + "\n").encode("utf-8"), compresslevel=6)
    with self.lock, self.path.open("ab") as f:
      f.write(blob)
      f.flush()
    return len(lines)


def _members(raw: bytes) -> Iterator[bytes]:
  """The decompressed gzip members of `raw`, stopping quietly at a torn last one (a crash cuts
  a member short; it never writes bytes that are not gzip). Raises ValueError on such bytes."""
  while raw:
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
      out = d.decompress(raw)
    except zlib.error as e:
      raise ValueError(f"not gzip data ({e})") from None
    if not d.eof:
      return
    yield out
    raw = d.unused_data


def read_episodes(path: str | Path) -> list[dict[str, Any]]:
  """Every complete record of an episode export (`trajectory` left as JSON). A member cut off by
  a crash is skipped (it was never acknowledged); a complete one that does not hold JSON
  objects is corruption, an `AsearcherError` naming the file and line. A log appended on the
  trainer's own disk is read from the segments shipped to `path` (`storage.ShippedLogs`)."""
  raw = storage.read_journal(path)  # a gs:// URL stays one
  if raw is None:
    return []
  out = []
  n = 0
  members = _members(raw)
  while True:
    try:
      chunk = next(members)
    except StopIteration:
      break
    except ValueError as e:
      raise AsearcherError(f"{path}: after line {n}: {e}") from None
    try:
      text = chunk.decode("utf-8")
    except UnicodeDecodeError as e:
      raise AsearcherError(f"{path}: after line {n}: not UTF-8 text ({e.reason})") from None
    for line in storage.jsonl_lines(text):
      n += 1
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise AsearcherError(f"{path}:{n}: not an episode record ({e.msg})") from None
      if not isinstance(record, dict):
        raise AsearcherError(f"{path}:{n}: not an episode record (a JSON object)")
      out.append(record)
  return out
