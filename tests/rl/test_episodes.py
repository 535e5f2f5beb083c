"""The episode export: records round-trip, every group lands as one gzip member, and a torn
last member (a crash mid-append) costs only that group."""

from __future__ import annotations

import numpy as np

from asearcher_jax.agent.trajectory import LLMCall, Trajectory
from asearcher_jax.rl.episodes import EpisodeLog, read_episodes


def _traj(qid: str, answer: str) -> Trajectory:
  call = LLMCall(
    index=0, kind="act", input_ids=np.arange(5), output_ids=np.array([7, 8, 9]),
    logprobs=np.array([-0.1, -0.2, -0.3]), versions=np.array([2, 2, 3]), stop_reason="stop",
    max_new_tokens=8, text=f"<answer>{answer}</answer>",
  )  # fmt: skip
  return Trajectory(agent="asearcher", question="q?", qid=qid, answers=["a"], calls=[call],
                    pred_answer=answer, finish_reason="answer")  # fmt: skip


def test_groups_round_trip_and_a_torn_tail_loses_only_the_last_group(tmp_path):
  log = EpisodeLog(tmp_path / "ep" / "episodes.jsonl.gz")
  n = log.append_group(
    group_id="e0/i1/q1", qid="q1", trajectories=[_traj("q1", "a"), None, _traj("q1", "b")],
    versions=(2, 3), scores=[1.0, None, 0.0], advantages=[0.5, None, -0.5], rejection=None,
  )  # fmt: skip
  assert n == 2  # the episode that never produced a trajectory is not written
  log.append_group(
    group_id="e0/i2/q2", qid="q2", trajectories=[_traj("q2", "a"), _traj("q2", "a")],
    versions=(3, 3), scores=[1.0, 1.0], advantages=None, rejection="groups_zero_variance",
  )  # fmt: skip
  recs = read_episodes(log.path)
  assert [(r["group_id"], r["episode"], r["accepted"]) for r in recs] == [
    ("e0/i1/q1", 0, True), ("e0/i1/q1", 2, True), ("e0/i2/q2", 0, False), ("e0/i2/q2", 1, False),
  ]  # fmt: skip
  assert recs[1]["advantage"] == -0.5 and recs[2]["rejection"] == "groups_zero_variance"
  assert recs[0]["item"] == "e0/i1" and recs[0]["created_version"] == 2
  back = Trajectory.from_json(recs[0]["trajectory"]).training_sequences()[0]
  np.testing.assert_array_equal(back["versions"], [-1] * 5 + [2, 2, 3])
  raw = log.path.read_bytes()
  log.path.write_bytes(raw[:-7])  # the last group's member cut mid-write
  assert [r["group_id"] for r in read_episodes(log.path)] == ["e0/i1/q1"] * 2
  assert read_episodes(tmp_path / "absent.jsonl.gz") == []


def test_model_text_with_unicode_line_separators_stays_one_record(tmp_path):
  """JSON leaves U+2028, U+2029 and U+0085 unescaped (the export writes ensure_ascii=False), and
  `str.splitlines` splits on them: a random policy that sampled one tore its record in two and
  the whole export was refused as corrupt (CI, 2026-12-04)."""
  log = EpisodeLog(tmp_path / "episodes.jsonl.gz")
  odd = "a\u2028b\u2029c\x85d\x1ce\r"
  log.append_group(
    group_id="e0/i1/q1", qid="q1", trajectories=[_traj("q1", odd), _traj("q1", "x")],
    versions=(1, 1), scores=[1.0, 0.0], advantages=[0.5, -0.5], rejection=None,
  )  # fmt: skip
  recs = read_episodes(log.path)
  assert [r["episode"] for r in recs] == [0, 1]
  assert Trajectory.from_json(recs[0]["trajectory"]).pred_answer == odd
