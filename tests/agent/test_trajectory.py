"""Prefix merging into training sequences, JSON round trips, and packing compatibility."""

from __future__ import annotations

import json

import numpy as np

from asearcher_jax.agent.trajectory import LLMCall, Trajectory, merge_calls
from asearcher_jax.model.packing import pack, unpack


def _call(i, inp, out, stop="stop", version=0):
  return LLMCall(
    index=i,
    kind="act",
    input_ids=np.asarray(inp, np.int32),
    output_ids=np.asarray(out, np.int32),
    logprobs=-np.arange(1, len(out) + 1, dtype=np.float32) / 10,
    versions=np.full(len(out), version, np.int32),
    stop_reason=stop,
    max_new_tokens=16,
    text="t",
  )


CALLS = [
  _call(0, [1, 2, 3], [4, 5]),  # prompt + gen
  _call(1, [1, 2, 3, 4, 5, 6, 7], [8], version=1),  # extends: + tool tokens 6 7
  _call(2, [1, 2, 3, 4, 5, 9, 8, 10], [11], stop="length"),  # compaction: 6 7 -> 9
  _call(3, [1, 2, 3, 4, 5, 9, 8, 10, 11], [12, 13]),  # continues the second sequence
]


def test_prefix_merge_rule():
  a, b = merge_calls(CALLS)
  assert a.calls == [0, 1] and b.calls == [2, 3]
  assert a["tokens"].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
  assert a["loss_mask"].tolist() == [0, 0, 0, 1, 1, 0, 0, 1]
  assert a["versions"].tolist() == [-1, -1, -1, 0, 0, -1, -1, 1]
  np.testing.assert_allclose(a["logprobs"], [0, 0, 0, -0.1, -0.2, 0, 0, -0.1])
  assert b["tokens"].tolist() == [1, 2, 3, 4, 5, 9, 8, 10, 11, 12, 13]
  assert b["loss_mask"].tolist() == [0] * 8 + [1, 1, 1]
  assert (a.stop_reason, b.stop_reason) == ("stop", "stop")
  *_, last = merge_calls(CALLS, final_stop="turn_limit")
  assert last.stop_reason == "turn_limit"
  assert merge_calls(CALLS[:3])[1].stop_reason == "length"


def test_extends_the_longest_matching_sequence():
  calls = [_call(0, [1], [2]), _call(1, [7], [8]), _call(2, [1, 2, 3], [4]), _call(3, [7, 8], [9])]
  seqs = merge_calls(calls)
  assert [s.calls for s in seqs] == [[0, 2], [1, 3]]


def test_sequences_pack_directly():
  seqs = merge_calls(CALLS)
  batch, placement = pack(seqs, row_len=32)
  assert set(batch) == {"tokens", "positions", "segment_ids", "loss_mask", "logprobs", "versions"}
  assert batch["versions"].dtype == np.int32 and batch["logprobs"].dtype == np.float32
  for s, got in zip(seqs, unpack(batch["tokens"], placement)):
    assert got.tolist() == s["tokens"].tolist()


def test_json_round_trip(tmp_path):
  traj = Trajectory(agent="a", question="q?", answers=["x"], calls=list(CALLS), pred_answer="x")
  traj.finish_reason = "answer"
  path = tmp_path / "t.json"
  traj.save(path)
  raw = json.loads(path.read_text())
  assert raw["calls"][1]["num_input_tokens"] == 7 and raw["stats"]["num_llm_calls"] == 4.0
  back = Trajectory.load(path)
  assert back.pred_answer == "x" and back.finish_reason == "answer"
  for s1, s2 in zip(traj.training_sequences(), back.training_sequences()):
    for k in s1:
      np.testing.assert_array_equal(s1[k], s2[k])
