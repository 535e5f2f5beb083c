"""The long-horizon report's reading of evaluation episodes: a torn or foreign record costs one
episode (counted), never the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asearcher_jax.apps.long_horizon_report import (
  breaks_of,
  calls_needed,
  long_stats,
  per_hop_words,
)
from asearcher_jax.synthwiki.questions import SynthQuestion

CHAIN = SynthQuestion(
  id="q", question="?", answer="1200", kind="chain", hops=2, start="Ana", start_type="person",
  relations=("mentor", "born_in"), bridges=("Bo", "1200"),
)  # fmt: skip


def _record(qid: str, queries: list[str]) -> str:
  calls = [{"kind": "act", "action": f"<search> {q} </search>"} for q in queries]
  return json.dumps({"qid": qid, "finish_reason": "answer", "trajectory": {"calls": calls}})


def _evaluation(root: Path, records: dict[str, str]) -> Path:
  """An evaluation run directory laid out as `evaluation` writes it."""
  run = root / "eval" / "asearcher-1"
  run.mkdir(parents=True)
  (run / "config.json").write_text(json.dumps({"policy": "sft:abc"}))
  (run / "questions.csv").write_text("qid,em\n")
  for name, text in records.items():
    f = run / "q" / "run0" / name
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(text)
  return root / "eval"


def test_breaks_skip_and_count_torn_or_foreign_records(tmp_path):
  good = _record("q", ["Ana trained by", "Bo born in"])
  eval_dir = _evaluation(
    tmp_path,
    {
      "a.json": good,
      "b.json": _record("q", ["Zed born in"]),
      "c.json": good[: len(good) // 2],  # torn by a crash mid-write
      "d.json": _record("other-world", ["Ana trained by"]),
      "e.json": json.dumps({"qid": "q"}),  # no trajectory
    },
  )
  breaks = breaks_of(eval_dir, "sft:", {"q": CHAIN})
  assert breaks["episodes"] == 2 and breaks["skipped"] == 3
  assert breaks["all hops searched"]["count"] == 1
  assert breaks["wrong entity and relation"]["count"] == 1


def test_no_evaluation_means_no_episodes(tmp_path):
  breaks = breaks_of(tmp_path / "eval", "rl:", {"q": CHAIN})
  assert breaks["episodes"] == 0 and breaks["skipped"] == 0


def test_the_calls_a_long_question_needs_are_counted_per_question():
  rows = [
    {"qid": "a", "em": 1.0, "tool_calls": 9.0},
    {"qid": "b", "em": 0.0, "tool_calls": 3.0},
    {"qid": "short", "em": 1.0, "tool_calls": 4.0},
  ]
  hops = {"a": 8, "b": 6, "short": 4}
  one = long_stats(rows, hops, 6)
  assert one["min_tool_calls"] == 7.0 and one["tool_calls"] == 6.0 and one["avg_em"] == 0.5
  pages = long_stats(rows, hops, 6, needed={"a": 16, "b": 9, "short": 8})
  assert pages["min_tool_calls"] == 12.5 and pages["tool_calls"] == 6.0


def test_the_words_for_a_hop_follow_what_searches_show(tmp_path):
  assert per_hop_words(0) == "one search per hop"
  assert per_hop_words(1).endswith("per hop (search results are snippets)")
  assert "first 3 sentences, does not state the fact" in per_hop_words(3)
  # A run directory of another world: one line naming the corpus and a missing page.
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text(json.dumps({"url": "https://synthwiki.org/Ana", "contents": "x"}) + "\n")
  other = SynthQuestion(
    id="o", question="?", answer="1200", kind="chain", hops=2, start="Zed", start_type="person",
    relations=("mentor", "born_in"), bridges=("Bo", "1200"), gold_titles=("Zed", "Bo"),
  )  # fmt: skip
  with pytest.raises(ValueError, match=r"corpus\.jsonl: no page for \['Bo', 'Zed'\]"):
    calls_needed({"o": other}, corpus, 3)
  assert calls_needed({"o": other}, corpus, 0) == {"o": 2}  # whole pages: nothing to read
