"""Weight sync: the learner's new policy version reaches the samplers.

A sync only moves weights: the trainer owns the version (the learner's step advances it) and,
once `publish` has returned, tells the staleness manager (`rl.trainer.Trainer.publish`), so the
version the admission rule uses changes in one place. `publish` returns once the samplers run the
version (in process) or once the write is handed over (the store, background): either way every
sampler stamps its tokens with the version it actually runs, so staleness measured from token
versions stays exact. `flush` waits for the last version to be committed and raises a failed
write; `close` ends the sync (the `WeightSync` protocol; every implementation has both).

In-process (`InProcessWeightSync`): the learner's params go straight to the Driver as device
arrays (no host round trip). The learner donates its train state every optimizer step, so the
engine gets a copy (`Learner.params_copy`), made on device. `update_params` swaps the weights
between two decode steps and re-prefills every in-flight slot, so running episodes continue
under the new policy (their tokens carry the new version from then on).

Multi-process: `DirectoryWeightPublisher` writes each version into the versioned weight store
(`serving.weights_dir`: a local directory or a gs:// URL, one tensorstore array per parameter in
bf16 by default, a commit marker, an atomic LATEST pointer), which every `serve-model` watches
and reads straight into its own sharding. The store's format, pointer and watcher live on the
serving side, so the engine never depends on the trainer.

Writing a version takes seconds per GB (benchmarks/weight_sync.py), so the publisher can let the
trainer step on meanwhile (`WeightSyncConfig.background`): `publish` takes a snapshot on the
caller's thread (the learner's device copy, the cast to the publish dtype and the start of the
device->host copies of this process's own shards: XLA work every process must launch in the same
order, and the train state is donated by the next step) and hands it to one writer thread. One
write is in flight at a time; a version published while another still waits to start replaces it
(the servers only ever want the newest; the superseded one is counted, never half-written). A
failed write is raised at the next `publish`, `flush` or `close`; `flush` (end of a run, before
servers are awaited) and `close` wait for the writes, at most `timeout_s`.

Under jax.distributed the writer threads of all processes write the same versions: process 0
picks the newest waiting one and announces it through the coordination service's key-value
store. The write itself issues no XLA computation and no collective (the store's writer meets
the other processes at coordination-service barriers, each with a timeout), so it cannot
interleave with the train step's collectives. That interleaving is what deadlocked the earlier
Orbax-based writer on a second thread: Orbax's multi-host barriers are `sync_global_devices`
collectives, issued there in a different order than the step's on each process, and its
process-global operation ids collided with the checkpointer's own saves.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from etils import epath
from flax import nnx

from asearcher_jax import distributed
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.serving.weights_dir import (
  ParamsSink,
  Snapshot,
  StorePath,
  prune_versions,
  reader_slices,
  snapshot,
  store_path,
  write_snapshot,
)

log = logging.getLogger(__name__)


class PolicySource(Protocol):
  """What produces weights: `rl.learner.Learner`."""

  version: int

  def params_copy(self) -> nnx.State: ...


@runtime_checkable
class WeightSync(Protocol):
  """How a new policy version reaches the samplers: `InProcessWeightSync`,
  `DirectoryWeightPublisher`, `rl.remote.RemoteEngines` (and test doubles)."""

  def publish(self, learner: PolicySource) -> dict[str, float]:
    """Publishes the learner's current params as `learner.version`; returns timing metrics.
    Raises a write that failed since the last call; after `close` it is an error."""
    ...

  def flush(self, timeout: float | None = None) -> None:
    """Waits until the last published version is committed (what every sampler will load);
    raises a failed write, or TimeoutError after `timeout` (default the sync's own) seconds."""
    ...

  def close(self, timeout: float | None = None) -> None:
    """`flush`, then releases what the sync holds (a writer thread); a second call does
    nothing."""
    ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightSyncConfig:
  """Attributes:
  timeout_s: longest a weight update may take (swap + re-prefill, or write + rename).
  keep_versions: versions kept in the store by the publisher (older ones deleted); >= 1.
  dtype: dtype of the published weights (servers cast on load to their own); None keeps each
    param's dtype (float32 master weights publish at twice the bytes).
  compress: zstd-compress the published arrays (~22 % fewer bytes, for a slow link to the
    store; ~1.7x the CPU time to write, benchmarks/weight_sync.py).
  background: the store's publisher writes on a thread of its own while the trainer steps on
    (module docstring), under jax.distributed too; False: `publish` returns once the version is
    committed. Off by default, so a run's versions are committed in its step order unless a
    recipe asks for the overlap.
  reader_tensor: the chips each serve-model splits its replica over (`ServingMeshConfig.tensor`;
    the launcher binds both to one number). The store's arrays are laid out so that each chip
    reads only its own slice's bytes (`serving.weights_dir.reader_slices`); a server split
    otherwise still loads every version, reading some bytes twice.
  """

  timeout_s: float = 600.0
  keep_versions: int = 2
  dtype: str | None = "bfloat16"
  compress: bool = False
  background: bool = False
  reader_tensor: int = 1

  def __post_init__(self):
    if self.timeout_s <= 0:
      raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
    if self.keep_versions < 1:
      raise ValueError(f"keep_versions must be >= 1, got {self.keep_versions}")
    if self.reader_tensor < 1:
      raise ValueError(f"reader_tensor must be >= 1, got {self.reader_tensor}")
    if self.dtype is not None:
      try:
        jnp.dtype(self.dtype)
      except TypeError as e:
        raise ValueError(f"dtype must name a numpy/jax dtype or be None, got {self.dtype!r}") from e


class InProcessWeightSync:
  """Learner -> Driver in one process.

  `publish` returns only after the driver has swapped (update_params blocks until the swap and
  the re-prefill are done, and raises if they failed), so the trainer, which tells the staleness
  manager after it, never admits a group against a version the engine does not run; there is
  never a write in flight, so `flush` has nothing to wait for.
  """

  def __init__(self, sink: ParamsSink, config: WeightSyncConfig = WeightSyncConfig()) -> None:
    self.sink = sink
    self.config = config
    self.updates = 0
    self._closed = False

  def publish(self, learner: PolicySource) -> dict[str, float]:
    if self._closed:
      raise RuntimeError("in-process weight sync is closed")
    t0 = time.perf_counter()
    params = learner.params_copy()  # device copy: the learner donates its own buffers
    t1 = time.perf_counter()
    engine_ms = self.sink.update_params(params, learner.version, timeout=self.config.timeout_s)
    self.updates += 1
    return {
      "weight_sync/copy_s": t1 - t0,
      "weight_sync/engine_update_ms": float(engine_ms),
      "weight_sync/total_s": time.perf_counter() - t0,
    }

  def flush(self, timeout: float | None = None) -> None:
    """Nothing to wait for: `publish` returned once the engine ran the version."""

  def close(self, timeout: float | None = None) -> None:
    """Publishing after it is an error (the engine is being torn down)."""
    self._closed = True


_publishers = itertools.count()  # every process creates its publishers in the same order


class DirectoryWeightPublisher:
  """Trainer side: writes each version into the weight store, then moves the LATEST pointer.

  On a multi-host trainer every process publishes (each writes its own shards). With
  `config.background` the writes run on a writer thread (module docstring), under
  jax.distributed too; call `close()` when done."""

  def __init__(
    self,
    root: StorePath,
    graphdef: nnx.GraphDef,
    config: WeightSyncConfig = WeightSyncConfig(),
  ) -> None:
    self.root = store_path(root)
    self.root.mkdir(parents=True, exist_ok=True)
    self.graphdef = graphdef
    self.config = config
    self.written: list[int] = []  # versions committed to the store, in order
    self.superseded: list[int] = []  # versions replaced before their write started
    self.write_s: dict[int, float] = {}  # seconds each committed version's write took
    self._cond = threading.Condition()
    self._pending: dict[int, Snapshot] = {}  # version -> snapshot waiting for the writer
    self._writing: int | None = None  # the version being written
    self._error: BaseException | None = None
    self._last: dict[str, float] = {}  # figures of the last completed write
    self._closed = False
    self._thread: threading.Thread | None = None
    # Coordination-service keys: the same on every process (same creation and write order).
    self._key = f"asearcher/weight_publisher/{next(_publishers)}"
    self._writes = itertools.count()
    self._picks = itertools.count()
    self._cfg: ModelConfig | None = None  # the model's config, written beside each version
    self._reader: dict[str, tuple[int, ...]] | None = None  # each param's slice on one server chip

  def publish(self, learner: PolicySource) -> dict[str, float]:
    with self._cond:
      if self._closed:
        raise RuntimeError(f"weight publisher for {self.root} is closed")
    self._raise_error()
    t0 = time.perf_counter()
    self._remember_config(learner.params)
    # On this thread: the copy (the next step donates the learner's buffers), the cast to the
    # publish dtype and the start of the device->host copies (XLA work every process launches
    # in the same order); the writer only waits for host bytes and writes them.
    snap = snapshot(learner.params_copy(), dtype=self.config.dtype, reader=self._reader)
    snapshot_s = time.perf_counter() - t0
    if not self.config.background:
      path = self.write(snap, learner.version)
      total = time.perf_counter() - t0
      self.written.append(learner.version)
      self.write_s[learner.version] = total - snapshot_s
      figures = self._figures(snap, total, learner.version, path)
      return {**figures, "weight_sync/charged_s": total, "weight_sync/snapshot_s": snapshot_s}
    with self._cond:
      if self._closed:
        raise RuntimeError(f"weight publisher for {self.root} is closed")
      if self._thread is None:
        self._thread = threading.Thread(target=self._write_loop, name="weight-publisher",
                                        daemon=True)  # fmt: skip
        self._thread.start()
      if self._decides():  # the newest replaces any version still waiting (module docstring)
        self.superseded += sorted(self._pending)
        self._pending.clear()
      self._pending[learner.version] = snap
      self._cond.notify_all()
      last = dict(self._last)
    # The trainer tells the staleness manager the learner's version at once: servers stamp
    # tokens with the version they actually run, so staleness measured from token versions
    # stays exact while the write completes.
    return {
      **last, "weight_sync/charged_s": time.perf_counter() - t0,
      "weight_sync/snapshot_s": snapshot_s,
      "weight_sync/superseded": float(len(self.superseded)),
    }  # fmt: skip

  def flush(self, timeout: float | None = None) -> None:
    """Waits until every published version is written (or superseded); raises a failed write,
    or TimeoutError after `timeout` (default `config.timeout_s`) seconds."""
    deadline = time.monotonic() + (self.config.timeout_s if timeout is None else timeout)
    with self._cond:
      while self._pending or self._writing is not None:
        self._wait(deadline, "the weight writes to finish")
    self._raise_error()

  def close(self, timeout: float | None = None) -> None:
    """`flush`, then stops the writer thread; publishing after it is an error. A second call
    does nothing (a write the first one raised is not raised again)."""
    with self._cond:
      if self._closed:
        return
    try:
      self.flush(timeout)
    finally:
      with self._cond:
        self._closed = True
        self._cond.notify_all()
      if self._thread is not None:
        self._thread.join(5.0)
        self._thread = None

  def write(self, params: Snapshot | nnx.State, version: int) -> epath.Path:
    """Writes `params` (a `snapshot`, or a state taken now) as `version` on the caller's
    thread; returns its directory. Every process calls it for the same versions in order."""
    if not isinstance(params, Snapshot):
      self._remember_config(params)
    if isinstance(params, Snapshot):
      snap = params
    else:
      snap = snapshot(params, dtype=self.config.dtype, reader=self._reader)
    assert self._cfg is not None, "write a Snapshot only after a publish or a write of a state"
    final = write_snapshot(
      self.root, snap, version, self._cfg, compress=self.config.compress,
      sync_key=f"{self._key}/write/{next(self._writes)}", timeout_s=self.config.timeout_s,
    )  # fmt: skip
    prune_versions(self.root, keep=self.config.keep_versions, newest=version)
    return final

  # --- internals ------------------------------------------------------------------------------

  def _remember_config(self, params: nnx.State) -> None:
    if self._cfg is None:  # merging references the arrays, copies nothing
      self._cfg = nnx.merge(self.graphdef, params).cfg
      self._reader = reader_slices(self._cfg, self.config.reader_tensor)

  def _decides(self) -> bool:
    """Whether this process chooses which waiting version is written next (process 0; on
    several processes the others write what it announces, so all write the same versions)."""
    return jax.process_index() == 0

  def _figures(self, snap: Snapshot, seconds: float, version: int, path: epath.Path):
    gb = snap.nbytes / 1e9
    log.info("published version %d to %s: %.3f GB in %.2f s", version, path, gb, seconds)
    return {"weight_sync/total_s": seconds, "weight_sync/gb": gb,
            "weight_sync/s_per_gb": seconds / gb}  # fmt: skip

  def _wait(self, deadline: float, what: str) -> None:
    """One wait on the condition (held), or TimeoutError past `deadline`."""
    left = deadline - time.monotonic()
    if left <= 0:
      raise TimeoutError(
        f"weight publisher for {self.root}: waited {self.config.timeout_s:g} s for {what} "
        "(WeightSyncConfig.timeout_s)"
      )
    self._cond.wait(min(left, 1.0))

  def _raise_error(self) -> None:
    with self._cond:
      error, self._error = self._error, None
    if error is not None:
      raise RuntimeError(f"writing weights to {self.root} failed: {error}") from error

  def _next_version(self) -> tuple[int, Snapshot] | None:
    """The version to write next and its snapshot, or None once closed with nothing left.

    Process 0 takes the newest waiting version and announces it through the coordination
    service's key-value store; every other process waits for the announcement, then for its
    own snapshot of that version, and drops the older ones it holds (superseded there too)."""
    pick = f"{self._key}/pick/{next(self._picks)}"
    multi = jax.process_count() > 1
    if self._decides():
      with self._cond:
        while not self._pending and not self._closed:
          self._cond.wait(1.0)
        if not self._pending:
          return None
        version = max(self._pending)
        self.superseded += sorted(v for v in self._pending if v < version)
        snap = self._pending.pop(version)
        self._pending.clear()
        self._writing = version
      if multi:
        distributed.kv_set(pick, str(version))
      return version, snap
    while (value := distributed.kv_get(pick, 1.0)) is None:
      with self._cond:
        if self._closed and not self._pending:
          return None
    version = int(value)
    deadline = time.monotonic() + self.config.timeout_s
    with self._cond:
      while version not in self._pending:
        self._wait(deadline, f"version {version} (process 0 is writing it)")
      self.superseded += sorted(v for v in self._pending if v < version)
      snap = self._pending.pop(version)
      for v in [v for v in self._pending if v < version]:
        del self._pending[v]
      self._writing = version
    return version, snap

  def _write_loop(self) -> None:
    while True:
      try:
        picked = self._next_version()
      except BaseException as e:  # a follower that never got its snapshot: raised later
        log.exception("weight publisher for %s: choosing the next version failed", self.root)
        with self._cond:
          self._error, self._writing = e, None
          self._cond.notify_all()
        continue
      if picked is None:
        return
      version, snap = picked
      try:
        t0 = time.perf_counter()
        path = self.write(snap, version)
        figures = self._figures(snap, time.perf_counter() - t0, version, path)
        figures["weight_sync/written_version"] = float(version)
      except BaseException as e:  # raised on the trainer's thread at its next call
        log.exception("writing weights version %d to %s failed", version, self.root)
        figures, error = None, e
      else:
        error = None
      with self._cond:
        self._writing = None
        if error is not None:
          self._error = error
        else:
          self.written.append(version)
          self.write_s[version] = figures["weight_sync/total_s"]
          self._last = figures
        self._cond.notify_all()
