"""The one plotting style of every report and notebook: smoothed curves with the raw points behind.

RL curves are noisy (a step's reward is the mean of a few groups), so a raw line hides the trend
and a smoothed one alone hides the noise; both are drawn, the raw points faint. Series that are
identical (reward and accuracy when the reward *is* exact match) share one panel instead of
being drawn twice. matplotlib is imported by the functions that draw, so importing this module
costs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# Smoothing weight of the exponential moving average (TensorBoard's slider; 0 = raw).
DEFAULT_SMOOTHING = 0.6

Points = Sequence[tuple[float, float]]


def smooth(values: Sequence[float], weight: float = DEFAULT_SMOOTHING) -> np.ndarray:
  """Debiased exponential moving average (as TensorBoard draws it): the first points are not
  pulled towards zero; non-finite values are skipped (they keep the previous average)."""
  if not 0.0 <= weight < 1.0:
    raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
  out = np.full(len(values), np.nan)
  acc, norm = 0.0, 0.0
  for i, v in enumerate(values):
    if math.isfinite(v):
      acc = weight * acc + (1 - weight) * v
      norm = weight * norm + (1 - weight)
    out[i] = acc / norm if norm else np.nan
  return out


def same_series(a: Points, b: Points, *, tol: float = 1e-9) -> bool:
  """True when two curves have the same steps and values (one panel is enough)."""
  if len(a) != len(b) or not a:
    return False
  return all(xa == xb and abs(ya - yb) <= tol for (xa, ya), (xb, yb) in zip(a, b))


def merge_identical(curves: Mapping[str, tuple[str, Points]]) -> list[tuple[str, Points]]:
  """(title, points) panels: curves identical to an earlier one are folded into its title
  ("reward = accuracy (EM)") instead of getting a panel of their own."""
  panels: list[tuple[list[str], Points]] = []
  for title, pts in curves.values():
    for titles, other in panels:
      if same_series(pts, other):
        titles.append(title)
        break
    else:
      panels.append(([title], pts))
  return [(" = ".join(titles), pts) for titles, pts in panels]


def plot_curve(
  ax: Any,
  points: Points,
  *,
  label: str | None = None,
  color: str | None = None,
  smoothing: float = DEFAULT_SMOOTHING,
) -> None:
  """Raw points (faint dots and line) behind their smoothed curve, on one matplotlib axis."""
  if not points:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, alpha=0.6)
    return
  xs = np.asarray([p[0] for p in points], float)
  ys = np.asarray([p[1] for p in points], float)
  (raw,) = ax.plot(xs, ys, marker="o", markersize=2.5, linewidth=0.8, alpha=0.3, color=color)
  ax.plot(xs, smooth(ys, smoothing), linewidth=2.0, color=raw.get_color(), label=label)


def curves_figure(
  panels: Sequence[tuple[str, Points]],
  *,
  xlabel: str = "training step (policy version)",
  smoothing: float = DEFAULT_SMOOTHING,
  columns: int = 2,
) -> Any:
  """A figure with one smoothed-over-raw panel per (title, points)."""
  import matplotlib.pyplot as plt

  rows = max(1, math.ceil(len(panels) / columns))
  fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.4 * rows), squeeze=False)
  for ax, (title, pts) in zip(axes.flat, panels):
    plot_curve(ax, pts, smoothing=smoothing)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
  for ax in list(axes.flat)[len(panels) :]:
    ax.set_visible(False)
  fig.tight_layout()
  return fig


def overlay_figure(
  panels: Sequence[tuple[str, Mapping[str, Points]]],
  *,
  xlabel: str = "training step (policy version)",
  smoothing: float = DEFAULT_SMOOTHING,
  columns: int = 2,
) -> Any:
  """A figure with one panel per (title, {label: points}): every label's curve (smoothed over
  raw) overlaid, one colour each, a legend per panel. Runs side by side (a sweep's points)."""
  import matplotlib.pyplot as plt

  columns = max(1, min(columns, len(panels)))
  rows = max(1, math.ceil(len(panels) / columns))
  fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 3.6 * rows), squeeze=False)
  for ax, (title, curves) in zip(axes.flat, panels):
    for label, pts in curves.items():
      plot_curve(ax, pts, label=label, smoothing=smoothing)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    if curves:
      ax.legend(fontsize="small")
  for ax in list(axes.flat)[len(panels) :]:
    ax.set_visible(False)
  fig.tight_layout()
  return fig


def binned_means(xs: Sequence[float], ys: Sequence[float]) -> list[tuple[float, float]]:
  """(x, mean of the ys at that x) for each distinct x, in order: the smoothed view of a scatter
  over a discrete axis (accuracy per number of turns)."""
  bins: dict[float, list[float]] = {}
  for x, y in zip(xs, ys):
    bins.setdefault(x, []).append(y)
  return [(x, float(np.mean(bins[x]))) for x in sorted(bins)]


def plot_scatter_means(
  ax: Any,
  xs: Sequence[float],
  ys: Sequence[float],
  *,
  label: str | None = None,
  jitter: float = 0.08,
) -> None:
  """Every raw (x, y) point, faint and jittered, behind the line of the per-x means."""
  if not xs:
    return
  rng = np.random.default_rng(0)  # fixed: the same run draws the same picture
  jx = np.asarray(xs, float) + rng.uniform(-jitter, jitter, len(xs))
  (dots,) = ax.plot(jx, ys, "o", markersize=3, alpha=0.25)
  means = binned_means(xs, ys)
  ax.plot([m[0] for m in means], [m[1] for m in means], marker="o", linewidth=2.0,
          color=dots.get_color(), label=label)  # fmt: skip
