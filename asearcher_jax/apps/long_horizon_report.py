"""The long-horizon report, rebuilt from a finished run directory's files alone: the quickstart's
summary, the evaluations' per-question rows (questions.csv) and episodes (where their chains
broke), the held-out questions (world/test.jsonl) and the RL metrics (rl/metrics/metrics.jsonl)."""

from __future__ import annotations

import collections
import csv
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from asearcher_jax.apps import quickstart_report as qs_report
from asearcher_jax.synthwiki import chain_breaks
from asearcher_jax.synthwiki.questions import SynthQuestion
from asearcher_jax.synthwiki.world import parse_facts
from asearcher_jax.tools.toolbox import snippet

# The bars (what one run must show); `bars` says which hold.
MIN_LONG_TOOL_CALLS = 10.0
MIN_LONG_GAIN = 0.10
MIN_MAX_TOOL_CALLS = 30


def newest_eval(eval_dir: Path, policy_prefix: str) -> Path | None:
  """The newest evaluation run under `eval_dir` whose policy starts with `policy_prefix` ("sft:"
  or "rl:"), or None."""
  runs = [
    d for d in eval_dir.glob("*/")
    if (d / "config.json").exists() and (d / "questions.csv").exists()
    and str(json.loads((d / "config.json").read_text()).get("policy", "")).startswith(policy_prefix)
  ]  # fmt: skip
  return max(runs, key=lambda d: (d / "questions.csv").stat().st_mtime) if runs else None


def eval_rows(eval_dir: Path, policy_prefix: str) -> list[dict[str, Any]]:
  """Per (question, run) rows of the newest evaluation of `policy_prefix` (see newest_eval)."""
  newest = newest_eval(eval_dir, policy_prefix)
  if newest is None:
    return []
  with (newest / "questions.csv").open() as f:
    return list(csv.DictReader(f))


def heldout_questions(test_jsonl: Path) -> dict[str, SynthQuestion]:
  """The held-out questions of a world (its test.jsonl), by id."""
  with test_jsonl.open() as f:
    return {q.id: q for q in map(SynthQuestion.from_row, map(json.loads, f))}


def breaks_of(
  eval_dir: Path, policy_prefix: str, questions: Mapping[str, SynthQuestion]
) -> dict[str, Any]:
  """`chain_breaks.tally` over every episode of the newest evaluation of `policy_prefix`.

  A record that cannot be read (torn by a crash mid-write) or names a question outside
  `questions` (another world's evaluation) is skipped and counted in "skipped", so one bad file
  costs one episode, not the report."""
  newest = newest_eval(eval_dir, policy_prefix)
  breaks, skipped = [], 0
  for f in sorted(newest.glob("*/run*/*.json")) if newest else ():
    read = _episode(f, questions)
    if read is None:
      skipped += 1
    elif read[0].kind == "chain":
      breaks.append(chain_breaks.episode_break(*read))
  return {**chain_breaks.tally(breaks), "skipped": skipped}


def _episode(
  f: Path, questions: Mapping[str, SynthQuestion]
) -> tuple[SynthQuestion, dict[str, Any]] | None:
  """(question, record) of one evaluation episode file, or None if it is torn or foreign. Only
  the reading is guarded: an error inside `chain_breaks` still raises."""
  try:
    record = json.loads(f.read_text())
    q = questions[record["qid"]]
    ok = isinstance(record["trajectory"]["calls"], list) and "finish_reason" in record
  except (ValueError, KeyError, TypeError):
    return None
  return (q, record) if ok else None


def _mean(xs: Sequence[float]) -> float:
  return sum(xs) / len(xs) if xs else math.nan


def by_hops(rows: Sequence[Mapping[str, Any]], hops: Mapping[str, int]) -> dict[str, Any]:
  """Avg@k EM, mean tool calls and turns, and sample counts per hop count."""
  groups: dict[int, list[Mapping[str, Any]]] = collections.defaultdict(list)
  for r in rows:
    groups[hops[r["qid"]]].append(r)
  return {
    str(h): {
      "avg_em": _mean([float(r["em"]) for r in rs]),
      "tool_calls": _mean([float(r["tool_calls"]) for r in rs]),
      "turns": _mean([float(r["turns"]) for r in rs]),
      "samples": len(rs),
    }
    for h, rs in sorted(groups.items())
  }


def calls_needed(
  questions: Mapping[str, SynthQuestion], corpus: Path, doc_sentences: int
) -> dict[str, int]:
  """The fewest tool calls that solve each chain, by question id: a search per hop, plus an
  `access` of the hop's page where the search shows a snippet (`doc_sentences` > 0: the title
  and that many sentences) that does not state the hop's fact. Read from the world's own pages,
  so it is what the agent would see."""
  if doc_sentences <= 0:
    return {qid: q.hops for qid, q in questions.items()}
  with corpus.open() as f:
    pages = {row["url"].rsplit("/", 1)[-1]: row["contents"] for row in map(json.loads, f)}
  missing = sorted({t for q in questions.values() for t in q.gold_titles} - set(pages))
  if missing:
    raise ValueError(f"{corpus}: no page for {missing[:3]} (the questions are of another world)")
  shown = {}  # page -> the (subject, relation) pairs its snippet states
  out = {}
  for qid, q in questions.items():
    calls = 0
    for subject, relation in zip(q.gold_titles, q.relations, strict=True):
      if subject not in shown:
        text = snippet(pages[subject], doc_sentences)
        shown[subject] = {(f.subject, f.relation) for f in parse_facts(text)}
      calls += 1 if (subject, relation) in shown[subject] else 2
    out[qid] = calls
  return out


def long_stats(
  rows: Sequence[Mapping[str, Any]],
  hops: Mapping[str, int],
  long_hops: int,
  *,
  needed: Mapping[str, int] | None = None,
) -> dict[str, float]:
  """Avg@k EM and mean tool calls over the questions of at least `long_hops` hops, and how many
  evaluation episodes hit the turn or token limit (`needed`: `calls_needed`; None: a search per
  hop)."""
  long = [r for r in rows if hops[r["qid"]] >= long_hops]
  needed = hops if needed is None else needed
  return {
    # The fewest tool calls that solve them: the ceiling of an agent that never searches or
    # opens a page twice for a hop.
    "min_tool_calls": _mean([float(needed[r["qid"]]) for r in long]),
    "avg_em": _mean([float(r["em"]) for r in long]),
    "tool_calls": _mean([float(r["tool_calls"]) for r in long]),
    "questions": len({r["qid"] for r in long}),
    "turn_limit": sum(r.get("finish_reason") == "turn_limit" for r in rows),
    "token_limit": sum(r.get("finish_reason") == "token_limit" for r in rows),
  }


def train_distribution(rows: Sequence[Mapping[str, float]]) -> list[dict[str, float]]:
  """Tool calls per training trajectory at each RL step: mean, p90, max (trajectories that
  finished since the previous step, accepted or not)."""
  out = []
  for r in rows:
    if "rollout/tool_calls" in r:
      out.append({
        "step": int(r["step"]), "mean": float(r["rollout/tool_calls"]),
        "p90": float(r.get("rollout/tool_calls_p90", math.nan)),
        "max": float(r.get("rollout/tool_calls_max", math.nan)),
      })  # fmt: skip
  return out


def run_total(rows: Sequence[Mapping[str, float]], key: str) -> float:
  """A cumulative rollout counter over every life of the run: the trainer keeps it in memory, so
  it restarts from 0 when a stopped run resumes. A life ends where the counter drops or the step
  goes back (to the checkpoint the next life restored); each life's last value counts."""
  total, prev, prev_step = 0.0, 0.0, -math.inf
  for r in rows:
    if key not in r:
      continue
    v, step = float(r[key]), float(r.get("step", prev_step))
    if v < prev or step < prev_step:
      total += prev
    prev, prev_step = v, step
  return total + prev


def replay_buckets(rows: Sequence[Mapping[str, float]]) -> dict[str, dict[str, float]]:
  """Per trajectory-length bucket over the whole run: groups accepted, rejected, trained and
  discarded (sums of the per-step windows), acceptance rate, staleness mean and max."""
  sums: dict[str, dict[str, float]] = collections.defaultdict(
    lambda: collections.defaultdict(float)
  )
  stale: dict[str, list[float]] = collections.defaultdict(list)
  stale_max: dict[str, float] = {}
  for r in rows:
    for key, v in r.items():
      if not key.startswith("replay/len_"):
        continue
      bucket, field = key[len("replay/len_") :].split("/", 1)
      if field in ("accepted", "rejected", "trained", "discarded"):
        sums[bucket][field] += float(v)
      elif field == "staleness_mean":
        stale[bucket].append(float(v))
      elif field == "staleness_max":
        stale_max[bucket] = max(stale_max.get(bucket, 0.0), float(v))
  out = {}
  for bucket, s in sorted(sums.items()):
    seen = s["accepted"] + s["rejected"]
    out[bucket] = {
      **s, "accept_rate": s["accepted"] / seen if seen else math.nan,
      "staleness_mean": _mean(stale[bucket]), "staleness_max": stale_max.get(bucket, math.nan),
    }  # fmt: skip
  return out


def build(root: Path, *, long_hops: int, doc_sentences: int = 0) -> dict[str, Any]:
  """The quickstart's summary plus the long-horizon figures (see the module docstring);
  `doc_sentences`: the agent's (what its searches show)."""
  summary = json.loads((root / "report" / "summary.json").read_text())
  questions = heldout_questions(root / "world" / "test.jsonl")
  hops = {qid: q.hops for qid, q in questions.items()}
  needed = calls_needed(questions, root / "world" / "corpus.jsonl", doc_sentences)
  before = eval_rows(root / "eval", "sft:")
  after = eval_rows(root / "eval", "rl:")
  lb = long_stats(before, hops, long_hops, needed=needed)
  la = long_stats(after, hops, long_hops, needed=needed)
  metrics = qs_report.read_metrics(root / "rl" / "metrics" / "metrics.jsonl")
  dist = train_distribution(metrics)
  p90 = [(d["step"], d["p90"]) for d in dist if math.isfinite(d["p90"])]
  breaks_sft = breaks_of(root / "eval", "sft:", questions)
  breaks_rl = breaks_of(root / "eval", "rl:", questions)
  summary.update(
    long_hops=long_hops, long_questions=lb["questions"], doc_sentences=doc_sentences,
    avg4_sft_long=lb["avg_em"], avg4_rl_long=la["avg_em"],
    tool_calls_sft_long=lb["tool_calls"], tool_calls_rl_long=la["tool_calls"],
    tool_calls_needed_long=lb["min_tool_calls"],
    accuracy_by_hops_sft=by_hops(before, hops), accuracy_by_hops_rl=by_hops(after, hops),
    chain_breaks_sft=breaks_sft, chain_breaks_rl=breaks_rl,
    # The share of attempted hops searched right: a k-hop chain is right about rate**k.
    hop_search_rate_sft=breaks_sft["hops"]["right_rate"],
    hop_search_rate_rl=breaks_rl["hops"]["right_rate"],
    train_tool_calls=dist,
    max_tool_calls_train=max((d["max"] for d in dist if math.isfinite(d["max"])), default=0.0),
    train_tool_calls_p90_first=qs_report.window_mean(p90, first=True),
    train_tool_calls_p90_last=qs_report.window_mean(p90, first=False),
    replay_buckets=replay_buckets(metrics),
    limit_hits={
      "train_turn_limit": run_total(metrics, "rollout/turn_limit_trajectories"),
      "train_token_limit": run_total(metrics, "rollout/token_limit_trajectories"),
      "train_trajectories": run_total(metrics, "rollout/trajectories"),
      "eval_sft_turn_limit": lb["turn_limit"], "eval_sft_token_limit": lb["token_limit"],
      "eval_rl_turn_limit": la["turn_limit"], "eval_rl_token_limit": la["token_limit"],
    },
  )  # fmt: skip
  return summary


def bars(s: Mapping[str, Any]) -> dict[str, bool]:
  """Which of the issue's bars this run meets (each alone; the 2-seed bar needs two runs)."""
  return {
    "tool_calls_rl_long>=10": s["tool_calls_rl_long"] >= MIN_LONG_TOOL_CALLS,
    "tool_calls_rl_long>=2x_sft": s["tool_calls_rl_long"]
    >= max(2 * s["tool_calls_sft_long"], 1e-9),
    "avg4_long_gain>=10pt": s["avg4_rl_long"] - s["avg4_sft_long"] >= MIN_LONG_GAIN,
    "max_tool_calls_train>=30": s["max_tool_calls_train"] >= MIN_MAX_TOOL_CALLS,
    "train_p90_rises": s["train_tool_calls_p90_last"] > s["train_tool_calls_p90_first"],
    "wall_s<=2700": s["wall_s"] <= 2700,
    "peak_rss_mb<=8192": s["peak_rss_mb"] <= 8192,
  }


def per_hop_words(doc_sentences: int) -> str:
  """What solving a hop takes when searches show `doc_sentences` (the report's and the warm
  start card's wording)."""
  if doc_sentences <= 0:
    return "one search per hop"
  if doc_sentences == 1:
    return "a search and then the page it found per hop (search results are snippets)"
  return (
    f"a search per hop, and the page it found where the snippet, a page's first {doc_sentences} "
    "sentences, does not state the fact"
  )


def format_markdown(s: Mapping[str, Any]) -> str:
  lines = [
    "# Long-horizon SynthWiki run", "",
    f"Held-out questions of >= {s['long_hops']} hops ({s['long_questions']} questions), "
    f"{temperature_words(s)}:", "",
    "| | warm start | after RL |", "|---|---|---|",
    f"| Avg@{s['k']} EM | {100 * s['avg4_sft_long']:.1f}% | {100 * s['avg4_rl_long']:.1f}% |",
    f"| tool calls / trajectory | {s['tool_calls_sft_long']:.2f} | {s['tool_calls_rl_long']:.2f} |",
    "", f"The fewest tool calls that solve them ({per_hop_words(s.get('doc_sentences', 0))}): "
    f"{s['tool_calls_needed_long']:.2f} on average.",
    "", "## By hop count (Avg EM, tool calls)", "", "| hops | warm start | after RL |",
    "|---|---|---|",
  ]  # fmt: skip
  a, b = s["accuracy_by_hops_sft"], s["accuracy_by_hops_rl"]
  for h in sorted({*a, *b}, key=int):
    cells = [f"{100 * d[h]['avg_em']:.1f}%, {d[h]['tool_calls']:.1f}" if h in d else "-"
             for d in (a, b)]  # fmt: skip
    lines.append(f"| {h} | {cells[0]} | {cells[1]} |")
  lines += ["", "## Where the chains broke (share of episodes; hops counted from 0)", "",
            "| | warm start | after RL |", "|---|---|---|"]  # fmt: skip
  for kind in chain_breaks.KINDS:
    cells = [break_cell(d, kind) for d in (s["chain_breaks_sft"], s["chain_breaks_rl"])]
    lines.append(f"| {kind} | {cells[0]} | {cells[1]} |")
  rates = [d.get("hops") for d in (s["chain_breaks_sft"], s["chain_breaks_rl"])]
  if all(r and r["attempted"] for r in rates):
    lines.append(
      "| hops searched right, of those attempted | "
      + " | ".join(f"{100 * r['right_rate']:.1f}% of {r['attempted']}" for r in rates)
      + " |"
    )
  skipped = [d.get("skipped", 0) for d in (s["chain_breaks_sft"], s["chain_breaks_rl"])]
  if any(skipped):
    lines.append(f"| unreadable episodes (skipped) | {skipped[0]} | {skipped[1]} |")
  lines += ["", "## Tool calls per training trajectory (step: mean / p90 / max)", ""]
  lines += [f"- {d['step']}: {d['mean']:.1f} / {d['p90']:.1f} / {d['max']:.0f}"
            for d in s["train_tool_calls"]]  # fmt: skip
  lines += ["", "## Replay by trajectory length", "", "```",
            json.dumps(s["replay_buckets"], indent=1), "```", "",
            f"Limit hits: {json.dumps(s['limit_hits'])}", "",
            f"Bars: {json.dumps(s['bars'])}", "",
            f"Wall time {s['wall_s']:.0f} s, peak RSS {s['peak_rss_mb']:.0f} MB.", ""]  # fmt: skip
  return "\n".join(lines)


def temperature_words(s: Mapping[str, Any]) -> str:
  """ "sampled at T 0.6 (RL at T 1.0)": which policy the Avg@k measures (summaries written before
  the evaluation temperature was separate carry neither key)."""
  t_eval, t_rl = s.get("temperature_eval"), s.get("temperature_rl")
  if t_eval is None:
    return "sampled at the RL temperature"
  rl = "" if t_eval == t_rl else f" (RL at T {float(t_rl)})"
  return f"sampled at T {float(t_eval)}{rl}"


def break_cell(breaks: Mapping[str, Any], kind: str) -> str:
  """ "31% (hop 0: 47, hop 1: 23)": a kind's share and its commonest hops."""
  d = breaks.get(kind)
  if not d or not d["count"]:
    return "-"
  top = sorted(d["by_hop"].items(), key=lambda kv: -kv[1])[:3]
  return f"{100 * d['share']:.0f}% (" + ", ".join(f"hop {h}: {c}" for h, c in top) + ")"


def write(out: Path, summary: Mapping[str, Any]) -> None:
  out.mkdir(parents=True, exist_ok=True)
  (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
  (out / "long_horizon.md").write_text(format_markdown(summary))
