"""A stage display with an ETA for long pipelines (the quickstart): what runs now, how far it is,
and when the whole thing should end.

Each stage has an a-priori cost estimate in seconds. The ETA is the remaining estimated cost,
rescaled by how fast the finished stages ran compared with their estimates, plus the unfinished
part of the current stage. On a terminal it draws a rich progress bar; otherwise (CI, pipes) it
prints one line per stage start/end and per 10% of progress, so logs stay readable.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, TextIO

from asearcher_jax import metric_writer

# Seconds of "as estimated" evidence the ETA starts from (see StageTracker._speed).
PRIOR_S = 30.0


def _fmt_s(s: float) -> str:
  s = max(round(s), 0)
  return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Stage:
  """Handle of the running stage: report progress as a fraction in [0, 1]."""

  def __init__(self, tracker: StageTracker, index: int) -> None:
    self._tracker = tracker
    self.index = index
    self.fraction = 0.0

  def update(self, fraction: float, note: str = "") -> None:
    self.fraction = min(max(float(fraction), 0.0), 1.0)
    self._tracker._render(self, note)


class PipelineStage(Protocol):
  """One stage of a pipeline: a frozen config whose `run` does the stage's work on the state the
  stages hand each other, reporting progress through `stage`."""

  @property
  def name(self) -> str: ...

  @property
  def estimate_s(self) -> float: ...

  def run(self, state: Any, stage: Stage) -> None: ...


class StageTracker:
  """Runs named stages in order; `eta_s()` is the estimated time left for the whole pipeline."""

  def __init__(
    self,
    stages: Sequence[tuple[str, float]],
    *,
    prefix: str = "quickstart",
    stream: TextIO | None = None,
    rich: bool | None = None,
  ) -> None:
    if not stages:
      raise ValueError("no stages")
    self.names = [n for n, _ in stages]
    self.estimates = [max(float(e), 1e-3) for _, e in stages]
    self.actual: dict[int, float] = {}
    # Peak RSS of the process (MB) when each stage ended: where a memory peak happened.
    self.peak_rss_mb: dict[int, float] = {}
    self.prefix = prefix
    self.stream = stream or sys.stderr
    self.t0 = time.perf_counter()
    self._stage_t0 = self.t0
    self._last_tenth = -1
    use_rich = self.stream.isatty() if rich is None else rich
    self._progress = None
    if use_rich:
      from rich.console import Console
      from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

      self._progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
        TextColumn("ETA {task.fields[eta]}"),
        console=Console(file=self.stream),
      )
      self._task = self._progress.add_task(prefix, total=sum(self.estimates), eta="?")

  def _speed(self) -> float:
    """Actual / estimated time of the finished stages, shrunk towards 1 by a prior worth
    `PRIOR_S` seconds, so a few-second first stage cannot rescale a long pipeline."""
    actual = sum(self.actual.values())
    estimated = sum(self.estimates[i] for i in self.actual)
    return (actual + PRIOR_S) / (estimated + PRIOR_S)

  def eta_s(self, current: Stage | None = None) -> float:
    speed = self._speed()
    left = sum(e for i, e in enumerate(self.estimates) if i not in self.actual)
    if current is not None:
      left -= self.estimates[current.index] * current.fraction
    return max(left * speed, 0.0)

  def _done_cost(self, current: Stage | None) -> float:
    done = sum(self.estimates[i] for i in self.actual)
    if current is not None:
      done += self.estimates[current.index] * current.fraction
    return done

  def _render(self, stage: Stage, note: str = "") -> None:
    name = self.names[stage.index]
    label = f"{self.prefix} [{stage.index + 1}/{len(self.names)}] {name}"
    if note:
      label += f" ({note})"
    eta = _fmt_s(self.eta_s(stage))
    if self._progress is not None:
      self._progress.update(
        self._task, completed=self._done_cost(stage), description=label, eta=eta
      )
      return
    tenth = int(stage.fraction * 10)
    if tenth != self._last_tenth:
      self._last_tenth = tenth
      elapsed = _fmt_s(time.perf_counter() - self.t0)
      print(f"[{label}] {stage.fraction:4.0%}  elapsed {elapsed}  ETA {eta}", file=self.stream)
      self.stream.flush()

  @contextlib.contextmanager
  def stage(self, name: str) -> Iterator[Stage]:
    """Runs stage `name` (must be the next one in order)."""
    index = len(self.actual)
    if index >= len(self.names) or self.names[index] != name:
      raise ValueError(f"stage {name!r} out of order; expected {self.names[index : index + 1]}")
    handle = Stage(self, index)
    self._stage_t0 = time.perf_counter()
    self._last_tenth = -1
    if self._progress is not None and index == 0:
      self._progress.start()
    handle.update(0.0)
    try:
      yield handle
    finally:
      self.actual[index] = time.perf_counter() - self._stage_t0
      self.peak_rss_mb[index] = metric_writer.peak_rss_mb()
      handle.fraction = 1.0
      self._render(handle, f"done in {_fmt_s(self.actual[index])}")
      if self._progress is not None and len(self.actual) == len(self.names):
        self._progress.stop()

  def close(self) -> None:
    if self._progress is not None:
      self._progress.stop()

  def timings(self) -> dict[str, float]:
    return {self.names[i]: round(t, 2) for i, t in sorted(self.actual.items())}

  def peak_rss(self) -> dict[str, float]:
    """Process peak RSS (MB, Linux ru_maxrss) at the end of each finished stage."""
    return {self.names[i]: round(m, 1) for i, m in sorted(self.peak_rss_mb.items())}
