"""The one metric writer: TensorBoard event files plus a JSONL log, on host 0 only, and
optionally a Weights & Biases run beside them (`WandbConfig`), the way AReaL and verl users watch
their runs; the JSONL log stays the record the reports and sweeps read.

`write` returns immediately: values (possibly still-computing jax arrays) are fetched and written
by a single background thread, so logging never stalls a training step. Other hosts get a writer
that does nothing, so call sites need no `if process_index() == 0`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import resource
import secrets
import sys
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

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


WANDB_MODES = ("online", "offline")


@dataclasses.dataclass(frozen=True, kw_only=True)
class WandbConfig:
  """A W&B run the metrics are also logged to (process 0 only, like the rest)."""

  # W&B project the run is filed under.
  project: str = "asearcher"
  # The run's display name; None: W&B's own.
  name: str | None = None
  # W&B entity (user or team); None: the logged-in default.
  entity: str | None = None
  # "online" streams to W&B (needs WANDB_API_KEY or `wandb login`); "offline" writes the run
  # under `directory` for a later `wandb sync` (hosts without egress, tests).
  mode: Literal["online", "offline"] = "online"
  # Where W&B keeps its files (its wandb/ folder); None: the metric directory.
  directory: str | None = None
  # Resume the W&B run of this id (a restarted trainer continues one curve); None: a new run,
  # whose id is kept in <metric dir>/wandb_run_id so a restart in the same run resumes it.
  run_id: str | None = None

  def __post_init__(self) -> None:
    if self.mode not in WANDB_MODES:
      raise ValueError(f"WandbConfig.mode must be one of {WANDB_MODES}, got {self.mode!r}")
    if not self.project.strip():
      raise ValueError("WandbConfig.project must not be empty")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetricWriterConfig:
  """Where a run's metrics go besides metrics.jsonl (always written)."""

  # TensorBoard event files in the metric directory (`tensorboard --logdir RUN/metrics`).
  tensorboard: bool = True
  # A W&B run beside them; None: none (wandb is not imported).
  wandb: WandbConfig | None = None


# The id of a run's W&B run, kept in its metric directory so that a resumed trainer logs on.
WANDB_RUN_ID = "wandb_run_id"


class MetricWriter:
  """Writes scalar metrics namespaced like `ppo/loss`, `rollout/reward`, `timing/step_s`."""

  def __init__(
    self,
    logdir: str | Path | None,
    *,
    tensorboard: bool = True,
    config: MetricWriterConfig | None = None,
  ):
    config = config or MetricWriterConfig(tensorboard=tensorboard)
    self.enabled = logdir is not None and jax.process_index() == 0
    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrics")
    self._pending: list[Future] = []
    self._tb = None
    self._jsonl = None
    self._wandb = None
    if not self.enabled:
      return
    self.logdir = Path(logdir)
    self.logdir.mkdir(parents=True, exist_ok=True)
    self._jsonl = open(self.logdir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
    if config.tensorboard:
      from tensorboardX import SummaryWriter

      self._tb = SummaryWriter(str(self.logdir))
    if config.wandb is not None:
      self._wandb = _wandb_run(config.wandb, self.logdir)

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
    if self._wandb is not None:
      self._wandb.log(values, step=step)

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
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None


def _wandb_run(config: WandbConfig, logdir: Path) -> Any:
  """A started W&B run for `config`; its id is kept in `logdir` so that a trainer restarted on
  the same run directory resumes the same W&B run instead of starting a second curve."""
  import wandb

  id_file = logdir / WANDB_RUN_ID
  run_id = config.run_id or (id_file.read_text().strip() if id_file.exists() else None)
  directory = Path(config.directory) if config.directory else logdir
  directory.mkdir(parents=True, exist_ok=True)
  run = wandb.init(
    project=config.project, name=config.name, entity=config.entity, mode=config.mode,
    dir=str(directory), id=run_id or secrets.token_hex(4), resume="allow",
    settings=wandb.Settings(console="off", silent=True),
  )  # fmt: skip
  id_file.write_text(run.id + "\n")
  return run
