"""Weight sync: the learner's new policy version reaches the samplers, and the version number
reaches the staleness manager.

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
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Protocol

import jax
import jax.numpy as jnp
from etils import epath
from flax import nnx

from asearcher_jax.rl.staleness import StalenessManager
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


class WeightSync(Protocol):
  def publish(self, learner: PolicySource) -> dict[str, float]:
    """Publishes the learner's current params as `learner.version`; returns timing metrics."""
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
  """

  timeout_s: float = 600.0
  keep_versions: int = 2
  dtype: str | None = "bfloat16"
  compress: bool = False

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
  """Learner -> Driver in one process, then `staleness.set_version`.

  The version is set only after the driver has swapped (update_params blocks until the swap and
  the re-prefill are done), so no group is admitted against a version the engine does not run.
  """

  def __init__(
    self,
    sink: ParamsSink,
    staleness: StalenessManager | None,
    config: WeightSyncConfig = WeightSyncConfig(),
  ) -> None:
    self.sink = sink
    self.staleness = staleness
    self.config = config
    self.updates = 0

  def publish(self, learner: PolicySource) -> dict[str, float]:
    t0 = time.perf_counter()
    params = learner.params_copy()  # device copy: the learner donates its own buffers
    t1 = time.perf_counter()
    engine_ms = self.sink.update_params(params, learner.version, timeout=self.config.timeout_s)
    if self.staleness is not None:
      self.staleness.set_version(learner.version)
    self.updates += 1
    return {
      "weight_sync/copy_s": t1 - t0,
      "weight_sync/engine_update_ms": float(engine_ms),
      "weight_sync/total_s": time.perf_counter() - t0,
    }


class DirectoryWeightPublisher:
  """Trainer side: writes each version into the weight store, then moves the LATEST pointer.

  On a multi-host trainer every process publishes (each writes its own shards)."""

  def __init__(
    self,
    root: StorePath,
    graphdef: nnx.GraphDef,
    staleness: StalenessManager | None = None,
    config: WeightSyncConfig = WeightSyncConfig(),
  ) -> None:
    self.root = store_path(root)
    self.root.mkdir(parents=True, exist_ok=True)
    self.graphdef = graphdef
    self.staleness = staleness
    self.config = config

  def publish(self, learner: PolicySource) -> dict[str, float]:
    t0 = time.perf_counter()
    params = learner.params_copy()
    path = self.write(params, learner.version)
    total = time.perf_counter() - t0
    if self.staleness is not None:
      # Servers stamp tokens with the version they actually run, so staleness measured from
      # token versions stays exact while they catch up.
      self.staleness.set_version(learner.version)
    dtype = self.config.dtype
    gb = sum(x.size * jnp.dtype(dtype or x.dtype).itemsize for x in jax.tree.leaves(params)) / 1e9
    log.info("published version %d to %s: %.3f GB in %.2f s", learner.version, path, gb, total)
    return {"weight_sync/total_s": total, "weight_sync/gb": gb, "weight_sync/s_per_gb": total / gb}

  def write(self, params: nnx.State, version: int) -> epath.Path:
    final = write_version(
      self.root, nnx.merge(self.graphdef, params), version, dtype=self.config.dtype,
      compress=self.config.compress,
    )  # fmt: skip
    prune_versions(self.root, keep=self.config.keep_versions, newest=version)
    return final
