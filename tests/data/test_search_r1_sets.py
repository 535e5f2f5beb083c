"""TriviaQA and PopQA as Search-R1 and FlashRAG ship them, which completes Search-R1's seven
evaluation sets (NQ, TriviaQA, PopQA, HotpotQA, 2Wiki, MuSiQue, Bamboogle). The rows are written
here the way those projects write them: FlashRAG's `{name}/test.jsonl` (id, question,
golden_answers, metadata) and Search-R1's merged `test.parquet` (FlashRAG's columns plus
data_source, the templated prompt, ability, reward_model and extra_info; pyarrow, as HF
`datasets.to_parquet` does). No file of either set ships with the package."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asearcher_jax.data import SEARCH_R1_SOURCES, DatasetError, load_dataset, load_search_r1

TRIVIAQA = [
  {"id": "test_0", "question": "Who was the man behind The Chipmunks?",
   "golden_answers": ["David Seville", "Ross Bagdasarian"],
   "metadata": {"question_id": "tc_2"}},
  {"id": "test_1", "question": "Which Lloyd Webber musical premiered in the US on 10th December 1993?",
   "golden_answers": ["Sunset Boulevard", "Sunset Blvd"], "metadata": {"question_id": "tc_33"}},
]  # fmt: skip
POPQA = [
  {"id": "test_0", "question": "What is George Rankin's occupation?",
   "golden_answers": ["politician", "political leader"],
   "metadata": {"subj": "George Rankin", "prop": "occupation", "s_pop": 142}},
  {"id": "test_1", "question": "In what city was John Mayne born?",
   "golden_answers": ["Dumfries"], "metadata": {"subj": "John Mayne", "prop": "place of birth",
                                                 "s_pop": 95}},
]  # fmt: skip


def _flashrag(root, name, rows):
  (root / name).mkdir(parents=True)
  path = root / name / "test.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def _search_r1_row(source: str, row: dict, idx: int) -> dict:
  """One row as `qa_search_test_merge.py` maps a FlashRAG row (the original columns stay)."""
  question = row["question"].strip()
  question += "" if question.endswith("?") else "?"
  prompt = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first "
    f"... Question: {question}\n"
  )
  return {
    **row,
    "question": question,  # the script edits the row in place before mapping it
    "data_source": source,
    "prompt": [{"role": "user", "content": prompt}],
    "ability": "fact-reasoning",
    "reward_model": {"style": "rule", "ground_truth": {"target": row["golden_answers"]}},
    "extra_info": {"split": "test", "index": idx},
  }


def _merged_parquet(path, sets: dict[str, list[dict]]):
  rows = [_search_r1_row(s, r, i) for s, rs in sets.items() for i, r in enumerate(rs)]
  for r in rows:  # one schema for the whole file, as `datasets.concatenate_datasets` requires
    r["metadata"] = json.dumps(r["metadata"])
  pq.write_table(pa.Table.from_pylist(rows), path)
  return path


def test_triviaqa_and_popqa_in_flashrag_layout(tmp_path):
  _flashrag(tmp_path, "triviaqa", TRIVIAQA)
  _flashrag(tmp_path, "popqa", POPQA)
  trivia = load_dataset("triviaqa", data_dir=tmp_path)
  assert [e.id for e in trivia] == ["test_0", "test_1"]
  assert trivia[0].answers == ("David Seville", "Ross Bagdasarian")
  assert trivia[0].dataset == "triviaqa" and trivia[0].source.endswith("triviaqa/test.jsonl:1")
  popqa = load_dataset("popqa", data_dir=tmp_path, limit=1)
  assert len(popqa) == 1 and popqa[0].question == "What is George Rankin's occupation?"
  assert popqa[0].answers == ("politician", "political leader")


def test_triviaqa_and_popqa_from_search_r1_merged_parquet(tmp_path):
  merged = _merged_parquet(
    tmp_path / "test.parquet",
    {"nq": [{"id": "test_0", "question": "who sings does he love me with reba",
             "golden_answers": ["Linda Davis"], "metadata": {}}],
     "triviaqa": TRIVIAQA, "popqa": POPQA},
  )  # fmt: skip
  trivia = load_search_r1(merged, "triviaqa")
  # Ids restart at test_0 in every set of the merged file: each set is read on its own.
  assert [e.id for e in trivia] == ["test_0", "test_1"]
  assert {e.dataset for e in trivia} == {"triviaqa"}
  assert trivia[1].answers == ("Sunset Boulevard", "Sunset Blvd")
  assert trivia[1].source == f"{merged}:3"  # the file's row number
  popqa = load_dataset("popqa", data_dir=tmp_path)
  assert [e.question for e in popqa] == [r["question"] for r in POPQA]
  assert popqa[1].answers == ("Dumfries",)
  nq = load_dataset("nq", data_dir=tmp_path)
  assert nq[0].question == "who sings does he love me with reba?"  # the merge script's '?'


def test_popqa_parquet_mistakes_are_one_line_naming_the_file(tmp_path):
  merged = _merged_parquet(tmp_path / "test.parquet", {"triviaqa": TRIVIAQA})
  with pytest.raises(DatasetError, match=r"test.parquet: no rows with data_source 'popqa'"):
    load_search_r1(merged, "popqa")
  bare = tmp_path / "bare.parquet"
  pq.write_table(pa.Table.from_pylist([{"question": "Q", "golden_answers": ["A"]}]), bare)
  with pytest.raises(DatasetError, match=r"bare.parquet:1: no 'data_source' string"):
    load_search_r1(bare, "popqa")
  broken = tmp_path / "broken.parquet"
  broken.write_bytes(b"PAR1 not really")
  with pytest.raises(DatasetError, match=r"broken.parquet: not a readable Parquet file"):
    load_search_r1(broken, "popqa")
  with pytest.raises(DatasetError, match="unknown dataset 'popqa'"):
    load_dataset("popqa", data_dir=tmp_path / "nowhere")


def test_search_r1_seven_are_named():
  assert SEARCH_R1_SOURCES == (
    "nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle",
  )  # fmt: skip
