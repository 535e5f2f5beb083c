"""The quickstart's report: before/after table, training curves as PNGs, and `summary.json`.

Inputs are files the pipeline already wrote (the trainer's metrics.jsonl, the evaluation
summaries), so the report can be rebuilt from a finished run directory alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from asearcher_jax import plotting

# metrics.jsonl key -> (plot title, file stem); per-trajectory means over each training step.
CURVES = {
  "rollout/reward": ("reward", "reward"),
  "rollout/accuracy": ("accuracy (EM)", "accuracy"),
  "rollout/turns": ("LLM turns per trajectory", "turns"),
  "rollout/tool_calls": ("tool calls per trajectory", "tool_calls"),
}


def read_metrics(path: str | Path) -> list[dict[str, float]]:
  """Rows of a MetricWriter JSONL log, one per step (the last row of a step wins on resume)."""
  path = Path(path)
  if not path.exists():
    return []
  by_step: dict[int, dict[str, float]] = {}
  for line in path.read_text().splitlines():
    if line.strip():
      row = json.loads(line)
      by_step[int(row["step"])] = row
  return [by_step[s] for s in sorted(by_step)]


def curves(rows: Sequence[Mapping[str, float]]) -> dict[str, list[tuple[int, float]]]:
  out: dict[str, list[tuple[int, float]]] = {}
  for key in CURVES:
    pts = [(int(r["step"]), float(r[key])) for r in rows if key in r and math.isfinite(r[key])]
    out[key] = pts
  return out


def window_mean(points: Sequence[tuple[int, float]], *, first: bool, frac: float = 0.25) -> float:
  """Mean over the first (or last) `frac` of the steps (at least one)."""
  if not points:
    return float("nan")
  n = max(1, round(len(points) * frac))
  sel = points[:n] if first else points[-n:]
  return sum(v for _, v in sel) / len(sel)


def write_plots(
  curve_points: Mapping[str, Sequence[tuple[int, float]]], out_dir: Path
) -> list[Path]:
  """`training.png`: one panel per curve, smoothed over its raw points; curves that are identical
  (reward and accuracy when the reward is exact match) share a panel (matplotlib Agg)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  out_dir.mkdir(parents=True, exist_ok=True)
  panels = plotting.merge_identical(
    {key: (title, curve_points.get(key, [])) for key, (title, _) in CURVES.items()}
  )
  fig = plotting.curves_figure(panels)
  path = out_dir / "training.png"
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return [path]


def _pct(x: float) -> str:
  return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:.1f}"


def format_markdown(summary: Mapping[str, Any]) -> str:
  s = summary
  lines = [
    "# Quickstart report",
    "",
    f"SynthWiki world seed {s.get('world_seed')}, {s.get('num_test_questions')} held-out "
    f"questions, k = {s.get('k')} samples each. Wall time {s.get('wall_s', 0):.0f} s, "
    f"peak memory {s.get('peak_rss_mb', 0):.0f} MB.",
    "",
    "| policy | Avg@4 (EM %) | Pass@4 (EM %) | tool calls / trajectory | turns / trajectory |",
    "|---|---|---|---|---|",
    f"| SFT warm start | {_pct(s['avg4_sft'])} | {_pct(s['pass4_sft'])} | "
    f"{s.get('eval_tool_calls_sft', float('nan')):.2f} | {s.get('eval_turns_sft', float('nan')):.2f} |",
    f"| after RL | {_pct(s['avg4_rl'])} | {_pct(s['pass4_rl'])} | "
    f"{s.get('eval_tool_calls_rl', float('nan')):.2f} | {s.get('eval_turns_rl', float('nan')):.2f} |",
    "",
    f"RL: {s.get('rl_steps')} steps (eta = {s.get('eta')}); mean tool calls per trajectory "
    f"{s.get('tool_calls_first_steps', float('nan')):.2f} over the first quarter of the steps -> "
    f"{s.get('tool_calls_last_steps', float('nan')):.2f} over the last quarter.",
    "",
    "Plots: `training.png` (reward, accuracy, turns, tool calls per step, smoothed over the raw "
    "points). TensorBoard: "
    "`tensorboard --logdir rl/metrics`.",
    "",
    "Stage timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in s.get("stages", {}).items()),
    "",
  ]
  return "\n".join(lines)
