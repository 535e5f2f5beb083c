"""The one metric writer: TensorBoard event files plus a JSONL log, on host 0 only.

`write` returns immediately: values (possibly still-computing jax arrays) are fetched and written
by a single background thread, so logging never stalls a training step. Other hosts get a writer
that does nothing, so call sites need no `if process_index() == 0`.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np

log = logging.getLogger(__name__)


def peak_rss_mb() -> float:
  """This process's peak resident memory so far, in MB (the figure memory bars are judged by)."""
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux, bytes on macOS
  return peak / 2**20 if sys.platform == "darwin" else peak / 1024.0


_seen_peak_mb = 0.0  # the highest host_memory() peak reported so far (it never falls)


def host_memory() -> dict[str, float]:
  """`host/rss_mb` (resident now; Linux only) and `host/peak_rss_mb`, logged every RL step so
  that memory growing over a run shows as a curve, not only as a peak at the end."""
  out = {"host/peak_rss_mb": peak_rss_mb()}
  try:
    with open("/proc/self/statm") as f:
      out["host/rss_mb"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
  except (OSError, ValueError, IndexError):
    return out
  # The two are read a moment apart (and statm counts pages the kernel's peak has not caught up
  # with yet): the peak is at least what was ever resident at a reading, and never falls.
  global _seen_peak_mb
  _seen_peak_mb = max(_seen_peak_mb, out["host/peak_rss_mb"], out["host/rss_mb"])
  out["host/peak_rss_mb"] = _seen_peak_mb
  return out


class MetricWriter:
  """Writes scalar metrics namespaced like `ppo/loss`, `rollout/reward`, `timing/step_s`."""

  def __init__(self, logdir: str | Path | None, *, tensorboard: bool = True):
    self.enabled = logdir is not None and jax.process_index() == 0
    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrics")
    self._pending: list[Future] = []
    self._tb = None
    self._jsonl = None
    if not self.enabled:
      return
    self.logdir = Path(logdir)
    self.logdir.mkdir(parents=True, exist_ok=True)
    self._jsonl = open(self.logdir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
    if tensorboard:
      from tensorboardX import SummaryWriter

      self._tb = SummaryWriter(str(self.logdir))

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    if not self.enabled:
      return
    self._pending = [f for f in self._pending if not f.done()]
    self._pending.append(self._pool.submit(self._write, int(step), dict(metrics), time.time()))

  def _write(self, step: int, metrics: dict[str, Any], wall: float) -> None:
    values = {k: float(np.asarray(jax.device_get(v))) for k, v in metrics.items()}
    self._jsonl.write(json.dumps({"step": step, "time": wall, **values}) + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for k, v in values.items():
        self._tb.add_scalar(k, v, step, walltime=wall)

  def flush(self) -> None:
    for f in self._pending:
      f.result()
    self._pending.clear()
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    self.flush()
    self._pool.shutdown(wait=True)
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tb is not None:
      self._tb.close()
