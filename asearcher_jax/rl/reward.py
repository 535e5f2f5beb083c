"""Trajectory rewards and group baselines, as ASearcher trains them.

score = metric(last <answer>, gold) (max over aliases; 0.7/0.3 blend with alternative answers),
times the all-generations format gate; a "valid-instructed" question answered as invalid scores
-0.5. A trajectory whose *tool* (or engine) failed is not scored at all: it is excluded from its
group, so an outage never teaches the policy that its answer was wrong.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np

from asearcher_jax.agent.trajectory import Trajectory
from asearcher_jax.evaluation import metrics

INVALID_MARKERS = ("question", "invalid", "appropriate", "valid")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardConfig:
  # Answer metric: "f1" (all released configs) or "em".
  metric: Literal["f1", "em"] = "f1"
  # Weight of max(alternative-answer score, score) in the blend; 0 ignores aug_answers.
  aug_weight: float = 0.3
  # Zero the score unless every generation passes the format gate.
  format_gate: bool = True
  # Score of a valid-instructed question answered as invalid; None disables the penalty.
  invalid_penalty: float | None = -0.5
  # Substrings (of the lowercased answer) that mean "this question is invalid".
  invalid_markers: tuple[str, ...] = INVALID_MARKERS


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reward:
  """score is None when the trajectory must be excluded (environment failure)."""

  score: float | None
  # The metric alone (after the aug blend), before the gate and the penalty.
  correctness: float
  format_ok: bool
  judged_invalid: bool
  environment_failure: bool


def answer_score(
  pred: str | None,
  answers: str | Sequence[str],
  aug_answers: str | Sequence[str] = (),
  *,
  metric: Literal["f1", "em"] = "f1",
  aug_weight: float = 0.3,
) -> float:
  """metric(pred, answers), blended (1-w)·score + w·max(score_aug, score) when aug_answers exist."""
  fn = metrics.f1 if metric == "f1" else metrics.exact_match
  score = fn(pred, answers)
  if aug_answers and aug_weight:
    aug = max(fn(pred, aug_answers), score)
    score = (1 - aug_weight) * score + aug_weight * aug
  return score


def trajectory_reward(traj: Trajectory, config: RewardConfig | None = None) -> Reward:
  config = config or RewardConfig()
  correctness = answer_score(
    traj.pred_answer,
    traj.answers,
    traj.aug_answers,
    metric=config.metric,
    aug_weight=config.aug_weight,
  )
  format_ok = traj.format_ok
  score = correctness * float(format_ok or not config.format_gate)
  pred = (traj.pred_answer or "").lower()
  judged_invalid = traj.pred_answer is not None and any(m in pred for m in config.invalid_markers)
  if traj.valid_inst and judged_invalid and config.invalid_penalty is not None:
    score = config.invalid_penalty
  return Reward(
    score=None if traj.environment_failure else score,
    correctness=correctness,
    format_ok=format_ok,
    judged_invalid=judged_invalid,
    environment_failure=traj.environment_failure,
  )


def group_advantages(scores: Sequence[float | None]) -> list[float | None] | None:
  """Scores minus the group mean; None entries (excluded trajectories) stay None.

  Returns None when the group carries no signal and must be dropped: fewer than two scored
  trajectories, or all scores equal (all right, all wrong, or equal F1).
  """
  kept = np.asarray([s for s in scores if s is not None], np.float64)
  if kept.size < 2 or kept.max() == kept.min():
    return None
  mean = float(kept.mean())
  return [None if s is None else float(s) - mean for s in scores]
