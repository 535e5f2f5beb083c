"""The replay queue between rollouts and the learner: bounded, oldest-first, each group used once,
persisted append-only so that accepted-but-untrained groups survive a crash.

On disk (when `directory` is set) there are two append-only logs:
  groups.log     one framed record per pushed group: 4-byte length, 4-byte crc32, msgpack payload
                 (arrays as raw bytes, so 150k-token trajectories stay cheap);
  consumed.jsonl one line per committed batch: {"ids": [...]}.
Every append is flushed and fsync'd before `push`/`commit` returns. Reopening replays both logs:
pushed groups whose id was never committed come back in their original order, committed ones
never again. A torn last record (crash mid-write) is detected by its length/crc and cut off.

With `ship_to` (a run directory on a bucket: a gs:// URL or a bucket mount) the logs are still
appended on local disk (`directory`), and shipped there in whole objects (`storage.ShippedJournal`:
sealed segments, never appended to) at every `commit` and `sync` (the trainer syncs before each
checkpoint); reopening where the local logs are gone (a restarted VM) rebuilds them from the
segments, so the queue comes back as it was at the last shipment. Appending on a bucket mount would
re-upload the whole object at every flush.

Consumption is two-phase so a crash cannot lose or double-train a group: `take` leases groups
(in memory only) and `commit(ids)` makes their consumption durable. Call `commit` once the
parameters trained on them are durable (after the step's checkpoint), or set
`commit_on_take=True` where losing those groups on a crash is acceptable.

Diagnostics are kept per trajectory-length bucket (accept rate, staleness at training time,
waiting time), so long trajectories are visibly neither starved nor trained at unbounded lag.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import heapq
import json
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from asearcher_jax import storage
from asearcher_jax.agent.trajectory import PER_TOKEN_FIELDS, TrainingSequence, Trajectory

_HEADER = struct.Struct("<II")  # payload length, crc32
GROUPS_LOG = "groups.log"
CONSUMED_LOG = "consumed.jsonl"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplayConfig:
  """Attributes:
  capacity: most groups held (pending + leased); `push` waits for room up to its timeout.
  directory: where the logs live; None keeps the queue in memory only (tests, sync runs).
  fsync: fsync every append (off only for throwaway runs on slow disks).
  ship_to: where the logs are shipped in sealed segments (module docstring); None: `directory`
    alone holds them.
  commit_on_take: make consumption durable at `take` instead of at an explicit `commit`.
  length_buckets: upper edges (tokens per trajectory) of the diagnostic buckets; one more bucket
    holds everything longer.
  compact_after: on open, rewrite the groups log without consumed groups once at least this many
    consumed records are in it; 0 never compacts.
  max_head_staleness: at `take`, discard (durably) groups whose oldest generated token is more
    than this many versions behind `current_version`, making eta a hard bound even for groups
    overtaken by faster ones; None (AReaL's behaviour) trains every group.
  """

  capacity: int = 1024
  directory: str | None = None
  fsync: bool = True
  ship_to: str | None = None
  commit_on_take: bool = False
  length_buckets: tuple[int, ...] = (1024, 4096, 16384)
  compact_after: int = 256
  max_head_staleness: int | None = None

  def __post_init__(self):
    if self.capacity < 1:
      raise ValueError(f"capacity must be >= 1, got {self.capacity}")
    if list(self.length_buckets) != sorted(set(self.length_buckets)) or any(
      b <= 0 for b in self.length_buckets
    ):
      raise ValueError(f"length_buckets must be positive and increasing: {self.length_buckets}")
    if self.ship_to is not None and self.directory is None:
      raise ValueError("ship_to needs a local directory to append the logs in")
    if self.compact_after < 0:
      raise ValueError(f"compact_after must be >= 0, got {self.compact_after}")
    if self.max_head_staleness is not None and self.max_head_staleness < 0:
      raise ValueError(f"max_head_staleness must be >= 0, got {self.max_head_staleness}")


Sequences = list[Mapping[str, Any]]  # one trajectory's training sequences


@dataclasses.dataclass(kw_only=True)
class Group:
  """One accepted GRPO group: n trajectories of one dataset item.

  Attributes:
    group_id: unique id (e.g. "<item id>/<attempt>"); the unit of "used exactly once".
    trajectories: per trajectory, its training sequences (dicts or TrainingSequence with tokens,
      loss_mask, logprobs, versions).
    advantages: per trajectory, its group-centred score (`rl.scoring.score_group`), which the
      learner transforms (bias, scale, clip, optional group normalisation) into the advantage of
      each of its generated tokens. Stored as "advantages" (records written before the rename
      say "rewards"; `decode_group` reads both).
    created_version: policy version when the group was admitted (orders batches oldest-first).
    created_at: wall time of admission (ties within a version).
    enqueued_at: wall time of `push` (set by the queue).
    metadata: JSON-able extras (raw scores, qid, agent stats, ...).
  """

  group_id: str
  trajectories: list[Sequences]
  advantages: list[float]
  created_version: int
  created_at: float = 0.0
  enqueued_at: float = 0.0
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if len(self.advantages) != len(self.trajectories):
      raise ValueError(
        f"group {self.group_id}: {len(self.advantages)} advantages for "
        f"{len(self.trajectories)} trajectories"
      )

  @classmethod
  def from_trajectories(
    cls,
    group_id: str,
    trajectories: Sequence[Trajectory],
    advantages: Sequence[float],
    *,
    created_version: int,
    created_at: float,
    metadata: dict[str, Any] | None = None,
  ) -> Group:
    """A group from agent trajectories (their prefix-merged training sequences) and the
    per-trajectory advantages the learner should see (`rl.scoring.score_group`'s output)."""
    return cls(
      group_id=group_id,
      trajectories=[list(t.training_sequences()) for t in trajectories],
      advantages=[float(a) for a in advantages],
      created_version=created_version,
      created_at=created_at,
      metadata=dict(metadata or {}),
    )

  def trajectory_lengths(self) -> list[int]:
    """Tokens per trajectory (all its training sequences); cached, groups are immutable."""
    if "_lengths" not in self.__dict__:
      self.__dict__["_lengths"] = [sum(len(s["tokens"]) for s in t) for t in self.trajectories]
    return self.__dict__["_lengths"]

  def head_versions(self) -> list[int]:
    """Per trajectory, the oldest policy version of any generated token (-1 if none); cached."""
    if "_heads" not in self.__dict__:
      out = []
      for t in self.trajectories:
        heads = [
          int(v[v >= 0].min()) for v in (np.asarray(s["versions"]) for s in t) if (v >= 0).any()
        ]
        out.append(min(heads, default=-1))
      self.__dict__["_heads"] = out
    return self.__dict__["_heads"]

  @property
  def num_tokens(self) -> int:
    return sum(self.trajectory_lengths())


# --- serialization ----------------------------------------------------------------------------


def _encode_seq(s: Mapping[str, Any]) -> dict[str, Any]:
  arrays = {}
  for k in s:
    a = np.asarray(s[k])
    arrays[k] = [a.dtype.str, list(a.shape), a.tobytes()]
  out: dict[str, Any] = {"arrays": arrays}
  if isinstance(s, TrainingSequence):
    out["stop_reason"] = s.stop_reason
    out["calls"] = list(s.calls)
  return out


def _decode_seq(d: Mapping[str, Any]) -> Mapping[str, Any]:
  arrays = {
    k: np.frombuffer(raw, dtype=np.dtype(dt)).reshape(shape).copy()
    for k, (dt, shape, raw) in d["arrays"].items()
  }
  if "stop_reason" in d and set(arrays) == set(PER_TOKEN_FIELDS):
    return TrainingSequence(**arrays, stop_reason=d["stop_reason"], calls=list(d["calls"]))
  return arrays


def encode_group(g: Group) -> bytes:
  return msgpack.packb(
    {
      "group_id": g.group_id,
      "trajectories": [[_encode_seq(s) for s in t] for t in g.trajectories],
      "advantages": [float(a) for a in g.advantages],
      "created_version": int(g.created_version),
      "created_at": float(g.created_at),
      "enqueued_at": float(g.enqueued_at),
      "metadata": g.metadata,
    },
    use_bin_type=True,
  )


def decode_group(raw: bytes) -> Group:
  d = msgpack.unpackb(raw, raw=False)
  if "rewards" in d:  # written before Group.rewards was named for what it holds
    d["advantages"] = d.pop("rewards")
  d["trajectories"] = [[_decode_seq(s) for s in t] for t in d["trajectories"]]
  return Group(**d)


def _read_records(path: Path) -> tuple[list[bytes], int]:
  """Complete records of a framed log and the byte offset after the last good one."""
  data = path.read_bytes() if path.exists() else b""
  out, pos = [], 0
  while pos + _HEADER.size <= len(data):
    n, crc = _HEADER.unpack_from(data, pos)
    payload = data[pos + _HEADER.size : pos + _HEADER.size + n]
    if len(payload) < n or zlib.crc32(payload) != crc:
      break  # torn tail
    out.append(payload)
    pos += _HEADER.size + n
  return out, pos


def _read_consumed(path: Path) -> set[str]:
  ids: set[str] = set()
  if not path.exists():
    return ids
  for line in storage.jsonl_lines(path.read_text(encoding="utf-8")):
    try:
      ids.update(json.loads(line)["ids"])
    except (json.JSONDecodeError, KeyError, TypeError):
      continue  # torn last line: that commit never completed
  return ids


def logged_group_ids(directory: str | Path) -> set[str]:
  """Ids of every group a replay directory's log holds, queued or already trained. Read-only (a
  live run may be appending): what an observer checks before deciding a group is still in flight."""
  records, _ = _read_records(Path(directory) / GROUPS_LOG)
  return {decode_group(r).group_id for r in records}


# --- diagnostics ------------------------------------------------------------------------------


class _BucketStats:
  def __init__(self) -> None:
    self.accepted = 0
    self.rejected = 0
    self.trained = 0
    self.discarded = 0
    self.staleness: list[int] = []
    self.wait_s: list[float] = []


# --- the queue --------------------------------------------------------------------------------


class ReplayQueue:
  """Thread-safe; `push`/`take` block with a timeout, `apush` is the asyncio-friendly push.

  `on_discard(group)` is called (outside the lock) for every group dropped by
  `max_head_staleness`; wire it to `StalenessManager.on_discard` so the budget comes back.
  """

  def __init__(
    self, config: ReplayConfig, *, on_discard: Callable[[Group], None] | None = None
  ) -> None:
    self.config = config
    self._on_discard = on_discard
    self._cond = threading.Condition(threading.Lock())
    self._heap: list[tuple[int, float, int, Group]] = []  # (created_version, created_at, seq)
    self._seq = 0
    self._ids: set[str] = set()  # pending + leased + consumed-this-session, to refuse duplicates
    self._leased: dict[str, Group] = {}
    self._buckets = [_BucketStats() for _ in range(len(config.length_buckets) + 1)]
    self._groups_file = self._consumed_file = None
    self._shipped: list[storage.ShippedJournal] = []  # groups first: a consumed id needs its group
    if config.directory is not None:
      self._open(Path(config.directory))

  # --- persistence ----------------------------------------------------------------------------

  def _open(self, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    groups_path, consumed_path = directory / GROUPS_LOG, directory / CONSUMED_LOG
    if self.config.ship_to is not None:
      self._shipped = [
        storage.ShippedJournal(directory / name, self.config.ship_to, name=name)
        for name in (GROUPS_LOG, CONSUMED_LOG)
      ]
      for journal in self._shipped:
        journal.open()
    records, good = _read_records(groups_path)
    consumed = _read_consumed(consumed_path)
    # Cut torn tails so that new appends start on a clean record / line.
    if groups_path.exists() and good < groups_path.stat().st_size:
      with open(groups_path, "r+b") as f:
        f.truncate(good)
    if consumed_path.exists():
      raw = consumed_path.read_bytes()
      end = raw.rfind(b"\n") + 1
      if end < len(raw):
        with open(consumed_path, "r+b") as f:
          f.truncate(end)
    pending = [g for g in map(decode_group, records) if g.group_id not in consumed]
    n_consumed = len(records) - len(pending)
    if self.config.compact_after and n_consumed >= self.config.compact_after:
      self._compact(directory, pending)
    self._groups_file = open(groups_path, "ab")  # noqa: SIM115 (held open, closed in close())
    self._consumed_file = open(consumed_path, "ab")  # noqa: SIM115
    for g in pending:
      self._insert(g)
      self._ids.add(g.group_id)
    self._ids.update(consumed)

  def _compact(self, directory: Path, pending: Sequence[Group]) -> None:
    """Rewrites groups.log with only pending groups (atomic rename), then clears consumed.jsonl.
    A crash in between leaves consumed ids that match nothing, which is harmless."""
    tmp = directory / (GROUPS_LOG + ".tmp")
    with open(tmp, "wb") as f:
      for g in pending:
        f.write(_frame(encode_group(g)))
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, directory / GROUPS_LOG)
    with open(directory / CONSUMED_LOG, "w", encoding="utf-8") as f:
      f.flush()
      os.fsync(f.fileno())
    for journal in self._shipped:
      journal.rebase()

  def _append(self, f, data: bytes) -> None:
    f.write(data)
    f.flush()
    if self.config.fsync:
      os.fsync(f.fileno())

  def sync(self) -> int:
    """Ships what the logs gained since the last shipment (with `ship_to`; else nothing);
    returns the bytes shipped."""
    with self._cond:
      return self._ship_locked()

  def _ship_locked(self) -> int:
    return sum(journal.ship() for journal in self._shipped)

  def close(self) -> None:
    if self._groups_file is not None:
      self.sync()
    for f in (self._groups_file, self._consumed_file):
      if f is not None:
        f.close()
    self._groups_file = self._consumed_file = None

  # --- producer side --------------------------------------------------------------------------

  def push(self, group: Group, timeout: float) -> bool:
    """Appends an accepted group (durably, if persisted); False if the queue stayed full for
    `timeout` seconds. A duplicate group id is an error: each group is trained once."""
    deadline = time.monotonic() + timeout
    with self._cond:
      if group.group_id in self._ids:
        raise ValueError(f"group {group.group_id!r} was already pushed")
      while len(self._heap) + len(self._leased) >= self.config.capacity:
        left = deadline - time.monotonic()
        if left <= 0:
          return False
        self._cond.wait(left)
      group.enqueued_at = time.time()
      if self._groups_file is not None:
        # Under the lock so that log order is push order; appends are short.
        self._append(self._groups_file, _frame(encode_group(group)))
      self._insert(group)
      self._ids.add(group.group_id)
      for n in group.trajectory_lengths():
        self._bucket(n).accepted += 1
      self._cond.notify_all()
      return True

  async def apush(self, group: Group, timeout: float) -> bool:
    """`push` on a worker thread, so the event loop never waits on disk or on the lock."""
    return await asyncio.to_thread(self.push, group, timeout)

  def record_rejected(self, trajectory_lengths: Iterable[int]) -> None:
    """Counts the trajectories of a rejected group (filtered/failed) for the accept rates."""
    with self._cond:
      for n in trajectory_lengths:
        self._bucket(n).rejected += 1

  # --- consumer side --------------------------------------------------------------------------

  def take(self, n: int, timeout: float, *, current_version: int | None = None) -> list[Group]:
    """The n oldest groups (by creation version, then time), leased to the caller; [] if fewer
    than n arrived within `timeout` seconds (nothing is taken then). `current_version` feeds
    the staleness diagnostics (version - oldest generated-token version)."""
    if n < 1 or n > self.config.capacity:
      raise ValueError(f"take({n}) with capacity {self.config.capacity}")
    deadline = time.monotonic() + timeout
    limit = self.config.max_head_staleness
    stale: list[Group] = []
    with self._cond:
      while True:
        if limit is not None and current_version is not None:
          stale += self._pop_stale_locked(current_version - limit)
        if len(self._heap) >= n:
          break
        left = deadline - time.monotonic()
        if left <= 0:
          break
        self._cond.wait(left)
      groups = [heapq.heappop(self._heap)[-1] for _ in range(n)] if len(self._heap) >= n else []
      now = time.time()
      for g in groups:
        self._leased[g.group_id] = g
        for length, head in zip(g.trajectory_lengths(), g.head_versions()):
          b = self._bucket(length)
          b.trained += 1
          b.wait_s.append(now - g.enqueued_at)
          if current_version is not None and head >= 0:
            b.staleness.append(current_version - head)
    for g in stale:
      if self._on_discard is not None:
        self._on_discard(g)
    if groups and self.config.commit_on_take:
      self.commit([g.group_id for g in groups])
    return groups

  def _pop_stale_locked(self, min_version: int) -> list[Group]:
    """Removes (durably) pending groups whose head version is below min_version."""
    stale = []
    for entry in list(self._heap):
      g = entry[-1]
      heads = [h for h in g.head_versions() if h >= 0]
      if heads and min(heads) < min_version:
        stale.append(g)
    if not stale:
      return []
    ids = {g.group_id for g in stale}
    self._heap = [e for e in self._heap if e[-1].group_id not in ids]
    heapq.heapify(self._heap)
    if self._consumed_file is not None:
      line = json.dumps({"ids": sorted(ids), "t": time.time(), "discarded": True}) + "\n"
      self._append(self._consumed_file, line.encode("utf-8"))
    for g in stale:
      for length in g.trajectory_lengths():
        self._bucket(length).discarded += 1
    self._cond.notify_all()
    return stale

  def commit(self, group_ids: Sequence[str]) -> None:
    """Makes the consumption of leased groups durable: they never come back."""
    with self._cond:
      unknown = [i for i in group_ids if i not in self._leased]
      if unknown:
        raise KeyError(f"commit of groups that are not leased: {unknown}")
      if self._consumed_file is not None:
        line = json.dumps({"ids": list(group_ids), "t": time.time()}) + "\n"
        self._append(self._consumed_file, line.encode("utf-8"))
        self._ship_locked()
      for i in group_ids:
        del self._leased[i]
      self._cond.notify_all()

  def release(self, group_ids: Sequence[str]) -> None:
    """Returns leased groups to the queue (e.g. a failed step), in their original order."""
    with self._cond:
      for i in group_ids:
        self._insert(self._leased.pop(i))
      self._cond.notify_all()

  # --- introspection --------------------------------------------------------------------------

  def __len__(self) -> int:
    with self._cond:
      return len(self._heap)

  @property
  def num_leased(self) -> int:
    with self._cond:
      return len(self._leased)

  def pending_ids(self) -> list[str]:
    """Pending group ids in the order `take` would return them."""
    with self._cond:
      return [e[-1].group_id for e in sorted(self._heap)]

  def metrics(self, *, reset: bool = True) -> dict[str, float]:
    """Per length bucket: accept rate, trained count, staleness mean/max, waiting time mean/max;
    plus queue size. `reset` starts a new window for the per-bucket numbers."""
    edges = self.config.length_buckets
    out: dict[str, float] = {}
    with self._cond:
      out["replay/pending"] = float(len(self._heap))
      out["replay/leased"] = float(len(self._leased))
      for i, b in enumerate(self._buckets):
        name = f"le_{edges[i]}" if i < len(edges) else f"gt_{edges[-1]}"
        p = f"replay/len_{name}"
        seen = b.accepted + b.rejected
        out[f"{p}/accepted"] = float(b.accepted)
        out[f"{p}/rejected"] = float(b.rejected)
        out[f"{p}/trained"] = float(b.trained)
        out[f"{p}/discarded"] = float(b.discarded)
        if seen:
          out[f"{p}/accept_rate"] = b.accepted / seen
        if b.staleness:
          out[f"{p}/staleness_mean"] = float(np.mean(b.staleness))
          out[f"{p}/staleness_max"] = float(np.max(b.staleness))
        if b.wait_s:
          out[f"{p}/wait_s_mean"] = float(np.mean(b.wait_s))
          out[f"{p}/wait_s_max"] = float(np.max(b.wait_s))
      if reset:
        self._buckets = [_BucketStats() for _ in self._buckets]
    return out

  # --- internals ------------------------------------------------------------------------------

  def _insert(self, g: Group) -> None:
    heapq.heappush(self._heap, (g.created_version, g.created_at, self._seq, g))
    self._seq += 1

  def _bucket(self, length: int) -> _BucketStats:
    return self._buckets[bisect.bisect_left(self.config.length_buckets, length)]


def _frame(payload: bytes) -> bytes:
  return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload
