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
(`serving.weights_dir`: a local directory or a gs:// URL, sharded Orbax arrays in bf16 by default,
a commit marker, an atomic LATEST pointer), which every `serve-model` watches and reads straight
into its own sharding. The store's format, pointer and watcher live on the serving side, so the
engine never depends on the trainer.

Writing a version takes seconds per GB (benchmarks/weight_sync.py), so by default the publisher
does not make the trainer wait for it (`WeightSyncConfig.background`): `publish` takes the
learner's device copy on the caller's thread (the train state is donated by the next step) and
hands it to one writer thread. One write is in flight at a time; a version published while
another still waits to start replaces it (the servers only ever want the newest; the superseded
one is counted, never half-written). A failed write is raised at the next `publish`, `flush` or
`close`; `flush` (end of a run, before servers are awaited) and `close` wait for the writes, at
most `timeout_s`. A multi-process trainer writes on the trainer's thread, as before: Orbax's
multi-host save synchronises the processes, and issued from a second thread it interleaves
differently with the train step's collectives on each process (a 2-process run deadlocked in
its first background write).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from etils import epath
from flax import nnx

from asearcher_jax.serving.weights_dir import (
  ParamsSink,
  StorePath,
  prune_versions,
  store_path,
  write_version,
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
    (module docstring; never under jax.distributed, which always writes in the call). Off by
    default: an Orbax save on the writer thread can collide with the trainer's own checkpoint
    save (both wait on Orbax's step-directory signal; seen timing out after 300 s in CI on
    2026-11-25); False: `publish` returns once the version is committed.
  """

  timeout_s: float = 600.0
  keep_versions: int = 2
  dtype: str | None = "bfloat16"
  compress: bool = False
  background: bool = False

  def __post_init__(self):
    if self.timeout_s <= 0:
      raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
    if self.keep_versions < 1:
      raise ValueError(f"keep_versions must be >= 1, got {self.keep_versions}")
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


class DirectoryWeightPublisher:
  """Trainer side: writes each version into the weight store, then moves the LATEST pointer.

  On a multi-host trainer every process publishes (each writes its own shards, in the call).
  With `config.background` and no jax.distributed the writes run on a writer thread (module
  docstring); call `close()` when done."""

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
    self._cond = threading.Condition()
    self._pending: tuple[Any, int] | None = None  # (params, version) waiting for the writer
    self._writing: int | None = None  # the version being written
    self._error: BaseException | None = None
    self._last: dict[str, float] = {}  # figures of the last completed write
    self._closed = False
    self._thread: threading.Thread | None = None

  def publish(self, learner: PolicySource) -> dict[str, float]:
    with self._cond:
      if self._closed:
        raise RuntimeError(f"weight publisher for {self.root} is closed")
    # Under jax.distributed (even one process, as `launch --backend local` starts it) Orbax
    # coordinates every save through the distributed service; a save from a second thread beside
    # the checkpoint's deadlocked there until its 5-minute timeout. So: in the call.
    if not self.config.background or jax.distributed.is_initialized():
      self._raise_error()
      return self._publish_blocking(learner)
    t0 = time.perf_counter()
    self._raise_error()
    # On this thread (the next step donates the learner's buffers); the cast to the publish
    # dtype and everything after it run on the writer.
    params = learner.params_copy()
    with self._cond:
      if self._closed:
        raise RuntimeError(f"weight publisher for {self.root} is closed")
      if self._thread is None:
        self._thread = threading.Thread(target=self._write_loop, name="weight-publisher",
                                        daemon=True)  # fmt: skip
        self._thread.start()
      if self._pending is not None:
        self.superseded.append(self._pending[1])
      self._pending = (params, learner.version)
      self._cond.notify_all()
      last = dict(self._last)
    # The trainer tells the staleness manager the learner's version at once: servers stamp
    # tokens with the version they actually run, so staleness measured from token versions
    # stays exact while the write completes.
    return {
      **last, "weight_sync/charged_s": time.perf_counter() - t0,
      "weight_sync/superseded": float(len(self.superseded)),
    }  # fmt: skip

  def flush(self, timeout: float | None = None) -> None:
    """Waits until every published version is written (or superseded); raises a failed write,
    or TimeoutError after `timeout` (default `config.timeout_s`) seconds."""
    deadline = time.monotonic() + (self.config.timeout_s if timeout is None else timeout)
    with self._cond:
      while self._pending is not None or self._writing is not None:
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

  def write(self, params: nnx.State, version: int) -> epath.Path:
    """Writes `params` as `version` now, on the caller's thread; returns its directory."""
    final = write_version(
      self.root, nnx.merge(self.graphdef, params), version, dtype=self.config.dtype,
      compress=self.config.compress,
    )  # fmt: skip
    prune_versions(self.root, keep=self.config.keep_versions, newest=version)
    return final

  # --- internals ------------------------------------------------------------------------------

  def _publish_blocking(self, learner: PolicySource) -> dict[str, float]:
    t0 = time.perf_counter()
    params = learner.params_copy()
    path = self.write(params, learner.version)
    total = time.perf_counter() - t0
    self.written.append(learner.version)
    figures = self._figures(params, total, learner.version, path)
    return {**figures, "weight_sync/charged_s": total}

  def _figures(self, params: Any, seconds: float, version: int, path: epath.Path):
    dtype = self.config.dtype
    gb = sum(x.size * jnp.dtype(dtype or x.dtype).itemsize for x in jax.tree.leaves(params)) / 1e9
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

  def _write_loop(self) -> None:
    while True:
      with self._cond:
        while self._pending is None and not self._closed:
          self._cond.wait(1.0)
        if self._pending is None:
          return
        (params, version), self._pending = self._pending, None
        self._writing = version
        self._cond.notify_all()
      try:
        t0 = time.perf_counter()
        path = self.write(params, version)
        figures = self._figures(params, time.perf_counter() - t0, version, path)
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
          self._last = figures
        self._cond.notify_all()
