"""Trajectory reward: metric, alias max, aug blend, format gate, invalid penalty, environment
failures, and group centring with zero-variance dropping."""

from __future__ import annotations

import numpy as np
import pytest

from asearcher_jax.agent.trajectory import LLMCall, Trajectory
from asearcher_jax.rl import reward


def _call(text: str, index: int = 0) -> LLMCall:
  from asearcher_jax.agent import protocol

  return LLMCall(
    index=index,
    kind="act",
    input_ids=np.zeros(3, np.int32),
    output_ids=np.ones(2, np.int32),
    logprobs=np.zeros(2, np.float32),
    versions=np.zeros(2, np.int32),
    stop_reason="stop",
    max_new_tokens=8,
    text=text,
    format_problems=protocol.check_format(text).problems,
  )


def _traj(pred, answers, *, texts=("ok</think>\n<answer> x </answer>",), **kw) -> Trajectory:
  return Trajectory(
    agent="t",
    question="q",
    answers=list(answers),
    pred_answer=pred,
    calls=[_call(t, i) for i, t in enumerate(texts)],
    **kw,
  )


def test_f1_of_the_answer_max_over_aliases():
  r = reward.trajectory_reward(_traj("Barack Obama", ["Obama", "Barack Hussein Obama"]))
  assert r.score == pytest.approx(0.8) and r.format_ok and not r.environment_failure
  em = reward.trajectory_reward(_traj("Obama", ["Barack Obama"]), reward.RewardConfig(metric="em"))
  assert em.score == 0.0


def test_alternative_answer_blend():
  # main 0, aug 1 -> 0.7*0 + 0.3*max(1, 0)
  assert reward.answer_score("Lilith", ["Lilu"], ["Lilith"]) == pytest.approx(0.3)
  # main 1, aug 0 -> 0.7*1 + 0.3*max(0, 1) = 1
  assert reward.answer_score("Lilu", ["Lilu"], ["Lilith"]) == pytest.approx(1.0)
  # partial: main 2/3 (P=1/2), aug 1 -> 0.7*2/3 + 0.3
  assert reward.answer_score("New York", ["York"], ["new york"]) == pytest.approx(0.7 * 2 / 3 + 0.3)
  assert reward.answer_score("Lilith", ["Lilu"], ["Lilith"], aug_weight=0) == 0.0


def test_no_answer_scores_zero():
  assert reward.trajectory_reward(_traj(None, ["Paris"])).score == 0.0


def test_format_gate_zeroes_a_correct_answer_in_any_generation():
  bad_texts = [
    "a</think>\n<search> q </search> <search> r </search>",  # two tool calls
    "a</think>\n<search> q",  # unclosed
    "Assistant: <answer> Paris </answer>",  # role string
    "x</think> y</think> <answer>Paris</answer>",  # two </think>
  ]
  for bad in bad_texts:
    traj = _traj("Paris", ["Paris"], texts=(bad, "fine</think>\n<answer> Paris </answer>"))
    r = reward.trajectory_reward(traj)
    assert not r.format_ok and r.score == 0.0 and r.correctness == 1.0, bad
  off = reward.trajectory_reward(
    _traj("Paris", ["Paris"], texts=(bad_texts[0],)), reward.RewardConfig(format_gate=False)
  )
  assert off.score == 1.0


def test_invalid_answer_penalty_only_when_valid_instructed():
  pred = "The question is invalid."
  assert reward.trajectory_reward(_traj(pred, ["Paris"], valid_inst=True)).score == -0.5
  r = reward.trajectory_reward(_traj(pred, ["Paris"], valid_inst=False))
  assert r.score == 0.0 and r.judged_invalid
  # the markers are substrings ("valid" in "Invalid") and overrule a correct answer
  assert reward.trajectory_reward(_traj("Paris (valid)", ["Paris"], valid_inst=True)).score == -0.5
  assert not reward.trajectory_reward(_traj("Paris", ["Paris"], valid_inst=True)).judged_invalid


def test_environment_failure_is_excluded_not_scored_zero():
  traj = _traj(None, ["Paris"], environment_failure=True)
  r = reward.trajectory_reward(traj)
  assert r.score is None and r.environment_failure


def test_group_centring_and_dropping():
  adv = reward.group_advantages([1.0, 0.0, 0.5, 0.5])
  assert adv == pytest.approx([0.5, -0.5, 0.0, 0.0])
  assert reward.group_advantages([1.0] * 16) is None  # all correct
  assert reward.group_advantages([0.0] * 16) is None  # all wrong
  assert reward.group_advantages([0.1] * 3) is None  # equal F1, even where the mean is inexact
  assert reward.group_advantages([0.7]) is None
  # excluded trajectories don't count towards the mean and stay excluded
  assert reward.group_advantages([1.0, None, 0.0]) == pytest.approx([0.5, None, -0.5])
  assert reward.group_advantages([1.0, None, None]) is None


def test_score_group_sets_scores():
  """The RL loop's `score_group` with the ASearcher reward: scores set on the trajectories, an
  environment failure excluded (None), the rest centred on their mean."""
  from asearcher_jax.rl.scoring import answer_scorer, score_group

  trajs = [_traj("Paris", ["Paris"]), _traj("Rome", ["Paris"]), _traj(None, ["Paris"])]
  trajs.append(_traj("Paris", ["Paris"], environment_failure=True))
  out = score_group(trajs, answer_scorer())
  assert [t.score for t in trajs] == [1.0, 0.0, 0.0, None] == out.scores
  assert out.advantages == pytest.approx([2 / 3, -1 / 3, -1 / 3, None])


def test_progress_scorer_blends_step_credit_into_the_answer_reward():
  from asearcher_jax.rl.scoring import answer_scorer, progress_scorer

  done = {"a": 1.0, "b": 0.5, "c": None}
  score = progress_scorer(lambda t: done[t.qid], 0.25, reward.RewardConfig(metric="em"))
  right = _traj("Paris", ["Paris"], qid="a")
  half = _traj("Lyon", ["Paris"], qid="b")  # wrong answer, half the steps right
  other = _traj("Paris", ["Paris"], qid="c")  # no progress measure: the answer's share alone
  broken = _traj("Paris", ["Paris"], qid="a", texts=("<answer> Paris",))  # fails the gate
  failed = _traj("Paris", ["Paris"], qid="a", environment_failure=True)
  assert score([right, half, other, broken, failed]) == [1.0, 0.125, 0.75, 0.0, None]
  assert (right.score, half.score, failed.score) == (1.0, 0.125, None)  # set on the trajectory
  # Weight 0 is the ASearcher reward exactly.
  plain = [_traj("Paris", ["Paris"], qid="b"), _traj("Lyon", ["Paris"], qid="b")]
  assert progress_scorer(lambda t: 0.5, 0.0)(plain) == answer_scorer()(plain) == [1.0, 0.0]
  with pytest.raises(ValueError, match="progress weight"):
    progress_scorer(lambda t: 0.0, 1.0)
