"""Reports over a run directory: Avg@k / Pass@k per dataset, tables, CSV, plots, comparisons.

Avg@k is the mean over every (question, run) value; Pass@k the mean over questions of the best of
that question's first k runs (ASearcher's `Max@k`). Both read only the snapshots in one run
directory, which holds one configuration, so no stale file of another configuration can leak in.
"""

from __future__ import annotations

import collections
import csv
import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from asearcher_jax import plotting
from asearcher_jax.evaluation.runner import SnapshotStore
from asearcher_jax.tools import registry as tool_registry

log = logging.getLogger(__name__)

METRICS = ("em", "f1", "cem", "judge")


def _stats() -> tuple[str, ...]:
  """Per-episode stats a report shows: every registered tool's call count among them."""
  return ("turns", "tool_calls", *tool_registry.stat_names().values(), "output_tokens", "time_s")


def avg_at_k(table: Mapping[str, Sequence[float]], k: int | None = None) -> float:
  """Mean over all (question, run) values among each question's first k runs."""
  values = [v for runs in table.values() for v in list(runs)[:k]]
  return sum(values) / len(values) if values else math.nan


def pass_at_k(table: Mapping[str, Sequence[float]], k: int | None = None) -> float:
  """Mean over questions of the max over that question's first k runs."""
  best = [max(list(runs)[:k]) for runs in table.values() if list(runs)[:k]]
  return sum(best) / len(best) if best else math.nan


def _mean(xs: Iterable[float]) -> float:
  xs = list(xs)
  return sum(xs) / len(xs) if xs else math.nan


def pick_judge_key(snaps: Sequence[Mapping[str, Any]]) -> str | None:
  """The judge whose verdicts cover the most results (a run dir may hold several judges')."""
  counts = collections.Counter(k for s in snaps for k in (s.get("judge") or {}))
  return counts.most_common(1)[0][0] if counts else None


def result_rows(snaps: Sequence[Mapping[str, Any]], judge_key: str | None) -> list[dict[str, Any]]:
  """One flat row per (dataset, question, run): scores, judge verdict and episode stats."""
  rows = []
  for s in snaps:
    verdict = (s.get("judge") or {}).get(judge_key) if judge_key else None
    row = {"dataset": s["dataset"], "qid": s["qid"], "run": s["run"], **s["scores"]}
    row["judge"] = None if verdict is None else float(verdict.get("judgement") == "correct")
    row["judge_status"] = None if verdict is None else verdict.get("status")
    row["finish_reason"] = s.get("finish_reason")
    row["tool_failed"] = float((s.get("stats") or {}).get("tool_failures", 0.0))
    for k in _stats():
      row[k] = float((s.get("stats") or {}).get(k, 0.0))
    rows.append(row)
  rows.sort(key=lambda r: (r["dataset"], r["run"], r["qid"]))
  return rows


def dataset_summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """n, k, Avg@k and Pass@k of every metric, judge counts, mean stats, failure counts."""
  tables: dict[str, dict[str, list[float]]] = {m: collections.defaultdict(list) for m in METRICS}
  for r in sorted(rows, key=lambda r: r["run"]):
    for m in METRICS:
      if r[m] is not None:
        tables[m][r["qid"]].append(float(r[m]))
  k = max((r["run"] for r in rows), default=-1) + 1
  judged = [r for r in rows if r["judge_status"] is not None]
  out: dict[str, Any] = {
    "n": len({r["qid"] for r in rows}),
    "k": k,
    "results": len(rows),
    "avg@k": {m: avg_at_k(tables[m]) for m in METRICS},
    "pass@k": {m: pass_at_k(tables[m]) for m in METRICS},
    "judge_judged": len(judged),
    "judge_failed": sum(r["judge_status"] == "failed" for r in judged),
    "finish_reasons": dict(collections.Counter(r["finish_reason"] for r in rows)),
    "tool_failures": int(sum(r["tool_failed"] for r in rows)),
  }
  for m in ("em", "f1", "cem"):
    out[m] = out["avg@k"][m]
  out["judge_accuracy"] = out["avg@k"]["judge"]
  for s in _stats():
    out[f"mean_{s}"] = _mean(r[s] for r in rows)
  calls = sum(r["tool_calls"] for r in rows)
  out["tool_failure_rate"] = out["tool_failures"] / calls if calls else 0.0
  return out


def summarize(run_dir: str | Path, judge_key: str | None = None) -> dict[str, Any]:
  """The machine-readable summary of a run directory (what `summary.json` holds)."""
  run_dir = Path(run_dir)
  snaps = list(SnapshotStore(run_dir).iter_snapshots())
  judge_key = judge_key or pick_judge_key(snaps)
  rows = result_rows(snaps, judge_key)
  by_ds: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
  for r in rows:
    by_ds[r["dataset"]].append(r)
  datasets = {name: dataset_summary(rs) for name, rs in sorted(by_ds.items())}
  average = {}
  for key in ("em", "f1", "cem", "judge_accuracy", "mean_turns", "mean_tool_calls"):
    average[key] = _mean(d[key] for d in datasets.values() if not math.isnan(d[key]))
  for agg in ("avg@k", "pass@k"):
    average[agg] = {
      m: _mean(d[agg][m] for d in datasets.values() if not math.isnan(d[agg][m])) for m in METRICS
    }
  config_path = run_dir / "config.json"
  config = json.loads(config_path.read_text()) if config_path.exists() else {}
  return {
    "run_dir": str(run_dir),
    "config": config,
    "judge_key": judge_key,
    "datasets": datasets,
    "average": average,
  }


def _fmt(x: Any, digits: int = 3) -> str:
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "-"
  return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _render(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  widths = [
    max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
  ]
  line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

  def fmt(cells: Sequence[str]) -> str:  # first column (names) left, numbers right
    padded = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
    return "| " + " | ".join(padded) + " |"

  return "\n".join([line, fmt(header), line, *(fmt(r) for r in rows), line])


def format_table(summary: Mapping[str, Any]) -> str:
  """A per-dataset table like the paper's, with an unweighted "Average" row."""
  header = ["dataset", "n", "k", "EM", "F1", "CEM", "judge", "Pass@k F1", "Pass@k judge",
            "turns", "tool calls", "tool fail"]  # fmt: skip
  rows = []
  for name, d in summary["datasets"].items():
    rows.append([name, str(d["n"]), str(d["k"]), _fmt(d["em"]), _fmt(d["f1"]), _fmt(d["cem"]),
                 _fmt(d["judge_accuracy"]), _fmt(d["pass@k"]["f1"]), _fmt(d["pass@k"]["judge"]),
                 _fmt(d["mean_turns"], 1), _fmt(d["mean_tool_calls"], 2),
                 str(d["tool_failures"])])  # fmt: skip
  a = summary["average"]
  rows.append(["Average", "", "", _fmt(a["em"]), _fmt(a["f1"]), _fmt(a["cem"]),
               _fmt(a["judge_accuracy"]), _fmt(a["pass@k"]["f1"]), _fmt(a["pass@k"]["judge"]),
               _fmt(a["mean_turns"], 1), _fmt(a["mean_tool_calls"], 2), ""])  # fmt: skip
  return _render(header, rows)


def _json_safe(x: Any) -> Any:
  if isinstance(x, float) and math.isnan(x):
    return None
  if isinstance(x, dict):
    return {k: _json_safe(v) for k, v in x.items()}
  if isinstance(x, list | tuple):
    return [_json_safe(v) for v in x]
  return x


def write_report(run_dir: str | Path, judge_key: str | None = None) -> dict[str, Any]:
  """summary.json, results.csv (per dataset), questions.csv (per result), table.txt, plots/*.png."""
  run_dir = Path(run_dir)
  summary = summarize(run_dir, judge_key)
  (run_dir / "summary.json").write_text(json.dumps(_json_safe(summary), indent=2, sort_keys=True))
  (run_dir / "table.txt").write_text(format_table(summary) + "\n")
  with (run_dir / "results.csv").open("w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["dataset", "n", "k", *[f"avg@k_{m}" for m in METRICS],
                *[f"pass@k_{m}" for m in METRICS], "judge_failed", "mean_turns",
                "mean_tool_calls", "mean_output_tokens", "mean_time_s", "tool_failures"])  # fmt: skip
    for name, d in summary["datasets"].items():
      w.writerow([name, d["n"], d["k"], *[_fmt(d["avg@k"][m], 4) for m in METRICS],
                  *[_fmt(d["pass@k"][m], 4) for m in METRICS], d["judge_failed"],
                  _fmt(d["mean_turns"], 2), _fmt(d["mean_tool_calls"], 2),
                  _fmt(d["mean_output_tokens"], 1), _fmt(d["mean_time_s"], 2),
                  d["tool_failures"]])  # fmt: skip
  snaps = list(SnapshotStore(run_dir).iter_snapshots())
  rows = result_rows(snaps, summary["judge_key"])
  with (run_dir / "questions.csv").open("w", newline="") as f:
    fields = ["dataset", "qid", "run", *METRICS, "judge_status", "finish_reason", *_stats()]
    w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
  try:
    write_plots(rows, run_dir / "plots")
  except ImportError as e:  # the numbers matter more than the pictures
    log.warning("no plots: %s (pip install matplotlib)", e)
  return summary


def write_plots(rows: Sequence[Mapping[str, Any]], out_dir: Path) -> list[Path]:
  """accuracy_vs_turns.png and tool_calls.png (matplotlib, Agg: no display needed)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import MaxNLocator

  out_dir.mkdir(parents=True, exist_ok=True)
  by_ds: dict[str, list[Mapping[str, Any]]] = collections.defaultdict(list)
  for r in rows:
    by_ds[r["dataset"]].append(r)
  paths = []

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, rs in sorted(by_ds.items()):
    metric = "judge" if any(r["judge"] is not None for r in rs) else "f1"
    done = [r for r in rs if r[metric] is not None]
    plotting.plot_scatter_means(
      ax, [int(r["turns"]) for r in done], [float(r[metric]) for r in done],
      label=f"{name} ({metric})",
    )  # fmt: skip
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.set_xlabel("LLM turns in the episode")
  ax.set_ylabel("accuracy (line: mean; dots: each result)")
  ax.set_title("Accuracy vs turns")
  ax.set_ylim(-0.02, 1.02)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  paths.append(out_dir / "accuracy_vs_turns.png")
  fig.savefig(paths[-1], dpi=100)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(7, 4.5))
  top = int(max((r["tool_calls"] for r in rows), default=0))
  edges = [x - 0.5 for x in range(top + 2)]
  names = sorted(by_ds)
  ax.hist([[r["tool_calls"] for r in by_ds[n]] for n in names] or [[]], bins=edges, label=names)
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.set_xlabel("tool calls per episode")
  ax.set_ylabel("episodes")
  ax.set_title("Distribution of tool calls")
  if names:
    ax.legend(fontsize=8)
  fig.tight_layout()
  paths.append(out_dir / "tool_calls.png")
  fig.savefig(paths[-1], dpi=100)
  plt.close(fig)
  return paths


def compare(dir_a: str | Path, dir_b: str | Path) -> dict[str, Any]:
  """Side by side (e.g. before/after RL): each dataset's metrics in both dirs and b - a."""
  a, b = summarize(dir_a), summarize(dir_b)
  out: dict[str, Any] = {"a": str(dir_a), "b": str(dir_b), "datasets": {}}
  for name in sorted(set(a["datasets"]) | set(b["datasets"])):
    da, db = a["datasets"].get(name), b["datasets"].get(name)
    row = {}
    for key in ("em", "f1", "cem", "judge_accuracy", "mean_turns", "mean_tool_calls"):
      va = da[key] if da else math.nan
      vb = db[key] if db else math.nan
      row[key] = {"a": va, "b": vb, "delta": vb - va}
    row["pass@k_f1"] = {
      "a": da["pass@k"]["f1"] if da else math.nan,
      "b": db["pass@k"]["f1"] if db else math.nan,
    }
    row["pass@k_f1"]["delta"] = row["pass@k_f1"]["b"] - row["pass@k_f1"]["a"]
    out["datasets"][name] = row
  return _json_safe(out)


def format_comparison(cmp: Mapping[str, Any]) -> str:
  header = ["dataset", "metric", "A", "B", "B - A"]
  rows = []
  for name, row in cmp["datasets"].items():
    for key, v in row.items():
      delta = v["delta"]
      sign = "" if delta is None else ("+" if delta >= 0 else "")
      rows.append([name, key, _fmt(v["a"]), _fmt(v["b"]), sign + _fmt(delta)])
  return f"A = {cmp['a']}\nB = {cmp['b']}\n" + _render(header, rows)
