"""Figures and tables over a run: training curves, staleness, per-length diagnostics, engine and
weight-update timings (from metrics.jsonl); evaluation side by side (from snapshots); synthesis
questions with their facts and checks (from questions.jsonl / progress.jsonl).

All curves go through `asearcher_jax.plotting` (smoothed, raw points behind, identical series on
one panel), the same style as the quickstart and evaluation reports.
"""

from __future__ import annotations

import collections
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from asearcher_jax import plotting, storage
from asearcher_jax.evaluation import report as eval_report
from asearcher_jax.evaluation.runner import SnapshotStore

# (metrics key, panel title): the training dashboard's curves, in order.
TRAINING_CURVES = (
  ("rollout/reward", "reward"),
  ("rollout/accuracy", "accuracy (EM)"),
  ("rollout/turns", "LLM turns per episode"),
  ("rollout/tool_calls", "tool calls per episode"),
  ("rollout/engine_occupancy", "engine slot occupancy"),
  ("staleness/head_mean", "staleness at training (versions, mean)"),
  ("timing/sync_s", "weight update: trainer push (s)"),
  ("engine/weight_updates_ms", "weight update: engine swap (ms)"),
  ("perf/trainer_idle_frac", "trainer idle fraction"),
  ("timing/step_s", "step time (s)"),
  ("host/rss_mb", "trainer host memory (MB resident)"),
)


def read_metrics(path: str | Path) -> list[dict[str, float]]:
  """Rows of a metrics.jsonl, one per step (the last row of a step wins on resume); a torn last
  line is skipped."""
  by_step: dict[int, dict[str, float]] = {}
  for line in Path(path).read_text().splitlines():
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue
    by_step[int(row["step"])] = row
  return [by_step[s] for s in sorted(by_step)]


def series(rows: Sequence[Mapping[str, float]], key: str) -> list[tuple[int, float]]:
  return [
    (int(r["step"]), float(r[key])) for r in rows if key in r and math.isfinite(float(r[key]))
  ]


def training_figure(rows: Sequence[Mapping[str, float]], smoothing: float = 0.6) -> Any:
  """Every training curve that the run logged, smoothed over its raw points."""
  curves = {k: (title, series(rows, k)) for k, title in TRAINING_CURVES if series(rows, k)}
  return plotting.curves_figure(plotting.merge_identical(curves), smoothing=smoothing)


def staleness_histogram(rows: Sequence[Mapping[str, float]]) -> dict[int, float]:
  """Fraction of trained episodes per head staleness (trained version - oldest token version),
  weighted over steps by each step's episodes (`staleness/hist_<k>` fractions, `ppo/sequences`
  or 1 per step)."""
  total: collections.Counter[int] = collections.Counter()
  for r in rows:
    weight = float(r.get("ppo/sequences", 1.0))
    for k, v in r.items():
      if k.startswith("staleness/hist_"):
        total[int(k.rsplit("_", 1)[1])] += float(v) * weight
  norm = sum(total.values())
  return {k: total[k] / norm for k in sorted(total)} if norm else {}


def length_diagnostics(rows: Sequence[Mapping[str, float]]) -> list[dict[str, Any]]:
  """Per trajectory-length bucket, from the last step (the replay queue's cumulative counts and
  its last window's staleness and waiting time): are long episodes starved or stale?"""
  if not rows:
    return []
  last = rows[-1]
  buckets: dict[str, dict[str, Any]] = {}
  for k, v in last.items():
    if k.startswith("replay/len_"):
      name, field = k[len("replay/len_") :].split("/", 1)
      buckets.setdefault(name, {"bucket": name})[field] = v
  order = lambda n: (n.startswith("gt"), int(n.split("_")[1]))  # noqa: E731
  return [buckets[n] for n in sorted(buckets, key=order)]


def diagnostics_figure(rows: Sequence[Mapping[str, float]]) -> Any:
  """Staleness histogram and per-length accept rate / staleness, side by side."""
  import matplotlib.pyplot as plt

  fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
  hist = staleness_histogram(rows)
  a.bar(list(hist), list(hist.values()), color="#5b8bd6")
  a.set_xlabel("head staleness (versions)")
  a.set_ylabel("fraction of trained episodes")
  a.set_title("staleness histogram")
  a.set_xticks(list(hist) or [0])
  diag = length_diagnostics(rows)
  names = [d["bucket"] for d in diag]
  b.bar(names, [d.get("accept_rate", 0.0) for d in diag], color="#7cc38b", label="accept rate")
  b.set_ylim(0, 1.05)
  b.set_title("per trajectory length (tokens)")
  b2 = b.twinx()
  b2.plot(names, [d.get("staleness_mean", float("nan")) for d in diag], "o-", color="#c0504d",
          label="staleness mean")  # fmt: skip
  b2.set_ylabel("staleness (versions)")
  b.legend(loc="upper left", fontsize=8)
  b2.legend(loc="upper right", fontsize=8)
  fig.tight_layout()
  return fig


# --- evaluation -------------------------------------------------------------------------------


def eval_comparison(dir_a: str | Path, dir_b: str | Path) -> list[dict[str, Any]]:
  """Per dataset and metric: A, B and B - A (Avg@k for EM/F1/CEM/judge, Pass@k for F1)."""
  cmp = eval_report.compare(dir_a, dir_b)
  rows = []
  for name, row in cmp["datasets"].items():
    for metric, v in row.items():
      rows.append(
        {"dataset": name, "metric": metric, "A": v["a"], "B": v["b"], "B - A": v["delta"]}
      )
  return rows


def eval_summary_rows(dirs: Mapping[str, str | Path]) -> list[dict[str, Any]]:
  """One row per (run label, dataset): n, k, Avg@k and Pass@k (EM, F1), turns, tool calls."""
  rows = []
  for label, d in dirs.items():
    for name, s in eval_report.summarize(d)["datasets"].items():
      rows.append({
        "run": label, "dataset": name, "n": s["n"], "k": s["k"],
        "Avg@k EM": s["avg@k"]["em"], "Pass@k EM": s["pass@k"]["em"],
        "Avg@k F1": s["avg@k"]["f1"], "Pass@k F1": s["pass@k"]["f1"],
        "turns": s["mean_turns"], "tool calls": s["mean_tool_calls"],
      })  # fmt: skip
  return rows


def per_question(dirs: Mapping[str, str | Path], metric: str = "em") -> list[dict[str, Any]]:
  """Per (dataset, question): each run's mean `metric` over its k samples (Avg@k of that one
  question) and its best (Pass@k), so the questions RL fixed or broke stand out."""
  table: dict[tuple[str, str], dict[str, Any]] = {}
  for label, d in dirs.items():
    runs: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for s in SnapshotStore(Path(d)).iter_snapshots():
      runs[(s["dataset"], s["qid"])].append(float(s["scores"][metric]))
    for key, vals in runs.items():
      row = table.setdefault(key, {"dataset": key[0], "qid": key[1]})
      row[f"{label} avg"] = sum(vals) / len(vals)
      row[f"{label} pass"] = max(vals)
  return [table[k] for k in sorted(table)]


def eval_figure(dirs: Mapping[str, str | Path], metric: str = "f1") -> Any:
  """Accuracy against turns per run: every result faint, the per-turn means drawn over them."""
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4))
  for label, d in dirs.items():
    snaps = list(SnapshotStore(Path(d)).iter_snapshots())
    xs = [float(s["stats"].get("turns", 0)) for s in snaps if s.get("stats")]
    ys = [float(s["scores"][metric]) for s in snaps if s.get("stats")]
    plotting.plot_scatter_means(ax, xs, ys, label=label)
  ax.set_xlabel("LLM turns in the episode")
  ax.set_ylabel(f"{metric} (line: mean; dots: each result)")
  ax.set_ylim(-0.05, 1.05)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  return fig


# --- synthesis --------------------------------------------------------------------------------


def _jsonl(path: Path) -> list[dict[str, Any]]:
  rows = []
  for line in storage.jsonl_lines(path.read_text(encoding="utf-8")) if path.exists() else ():
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return rows


def synthesis_questions(out_dir: str | Path) -> list[dict[str, Any]]:
  """Accepted questions with their facts: injected statements (with sources), fuzzed facts, the
  number of edits, difficulty (solver accuracy) and every check's verdict."""
  rows = []
  for r in _jsonl(Path(out_dir) / "questions.jsonl"):
    verdicts = r.get("verdicts") or {}
    rows.append({
      "id": r.get("id"), "question": r.get("question"), "answer": r.get("answer"),
      "statements": [s.get("text") for s in r.get("statements", [])],
      "sources": [s.get("source") for s in r.get("statements", [])],
      "fuzzes": [f"{f.get('original')} -> {f.get('vague')}" for f in r.get("fuzzes", [])],
      "edits": " > ".join(h.get("action", "?") for h in r.get("history", [])),
      "difficulty": r.get("difficulty"),
      "checks": {k: _verdict(v) for k, v in verdicts.items()},
    })  # fmt: skip
  return rows


def synthesis_history(out_dir: str | Path, question_id: str) -> list[dict[str, Any]]:
  """Every edit of one accepted question (base, inject, fuzz, ...), accepted or not, with the
  verdict of each check at that step: how the question became hard."""
  for r in _jsonl(Path(out_dir) / "questions.jsonl"):
    if r.get("id") == question_id:
      return [
        {"turn": h.get("turn"), "action": h.get("action"), "accepted": h.get("accepted"),
         "question": h.get("question"), "answer": h.get("answer"),
         "difficulty": h.get("difficulty"),
         "checks": {k: _verdict(v) for k, v in (h.get("verdicts") or {}).items()}}
        for h in r.get("history", [])
      ]  # fmt: skip
  raise KeyError(f"no synthesized question {question_id!r} in {out_dir}")


def _verdict(v: Any) -> str:
  if isinstance(v, Mapping):
    if "ok" in v:
      return "pass" if v["ok"] else "fail"
    return ", ".join(f"{k}={x}" for k, x in v.items() if not isinstance(x, dict | list))[:80]
  return str(v)


def synthesis_progress(out_dir: str | Path) -> dict[str, int]:
  """How every seed ended (accepted, rejected for a reason, duplicate, ...)."""
  return dict(
    collections.Counter(r.get("status", "?") for r in _jsonl(Path(out_dir) / "progress.jsonl"))
  )


def synthesis_rejections(out_dir: str | Path) -> dict[str, int]:
  """Rejected candidates by reason (from summary.json, written at the end of a run)."""
  p = Path(out_dir) / "summary.json"
  return dict(json.loads(p.read_text()).get("rejected", {})) if p.exists() else {}
