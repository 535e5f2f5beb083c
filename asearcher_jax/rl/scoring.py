"""Scoring a group and counting what the rollout did: pure functions and a small counter class.

`score_group` is the one place where a group's episodes become scores and advantages (or a
rejection); `RolloutStats` holds the controller's `rollout/*` counters and per-trajectory samples
behind its own lock, so the learner thread can read them while episodes finish.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Sequence

import numpy as np

from asearcher_jax.agent.trajectory import Trajectory
from asearcher_jax.evaluation import metrics as eval_metrics
from asearcher_jax.rl import reward as reward_lib

# Per-trajectory scores for one group, None where a trajectory must be excluded.
Scorer = Callable[[Sequence[Trajectory]], list[float | None]]


def answer_scorer(config: reward_lib.RewardConfig | None = None) -> Scorer:
  """The ASearcher reward (`rl.reward.trajectory_reward`); sets `traj.score`."""

  def score(trajs: Sequence[Trajectory]) -> list[float | None]:
    out = []
    for t in trajs:
      t.score = reward_lib.trajectory_reward(t, config).score
      out.append(t.score)
    return out

  return score


def progress_scorer(
  progress: Callable[[Trajectory], float | None],
  weight: float,
  config: reward_lib.RewardConfig | None = None,
) -> Scorer:
  """(1 - weight) x the ASearcher reward + weight x `progress(t)` (a fraction in [0, 1]; None:
  no credit), the credit only where the format gate passes; sets `traj.score`. Why: a terminal
  reward says a long chain failed, not at which step, so at a per-step success rate r a k-step
  episode is rewarded ~r**k of the time; credit for the steps done right says which ones were."""
  if not 0 <= weight < 1:
    raise ValueError(f"progress weight must be in [0, 1), got {weight}")

  def score(trajs: Sequence[Trajectory]) -> list[float | None]:
    out = []
    for t in trajs:
      r = reward_lib.trajectory_reward(t, config)
      if r.score is None:
        t.score = None
      else:
        done = (progress(t) or 0.0) if r.format_ok else 0.0
        t.score = (1 - weight) * r.score + weight * done
      out.append(t.score)
    return out

  return score


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupScores:
  """The outcome of scoring one group.

  Attributes:
    scores: per episode, its score; None where it did not run, failed for environment reasons
      or was excluded by the scorer.
    advantages: per episode, its group-centred score (None where excluded); None when the group
      carries no signal and is rejected.
    usable: episodes that ran without an environment failure (the ones scored).
  """

  scores: list[float | None]
  advantages: list[float | None] | None
  usable: int

  @property
  def keep(self) -> list[int]:
    """Indices of the episodes the group trains on (empty for a rejected group)."""
    return [i for i, a in enumerate(self.advantages or ()) if a is not None]

  @property
  def rejection(self) -> str | None:
    """Why the group is rejected (a `rollout/*` counter name), None when it is accepted."""
    if self.advantages is not None:
      return None
    return "groups_zero_variance" if self.usable >= 2 else "groups_too_few_scored"


def score_group(trajs: Sequence[Trajectory | None], scorer: Scorer) -> GroupScores:
  """Scores the usable episodes of a group (ran, no environment failure: a failed episode is
  never trained as a zero reward), then centres and filters the group
  (`rl.reward.group_advantages`: fewer than two scores, or all equal, reject it)."""
  scores: list[float | None] = [None] * len(trajs)
  usable = [i for i, t in enumerate(trajs) if t is not None and not t.environment_failure]
  if usable:
    for i, s in zip(usable, scorer([trajs[i] for i in usable])):
      scores[i] = s
  return GroupScores(
    scores=scores, advantages=reward_lib.group_advantages(scores), usable=len(usable)
  )


class RolloutStats:
  """Counters (cumulative) and per-trajectory samples (windowed, reset by `snapshot`)."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._count: collections.Counter[str] = collections.Counter()
    self._samples: dict[str, list[float]] = collections.defaultdict(list)

  def snapshot(self, *, reset: bool = True) -> dict[str, float]:
    """`rollout/*`: the counters, and means of the samples since the last reset (group latency
    also as its max; tool calls and turns also as p90 and max)."""
    with self._lock:
      out = {f"rollout/{k}": float(v) for k, v in self._count.items()}
      for k, vs in self._samples.items():
        if vs:
          out[f"rollout/{k}"] = float(np.mean(vs))
      if self._samples.get("group_s"):
        out["rollout/group_s_max"] = float(np.max(self._samples["group_s"]))
      for k in ("tool_calls", "turns"):  # the long-horizon distribution (mean, p90, max)
        if self._samples.get(k):
          out[f"rollout/{k}_p90"] = float(np.percentile(self._samples[k], 90))
          out[f"rollout/{k}_max"] = float(np.max(self._samples[k]))
      if reset:
        self._samples.clear()
    return out

  def count(self, **kw: float) -> None:
    with self._lock:
      self._count.update({k: v for k, v in kw.items() if v})

  def sample(self, **kw: float) -> None:
    with self._lock:
      for k, v in kw.items():
        self._samples[k].append(float(v))

  def record_trajectory(self, t: Trajectory, score: float | None) -> None:
    """Samples and counts of one finished trajectory (scored or excluded)."""
    s = t.stats()
    self.sample(
      turns=s["num_llm_calls"],
      output_tokens=s["num_output_tokens"],
      tool_calls=s["num_tool_calls"],
      searches=s["num_search"],
      answered=s["answered"],
      format_ok=s["format_ok"],
      episode_s=s["duration_s"],
      **({} if t.environment_failure else {"accuracy": accuracy(t)}),
      **({} if score is None else {"reward": score}),
    )
    self.count(
      trajectories=1,
      # Not `tool_calls`: that key is the per-trajectory mean, and a window with no trajectories
      # would report this cumulative count under it.
      tool_calls_total=s["num_tool_calls"],
      generated_tokens=s["num_output_tokens"],
      interrupted_trajectories=int(interrupted(t)),
      turn_limit_trajectories=int(t.finish_reason == "turn_limit"),
      token_limit_trajectories=int(t.finish_reason == "token_limit"),
    )


def accuracy(t: Trajectory) -> float:
  return eval_metrics.exact_match(t.pred_answer, t.answers) if t.answers else 0.0


def interrupted(t: Trajectory) -> bool:
  """A weight update landed inside one of its generate calls (engine-stamped versions differ)."""
  return any(c.versions.size and c.versions.min() != c.versions.max() for c in t.calls)
