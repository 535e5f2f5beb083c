"""The versioned weights directory: how a trainer hands each policy version to its servers.

Layout: `v<version>/` (HF safetensors + config.json via `model.hf_io`) and a `LATEST` pointer (a
JSON file: version, directory, publish time). The writer completes and renames the directory before
it atomically replaces the pointer, so a reader never sees a half-written version. The trainer's
publisher (`rl.weight_sync`) writes through `write_version`; each `serve-model` runs a
`DirectoryWeightWatcher` that loads whatever the pointer names and hands it to its driver.
"""

from __future__ import annotations

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

log = logging.getLogger(__name__)

LATEST = "LATEST"


class ParamsSink(Protocol):
  """What receives weights: the in-process `serving.driver.Driver`."""

  def update_params(
    self, params: nnx.State, version: int, timeout: float = ..., *, recompute: bool | None = ...
  ) -> float: ...


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


def write_version(root: str | Path, model: nnx.Module, version: int, *, dtype: str | None) -> Path:
  """Writes `model` as `v<version>/`, then moves LATEST to it; returns the version's directory."""
  root = Path(root)
  final = version_dir(root, version)
  tmp = final.with_name(final.name + ".tmp")
  shutil.rmtree(tmp, ignore_errors=True)
  hf_io.save(model, tmp, dtype=dtype)
  shutil.rmtree(final, ignore_errors=True)
  os.replace(tmp, final)
  pointer = root / (LATEST + ".tmp")
  pointer.write_text(json.dumps({"version": version, "path": final.name, "time": time.time()}))
  with open(pointer, "rb") as f:
    os.fsync(f.fileno())
  os.replace(pointer, root / LATEST)
  return final


def prune_versions(root: str | Path, *, keep: int, newest: int) -> None:
  """Deletes version directories older than the `keep` newest (counted back from `newest`)."""
  root = Path(root)
  versions = sorted(int(p.name[1:]) for p in root.glob("v*") if p.is_dir() and p.name[1:].isdigit())
  for v in versions:
    if v <= newest - keep:
      shutil.rmtree(version_dir(root, v), ignore_errors=True)


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
    timeout_s: float = 600.0,
  ) -> None:
    self.root = Path(root)
    self.sink = sink
    self.version = version
    self.poll_s = poll_s
    self.timeout_s = timeout_s
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
    self.sink.update_params(params, version, timeout=self.timeout_s, recompute=reset)
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
