"""Weight sync: the learner's new policy version reaches the samplers, and the version number
reaches the staleness manager.

In-process (`InProcessWeightSync`): the learner's params go straight to the Driver as device
arrays (no host round trip). The learner donates its train state every optimizer step, so the
engine gets a copy (`Learner.params_copy`), made on device. `update_params` swaps the weights
between two decode steps and re-prefills every in-flight slot, so running episodes continue
under the new policy (their tokens carry the new version from then on).

Multi-process (`DirectoryWeightPublisher` on the trainer, `DirectoryWeightWatcher` next to each
server): the trainer writes `v<version>/` (HF safetensors + config.json via `model.hf_io`), then
atomically replaces the `LATEST` pointer (a JSON file: version + directory). Watchers poll the
pointer, load a newer version and call `update_params` on their driver. A reader never sees a
half-written directory: the pointer moves only after the directory is complete and renamed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from flax import nnx

from asearcher_jax.model import hf_io
from asearcher_jax.rl.staleness import StalenessManager

log = logging.getLogger(__name__)

LATEST = "LATEST"


class ParamsSink(Protocol):
  """What receives weights: the in-process `serving.driver.Driver`."""

  def update_params(
    self, params: nnx.State, version: int, timeout: float = ..., *, recompute: bool | None = ...
  ) -> float: ...


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
  keep_versions: directories kept by the publisher (older ones deleted); >= 1.
  dtype: safetensors dtype of published weights; None keeps the param dtype.
  """

  timeout_s: float = 600.0
  keep_versions: int = 2
  dtype: str | None = None

  def __post_init__(self):
    if self.timeout_s <= 0:
      raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
    if self.keep_versions < 1:
      raise ValueError(f"keep_versions must be >= 1, got {self.keep_versions}")


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


# --- multi-process: a versioned directory and a watcher -----------------------------------------


def version_dir(root: str | Path, version: int) -> Path:
  return Path(root) / f"v{version:08d}"


def read_latest(root: str | Path) -> dict[str, Any] | None:
  """The LATEST pointer ({"version", "path", "time"}), or None if nothing is published."""
  try:
    return json.loads((Path(root) / LATEST).read_text(encoding="utf-8"))
  except FileNotFoundError:
    return None
  except json.JSONDecodeError:  # cannot happen with os.replace, but never crash a watcher
    log.warning("unreadable %s pointer in %s", LATEST, root)
    return None


class DirectoryWeightPublisher:
  """Trainer side: writes each version as HF safetensors, then moves the LATEST pointer."""

  def __init__(
    self,
    root: str | Path,
    graphdef: nnx.GraphDef,
    staleness: StalenessManager | None = None,
    config: WeightSyncConfig = WeightSyncConfig(),
  ) -> None:
    self.root = Path(root)
    self.root.mkdir(parents=True, exist_ok=True)
    self.graphdef = graphdef
    self.staleness = staleness
    self.config = config

  def publish(self, learner: PolicySource) -> dict[str, float]:
    t0 = time.perf_counter()
    path = self.write(learner.params_copy(), learner.version)
    if self.staleness is not None:
      # Servers stamp tokens with the version they actually run, so staleness measured from
      # token versions stays exact while they catch up.
      self.staleness.set_version(learner.version)
    log.info("published version %d to %s", learner.version, path)
    return {"weight_sync/total_s": time.perf_counter() - t0}

  def write(self, params: nnx.State, version: int) -> Path:
    final = version_dir(self.root, version)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    hf_io.save(nnx.merge(self.graphdef, params), tmp, dtype=self.config.dtype)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = self.root / (LATEST + ".tmp")
    pointer.write_text(json.dumps({"version": version, "path": final.name, "time": time.time()}))
    with open(pointer, "rb") as f:
      os.fsync(f.fileno())
    os.replace(pointer, self.root / LATEST)
    self._prune(version)
    return final

  def _prune(self, newest: int) -> None:
    keep = self.config.keep_versions
    versions = sorted(
      int(p.name[1:]) for p in self.root.glob("v*") if p.is_dir() and p.name[1:].isdigit()
    )
    for v in versions:
      if v <= newest - keep:
        shutil.rmtree(version_dir(self.root, v), ignore_errors=True)


class DirectoryWeightWatcher:
  """Server side: polls LATEST and hands the weights it points to to the driver (`update_params`).

  The server runs whatever LATEST points to: a pointer it has not loaded yet is loaded, the
  first one included, so a server started from any init (or restarted mid-run) converges on the
  trainer's weights. A pointer to a version <= the one running (a trainer that resumed from an
  older checkpoint, or a first load over the init) is loaded with `recompute=True`: keys/values
  cached under other weights must not be continued.

  `poll_once()` does one check (tests, or a caller's own loop); `start()` runs it on a daemon
  thread every `poll_s` seconds. Loading failures are logged and retried at the next poll.
  `status()` says which pointer is loaded (servers report it on /health).
  """

  def __init__(
    self,
    root: str | Path,
    sink: ParamsSink,
    *,
    version: int = 0,
    poll_s: float = 1.0,
    load: Callable[[Path], nnx.State] | None = None,
    config: WeightSyncConfig = WeightSyncConfig(),
  ) -> None:
    self.root = Path(root)
    self.sink = sink
    self.version = version
    self.poll_s = poll_s
    self.config = config
    self._load = load or _load_state
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self.loaded: list[int] = []
    self.pointer: dict[str, Any] | None = None  # the LATEST pointer last loaded

  def poll_once(self) -> int | None:
    """Loads and applies the pointed-to version if the pointer moved; returns it, else None."""
    latest = read_latest(self.root)
    if latest is None or _same_pointer(latest, self.pointer):
      return None
    version = int(latest["version"])
    params = self._load(self.root / latest["path"])
    reset = True if version <= self.version else None  # None: the driver's kv_on_update
    self.sink.update_params(params, version, timeout=self.config.timeout_s, recompute=reset)
    self.version = version
    self.pointer = latest
    self.loaded.append(version)
    log.info("loaded version %d from %s", version, self.root / latest["path"])
    return version

  def status(self) -> dict[str, Any] | None:
    """{"version", "time"} of the loaded pointer (its publish time identifies it); None yet."""
    p = self.pointer
    return None if p is None else {"version": int(p["version"]), "time": p.get("time")}

  def start(self) -> None:
    self._thread = threading.Thread(target=self._run, name="weight-watcher", daemon=True)
    self._thread.start()

  def stop(self, timeout: float = 30.0) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout)
      self._thread = None

  def _run(self) -> None:
    while not self._stop.wait(self.poll_s):
      try:
        self.poll_once()
      except Exception:  # a torn or pruned directory: try again at the next poll
        log.exception("weight watcher: loading from %s failed", self.root)


def _same_pointer(a: dict[str, Any], b: dict[str, Any] | None) -> bool:
  keys = ("version", "path", "time")
  return b is not None and all(a.get(k) == b.get(k) for k in keys)


def _load_state(path: Path) -> nnx.State:
  model, _ = hf_io.load(path)
  return nnx.state(model)
