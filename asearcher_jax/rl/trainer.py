"""The training loop: a thin orchestrator over the replay queue, learner, weight sync and
checkpoints. The rollout controller runs on its own thread; the only waits here are for a batch
and for the weight push (DESIGN.md "Data flow").

One step, in named phases:
  wait_batch   take B groups (oldest first) from the replay queue; the wait is trainer idle time;
  train        `learner.train_step(groups)`: prox logprobs, advantages, PPO update(s); version+1;
  sync         push the new weights to the engine(s), then `staleness.set_version`;
  checkpoint   params + optimizer, version, data cursor, staleness counters, the journals of
               the episodes in flight and the ids of the groups trained but not committed;
               Orbax writes it in the background while the next steps run, and the ids are
               committed to the replay queue once that save has finished (so a crash either
               retrains them with the old weights or never sees them again);
  log          reward, accuracy, turns, tokens, tool calls, staleness (from token versions),
               idle fraction, engine occupancy, tokens/s, losses, clip/importance stats.

Resume (`restore`): the latest checkpoint in the run directory restores the learner and its
version; groups trained-but-uncommitted at the crash are committed now (the checkpoint has
their updates); the staleness counters restart at accepted = v * B + queued groups; the groups
that were in flight at the checkpoint resume from their journals (`rl.inflight`: finished calls
and tool results are replayed, partial generations continue) unless their result already sits in
the replay log; the cursor skips items whose groups survived there; the engine gets the restored
weights.
Synchronous RL is the same loop with eta = 0.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from asearcher_jax.checkpoint import Checkpointer, abstract_like
from asearcher_jax.metric_writer import MetricWriter
from asearcher_jax.rl.learner import Learner
from asearcher_jax.rl.replay import Group, ReplayQueue
from asearcher_jax.rl.rollout import RolloutController
from asearcher_jax.rl.staleness import StalenessManager
from asearcher_jax.rl.weight_sync import WeightSync

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig:
  """Attributes:
  train_steps: stop once the learner's version reaches this (a resumed run counts on).
  batch_groups: B, groups per step; must equal the staleness manager's B.
  batch_timeout_s: longest wait for one batch; past it the run fails loudly (no silent hang).
  poll_s: the batch wait is split into slices of this length so a dead rollout loop is noticed.
  checkpoint_every: checkpoint every this many steps (and always at the last one); 0 = never
    (then groups are committed right after their step: a crash loses nothing but retrains
    nothing either, as there is no checkpoint to return to).
  blocking_checkpoints: wait for each checkpoint to be written before the next step (the old
    behaviour, for side-by-side measurements); False: the next step runs while Orbax writes and
    only the replay commit waits for the save.
  """

  train_steps: int
  batch_groups: int
  batch_timeout_s: float = 3600.0
  poll_s: float = 1.0
  checkpoint_every: int = 1
  blocking_checkpoints: bool = False

  def __post_init__(self):
    if self.train_steps < 0 or self.batch_groups < 1:
      raise ValueError("train_steps must be >= 0 and batch_groups >= 1")
    if self.batch_timeout_s <= 0 or self.poll_s <= 0:
      raise ValueError("batch_timeout_s and poll_s must be > 0")
    if self.checkpoint_every < 0:
      raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")


class Trainer:
  """Owns no thread: `run()` is called on the main thread while the rollout loop runs."""

  def __init__(
    self,
    *,
    config: TrainerConfig,
    learner: Learner,
    replay: ReplayQueue,
    staleness: StalenessManager,
    weight_sync: WeightSync,
    rollout: RolloutController | None = None,
    checkpointer: Checkpointer | None = None,
    writer: MetricWriter | None = None,
    engine_stats: Callable[[], Mapping[str, float]] | None = None,
  ) -> None:
    if config.batch_groups != staleness.config.batch_groups:
      raise ValueError(
        f"trainer batch_groups={config.batch_groups} != staleness B="
        f"{staleness.config.batch_groups}: admission and consumption would drift apart"
      )
    self.config = config
    self.learner = learner
    self.replay = replay
    self.staleness = staleness
    self.weight_sync = weight_sync
    self.rollout = rollout
    self.checkpointer = checkpointer
    self.writer = writer or MetricWriter(None)
    self.engine_stats = engine_stats
    self._uncommitted: list[str] = []  # trained since the last checkpoint
    self._saving: list[str] = []  # trained and in the checkpoint Orbax is still writing
    self.trained_ids: list[list[str]] = []  # per step of this process (tests, summaries)
    self.history: list[dict[str, float]] = []
    self._idle_s = 0.0
    self._busy_s = 0.0
    self._t_start = time.perf_counter()
    self._tokens_before = 0.0

  # --- resume ----------------------------------------------------------------------------------

  def restore(self) -> int | None:
    """Resumes from the latest checkpoint, if any; returns its version. Call before starting
    the rollout controller (its cursor and the staleness counters are part of the state)."""
    step = self.checkpointer.latest_step() if self.checkpointer is not None else None
    if step is None:  # fresh, or killed before the first checkpoint: keep what was queued
      self.staleness.restore(version=self.learner.version, queued=len(self.replay))
      if self.rollout is not None:
        self.rollout.load_state_dict(None, queued_ids=self.replay.pending_ids())
      return None
    # An unreadable newest checkpoint falls back to the one before, loudly (log + metric).
    _, items = self.checkpointer.restore_latest(
      {"train_state": abstract_like(self.learner.state), "meta": None}
    )
    meta = items["meta"]
    version = int(meta["version"])
    self.learner.restore(items["train_state"], version)
    self._finish_commit(meta["uncommitted"])
    self.staleness.restore(version=version, queued=len(self.replay) + self.replay.num_leased)
    if self.rollout is not None and meta.get("rollout") is not None:
      self.rollout.load_state_dict(meta["rollout"], queued_ids=self.replay.pending_ids())
    self.weight_sync.publish(self.learner)  # the engine samples the restored policy
    log.info("resumed at version %d (%d groups queued)", version, len(self.replay))
    return version

  def _finish_commit(self, ids: Sequence[str]) -> None:
    """Commits groups the checkpoint already trained on but the crash left uncommitted."""
    pending = self.replay.pending_ids()
    done = sorted(set(ids) & set(pending))
    if not done:
      return
    leased = self.replay.take(len(pending), timeout=0.0)
    self.replay.commit(done)
    self.replay.release([g.group_id for g in leased if g.group_id not in set(done)])
    self.replay.metrics(reset=True)  # that take was bookkeeping, not training
    log.info("committed %d groups trained before the crash", len(done))

  # --- the loop --------------------------------------------------------------------------------

  def run(
    self,
    *,
    max_seconds: float | None = None,
    on_step: Callable[[dict[str, float]], None] | None = None,
  ) -> dict[str, float]:
    """Trains until `train_steps` (or, when given, until a step ends past `max_seconds`, for
    fixed-time runs like the quickstart); returns the last step's metrics. `on_step` sees each
    step's metrics (progress displays)."""
    last: dict[str, float] = {}
    self._t_start = time.perf_counter()
    if self.engine_stats is not None:
      self._tokens_before = float(self.engine_stats().get("tokens_generated", 0.0))
    while self.learner.version < self.config.train_steps:
      last = self.step()
      if on_step is not None:
        on_step(last)
      if max_seconds is not None and time.perf_counter() - self._t_start >= max_seconds:
        log.info("time budget of %.0f s reached at version %d", max_seconds, self.learner.version)
        if self.checkpointer is not None and self.config.checkpoint_every:
          self._final_checkpoint()
        break
    self._commit_saved(wait=True)
    self.writer.flush()
    return last

  def _final_checkpoint(self) -> None:
    """A checkpoint of the last step when the time budget ends the run between checkpoints."""
    if self.checkpointer.latest_step() != self.learner.version:
      saved = self.config.train_steps
      try:
        self.config = dataclasses.replace(self.config, train_steps=self.learner.version)
        self._checkpoint()
      finally:
        self.config = dataclasses.replace(self.config, train_steps=saved)

  def step(self) -> dict[str, float]:
    t0 = time.perf_counter()
    self._commit_saved(wait=False)
    groups, wait_s = self._wait_batch()
    t1 = time.perf_counter()
    version_before = self.learner.version
    metrics = self._train(groups)
    t2 = time.perf_counter()
    metrics.update(self._sync())
    t3 = time.perf_counter()
    metrics.update(self._checkpoint())
    t4 = time.perf_counter()
    self._idle_s += wait_s
    self._busy_s += t4 - t1
    metrics.update(self._staleness_metrics(groups, version_before))
    metrics.update({
      "timing/wait_batch_s": wait_s, "timing/train_s": t2 - t1, "timing/sync_s": t3 - t2,
      "timing/checkpoint_s": t4 - t3, "timing/step_s": t4 - t0,
      "perf/trainer_idle_frac": wait_s / max(t4 - t0, 1e-9),
      "perf/trainer_idle_frac_cum": self._idle_s / max(self._idle_s + self._busy_s, 1e-9),
      "perf/trained_tokens_per_s": metrics.get("ppo/tokens", 0.0) / max(t4 - t0, 1e-9),
    })  # fmt: skip
    self._log(metrics)
    return metrics

  def _wait_batch(self) -> tuple[list[Group], float]:
    """B oldest groups; polls in slices so a crashed rollout loop fails the run instead of
    hanging it."""
    t0 = time.perf_counter()
    deadline = t0 + self.config.batch_timeout_s
    while True:
      groups = self.replay.take(
        self.config.batch_groups,
        timeout=min(self.config.poll_s, max(deadline - time.perf_counter(), 0.0)),
        current_version=self.learner.version,
      )
      if groups:
        return groups, time.perf_counter() - t0
      if self.rollout is not None and self.rollout.error is not None:
        raise RuntimeError("the rollout loop died") from self.rollout.error
      if time.perf_counter() >= deadline:
        raise TimeoutError(
          f"no batch of {self.config.batch_groups} groups within "
          f"{self.config.batch_timeout_s:g} s (staleness {self.staleness.stats()})"
        )

  def _train(self, groups: Sequence[Group]) -> dict[str, float]:
    ids = [g.group_id for g in groups]
    try:
      metrics = self.learner.train_step(groups)
    except Exception:
      self.replay.release(ids)  # nothing was learned from them: they stay queued
      raise
    self._uncommitted += ids
    self.trained_ids.append(ids)
    return metrics

  def _sync(self) -> dict[str, float]:
    return self.weight_sync.publish(self.learner)

  def _checkpoint(self) -> dict[str, float]:
    every, version = self.config.checkpoint_every, self.learner.version
    if self.checkpointer is None or every == 0:
      self._commit_now()
      return {}
    if version % every and version < self.config.train_steps:
      return {}
    # Orbax finishes the previous save before it starts this one; its groups commit first.
    t0 = time.perf_counter()
    self._commit_saved(wait=True)
    meta = {
      "version": version,
      "uncommitted": list(self._uncommitted),
      "staleness": self.staleness.state_dict(),
      "rollout": self._rollout_state(),
    }
    self.checkpointer.save(version, {"train_state": self.learner.state, "meta": meta}, force=True)
    self._saving, self._uncommitted = self._uncommitted, []
    if self.config.blocking_checkpoints:
      self._commit_saved(wait=True)
    return {"checkpoint/version": float(version), "timing/checkpoint_s": time.perf_counter() - t0}

  def _rollout_state(self) -> dict[str, Any] | None:
    """Cursor + in-flight journals, minus groups this process already trained (a pushed group
    can be trained before the rollout loop drops its journal)."""
    if self.rollout is None:
      return None
    return self.rollout.state_dict(exclude_groups=[i for ids in self.trained_ids for i in ids])

  def _commit_now(self) -> None:
    """No checkpoints: groups commit right after their step."""
    if self._uncommitted:
      self.replay.commit(self._uncommitted)
      self._uncommitted = []

  def _commit_saved(self, *, wait: bool) -> None:
    """Commits the groups of the checkpoint being written once it is on disk (waiting for it
    with `wait`, else only if it already is): the replay commit never outruns the checkpoint."""
    if not self._saving:
      return
    if wait:
      self.checkpointer.wait()
    elif self.checkpointer.saving():
      return
    self.replay.commit(self._saving)
    self._saving = []

  # --- metrics ---------------------------------------------------------------------------------

  def _staleness_metrics(self, groups: Sequence[Group], version: int) -> dict[str, float]:
    """Head staleness per trajectory (trained version - oldest token version) as a histogram,
    plus the per-token mean/max the learner already reports."""
    heads = [h for g in groups for h in g.head_versions() if h >= 0]
    if not heads:
      return {}
    lag = version - np.asarray(heads)
    out = {
      "staleness/head_max": float(lag.max()),
      "staleness/head_mean": float(lag.mean()),
      "staleness/version_now": float(self.staleness.version),
    }
    for k, n in zip(*np.unique(lag, return_counts=True)):
      out[f"staleness/hist_{int(k)}"] = float(n) / lag.size
    return out

  def _log(self, metrics: dict[str, Any]) -> None:
    if self.rollout is not None:
      metrics.update(self.rollout.metrics())
    metrics.update(self.replay.metrics())
    metrics.update({f"staleness/{k}": float(v) for k, v in self.staleness.stats().items()})
    if self.checkpointer is not None:
      metrics["checkpoint/restore_fallbacks"] = float(len(self.checkpointer.fallbacks))
    if metrics.get("rollout/group_s") and "timing/train_s" in metrics:
      # The staleness rule keeps at most (eta + 1) x B groups in flight, so it can deliver B
      # groups per step only while a group takes under ~(eta + 1) steps (Little's law); near or
      # below 1 the trainer waits whatever the engine's speed: raise eta or shorten episodes.
      eta = self.staleness.config.max_staleness
      metrics["perf/staleness_capacity_ratio"] = (
        (eta + 1) * metrics["timing/train_s"] / metrics["rollout/group_s"]
      )
    if self.engine_stats is not None:
      s = self.engine_stats()
      tokens = float(s.get("tokens_generated", 0.0))
      wall = max(time.perf_counter() - self._t_start, 1e-9)
      metrics["perf/generated_tokens_per_s"] = (tokens - self._tokens_before) / wall
      metrics["engine/weight_updates_ms"] = float(s.get("last_update_ms", 0.0))
      metrics["engine/requests_aborted"] = float(s.get("requests_aborted", 0.0))
      metrics["engine/decode_tokens_per_s"] = float(s.get("decode_tokens_per_s", 0.0))
      # Engine-thread seconds so far: admissions' prefills, weight updates (with their
      # re-prefills under kv_on_update="recompute"), decode steps.
      for k in ("prefill_s", "update_s", "decode_s", "reprefill_tokens", "prefill_tokens"):
        metrics[f"engine/{k}"] = float(s.get(k, 0.0))
    metrics = {k: float(v) for k, v in metrics.items()}
    self.history.append(metrics)
    self.writer.write(self.learner.version, metrics)
    log.info(
      "step %d: loss %.4f reward %.3f idle %.2f staleness max %s",
      self.learner.version,
      metrics.get("ppo/loss", float("nan")),
      metrics.get("rollout/reward", float("nan")),
      metrics["perf/trainer_idle_frac"],
      metrics.get("staleness/head_max"),
    )
