"""The shared plot style: debiased smoothing, identical curves folded into one panel, raw points
drawn faint behind the smoothed line."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pytest

from asearcher_jax import plotting


def test_smoothing_is_debiased_and_skips_gaps():
  ys = [1.0, 1.0, float("nan"), 3.0]
  s = plotting.smooth(ys, 0.5)
  assert s[0] == 1.0 and s[1] == 1.0 and s[2] == 1.0  # no pull towards 0; a gap keeps the mean
  assert 1.0 < s[3] < 3.0
  np.testing.assert_allclose(plotting.smooth(ys, 0.0)[[0, 3]], [1.0, 3.0])
  with pytest.raises(ValueError, match="smoothing weight"):
    plotting.smooth(ys, 1.0)


def test_identical_curves_share_a_panel():
  pts = [(1, 0.5), (2, 0.75)]
  panels = plotting.merge_identical({
    "rollout/reward": ("reward", pts), "rollout/accuracy": ("accuracy (EM)", list(pts)),
    "rollout/turns": ("turns", [(1, 3.0), (2, 4.0)]),
  })  # fmt: skip
  assert [t for t, _ in panels] == ["reward = accuracy (EM)", "turns"]
  assert len(plotting.merge_identical({"a": ("a", pts), "b": ("b", [(1, 0.5), (2, 0.7)])})) == 2


def test_raw_points_are_drawn_behind_the_smoothed_line():
  fig = plotting.curves_figure([("reward", [(i, float(i % 2)) for i in range(10)])])
  ax = fig.axes[0]
  raw, smoothed = ax.lines
  assert raw.get_alpha() < 1 and smoothed.get_alpha() in (None, 1.0)
  assert list(raw.get_ydata()) == [float(i % 2) for i in range(10)]
  assert np.ptp(smoothed.get_ydata()[3:]) < np.ptp(raw.get_ydata())  # smoother than raw
  assert len([a for a in fig.axes if a.get_visible()]) == 1  # the unused grid cell is hidden
  plt.close(fig)
