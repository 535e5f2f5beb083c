"""The long-horizon report's reading of evaluation episodes: a torn or foreign record costs one
episode (counted), never the report."""

from __future__ import annotations

import json
from pathlib import Path

from asearcher_jax.apps.long_horizon_report import breaks_of
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
