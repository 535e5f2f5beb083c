"""ASearcher's released files load with nothing dropped: the training sets' `aug_answer`, `qid`
and `source`, and the test-data layout's fields, on rows written the way the released files are
(one `json.dumps` of a dict per line, keys in the released order)."""

from __future__ import annotations

import json

import pytest

from asearcher_jax.agent.trajectory import Trajectory
from asearcher_jax.data.qa import load_asearcher_layout, load_qa_file, load_training_qa
from asearcher_jax.rl.reward import answer_score, trajectory_reward

# ASearcher-Base-35k.jsonl / ASearcher-LRM-35k.jsonl: keys in this order, `answer` and
# `aug_answer` lists, `source` possibly null (its own preprocessing scripts guard for that).
RELEASED_35K = [
  {
    "question": "Which river flows through the city where the author of Dubliners was born?",
    "answer": ["River Liffey"],
    "source": "hotpotqa",
    "aug_answer": ["Liffey", "An Life", "River Liffey"],
    "qid": "hotpotqa_train_10423@0",
  },
  {
    "question": "In what year was the club founded whose stadium hosted the 1966 final?",
    "answer": ["1889", "1889 AD"],
    "source": "2wiki",
    "aug_answer": [],
    "qid": "2wiki_train_77",
  },
  {
    "question": "Who composed the anthem first performed at the 1992 games?",
    "answer": ["Andrew Lloyd Webber"],
    "source": None,
    "aug_answer": ["Lloyd Webber"],
    "qid": "synth_3",
  },
]


def _write_released(path, rows):
  with open(path, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row, ensure_ascii=False) + "\n")
  return path


def test_asearcher_35k_rows_load_with_every_field(tmp_path):
  path = _write_released(tmp_path / "ASearcher-Base-35k.jsonl", RELEASED_35K)
  items = load_training_qa(path)
  assert [x.id for x in items] == [r["qid"] for r in RELEASED_35K]
  assert [x.question for x in items] == [r["question"] for r in RELEASED_35K]
  assert [x.answers for x in items] == [tuple(r["answer"]) for r in RELEASED_35K]
  assert [x.aug_answers for x in items] == [tuple(r["aug_answer"]) for r in RELEASED_35K]
  assert [x.origin for x in items] == ["hotpotqa", "2wiki", ""]
  assert [x.source for x in items] == [f"{path}:{n}" for n in (1, 2, 3)]
  assert {x.dataset for x in items} == {"ASearcher-Base-35k"}


def test_asearcher_35k_aliases_reach_the_reward(tmp_path):
  """An answer that matches only an alias earns the alias blend (0.3 of full marks), which it
  could not if `aug_answer` were dropped on loading."""
  (item, *_) = load_training_qa(_write_released(tmp_path / "train.jsonl", RELEASED_35K))
  traj = Trajectory(
    agent="asearcher",
    qid=item.id,
    question=item.question,
    answers=list(item.answers),
    aug_answers=list(item.aug_answers),
  )
  traj.pred_answer = "An Life"
  assert answer_score("An Life", item.answers) == 0.0
  assert trajectory_reward(traj).correctness == pytest.approx(0.3)
  traj.pred_answer = "River Liffey"
  assert trajectory_reward(traj).correctness == pytest.approx(1.0)


def test_asearcher_test_data_layout_keeps_ids_aliases_and_source(tmp_path):
  """`{data_dir}/{name}/test.jsonl` rows (question, answer str or list, or gt): aliases count as
  correct in evaluation, a record's own id is kept, its source rides along."""
  rows = [
    {"question": "Q0", "answer": ["A", "B"], "source": "bamboogle", "id": "b_1"},
    {"question": "Q1", "gt": "C"},
    {"question": "Q2", "answer": "D", "aug_answer": ["d alias"], "qid": "q2"},
  ]
  (tmp_path / "Bamboogle").mkdir()
  _write_released(tmp_path / "Bamboogle" / "test.jsonl", rows)
  a, b, c = load_asearcher_layout(tmp_path, "Bamboogle")
  assert (a.id, a.answers, a.origin, a.dataset) == ("b_1", ("A", "B"), "bamboogle", "Bamboogle")
  assert (b.id, b.answers, b.origin) == ("1", ("C",), "")
  assert (c.id, c.answers) == ("q2", ("D", "d alias"))
  # The same file read as a generic QA file agrees.
  assert [x.id for x in load_qa_file(tmp_path / "Bamboogle" / "test.jsonl")] == ["b_1", "1", "q2"]
