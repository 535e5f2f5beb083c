"""The training loop: a thin orchestrator over the replay queue, learner, weight sync and
checkpoints. The rollout controller runs on its own thread; the only waits here are for a batch
and for the weight push (DESIGN.md "Data flow").

One step, in named phases:
  wait_batch   take B groups (oldest first) from the replay queue; the wait is trainer idle time;
  train        `learner.train_step(groups)`: prox logprobs, advantages, PPO update(s); version+1
               (the one place the policy version advances);
  sync         push the new weights to the engine(s) (`WeightSync.publish`), then tell the
               staleness manager the new version (`staleness.set_version`, here and nowhere else,
               so the admission rule never runs ahead of the weights the samplers have);
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

Several processes (a multi-host learner, `asearcher_jax.distributed`): every process runs this
loop over its share of one global mesh; process 0, the lead, alone has the rollout controller,
the replay queue, the staleness manager, the weight sync and the metric files. Each step the
lead takes the batch and broadcasts its groups (`distributed.broadcast_bytes`, over the devices'
links); every process then packs the identical global batch and places only the rows its own
devices hold (`Learner.to_device`), so the packing, the advantages and the staleness metrics
are computed once per process from the same bytes and cannot drift. Waiting for a batch is a
poll: every `poll_s` the lead broadcasts "none yet", a batch, or a failure, so no process sits
in a collective for longer than a poll slice and a lead that fails takes the others down with a
clear error. Checkpoints are Orbax's multi-host saves (every process writes its own shards, the
lead the JSON items); replay commits, journals and published weights stay on the lead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import msgpack
import numpy as np

from asearcher_jax import distributed, metric_writer
from asearcher_jax.checkpoint import Checkpointer, abstract_like
from asearcher_jax.metric_writer import MetricWriter
from asearcher_jax.rl.learner import Learner
from asearcher_jax.rl.replay import Group, ReplayQueue, decode_group, encode_group
from asearcher_jax.rl.rollout import RolloutController
from asearcher_jax.rl.staleness import StalenessManager
from asearcher_jax.rl.weight_sync import WeightSync
from asearcher_jax.serving.driver import CUMULATIVE_STATS

log = logging.getLogger(__name__)

# What the lead broadcasts each poll slice while the others wait for a batch.
_NO_BATCH_YET = 0
_LEAD_FAILED = -1
# Steps of metrics `Trainer.history` keeps in memory (the metric writer has them all). Unbounded,
# its dict of ~120 floats (up to ~14 KB) a step was ~1.4 MB per 100 steps of the ~5 MB per 100
# steps a 1,000-step soak's RSS grew by (2026-11-25).
HISTORY_STEPS = 1000


def agreement_metrics(metrics: dict[str, float], tag: str) -> dict[str, float]:
  """The learner's `ppo/agree_*` statistics renamed `agreement/<tag>/*` (tag: the engine path
  and dtype). A step without a token sampled at the trained version keeps only the count: a
  zero mismatch over no tokens would read as perfect agreement."""
  out = {k: v for k, v in metrics.items() if not k.startswith("ppo/agree_")}
  tokens = metrics.get("ppo/agree_tokens")
  if tokens is None:
    return out
  for k, v in metrics.items():
    if k.startswith("ppo/agree_") and (tokens > 0 or k == "ppo/agree_tokens"):
      out[f"agreement/{tag}/{k.removeprefix('ppo/agree_')}"] = v
  return out


def step_line(version: int, metrics: dict[str, float]) -> str:
  """The one log line per step. A step in which no episode finished has no reward metric; the
  line says so rather than printing `nan`, which reads like a fault."""
  reward = metrics.get("rollout/reward")
  loss = metrics.get("ppo/loss")
  return (
    f"step {version}: loss {'-' if loss is None else f'{loss:.4f}'} "
    f"reward {'- (no episode finished)' if reward is None else f'{reward:.3f}'} "
    f"idle {metrics.get('perf/trainer_idle_frac', float('nan')):.2f} "
    f"staleness max {metrics.get('staleness/head_max')}"
  )


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
  gather_weights: with several processes, gather the parameters to host memory on every
    process and let process 0's weight sync publish them whole (a sync that needs whole
    tensors); False: every process calls its own weight sync (the sharded weight store,
    `serving.weights_dir`: each process writes the shards it holds, nothing is gathered).
  sampler_tag: the engine path and weight dtype that sampled the tokens (`sampler_tag`, e.g.
    "paged-gather.bf16"), naming the trainer-sampler agreement metrics
    `agreement/<tag>/{abs_mean,abs_max,kl_k3,out_frac,tokens}`, so runs over different paths
    compare side by side in TensorBoard.
  """

  train_steps: int
  batch_groups: int
  batch_timeout_s: float = 3600.0
  poll_s: float = 1.0
  checkpoint_every: int = 1
  blocking_checkpoints: bool = False
  gather_weights: bool = False
  sampler_tag: str = "engine"

  def __post_init__(self):
    if not self.sampler_tag or "/" in self.sampler_tag:
      raise ValueError(f"TrainerConfig.sampler_tag must be non-empty without '/', got "
                       f"{self.sampler_tag!r}")  # fmt: skip
    if self.train_steps < 0 or self.batch_groups < 1:
      raise ValueError("train_steps must be >= 0 and batch_groups >= 1")
    if self.batch_timeout_s <= 0 or self.poll_s <= 0:
      raise ValueError("batch_timeout_s and poll_s must be > 0")
    if self.checkpoint_every < 0:
      raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")


class HostPolicy:
  """A `PolicySource` over parameters already gathered to host memory: what a multi-process
  trainer hands the lead's weight sync (which writes whole tensors)."""

  def __init__(self, params: Any, version: int) -> None:
    self.params, self.version = params, version

  def params_copy(self) -> Any:
    return self.params


class Trainer:
  """Owns no thread: `run()` is called on the main thread while the rollout loop runs.

  On the lead process (the only one of a single-process run) `replay`, `staleness` and
  `weight_sync` are required; the other processes of a multi-process run pass None for them
  and for `rollout`, and follow the lead's batches."""

  def __init__(
    self,
    *,
    config: TrainerConfig,
    learner: Learner,
    replay: ReplayQueue | None,
    staleness: StalenessManager | None,
    weight_sync: WeightSync | None,
    rollout: RolloutController | None = None,
    checkpointer: Checkpointer | None = None,
    writer: MetricWriter | None = None,
    engine_stats: Callable[[], Mapping[str, float]] | None = None,
    learner_step: Callable[[], contextlib.AbstractContextManager] | None = None,
  ) -> None:
    self.lead = distributed.is_lead()
    self.multi = distributed.multi_process()
    if self.lead and None in (replay, staleness, weight_sync):
      raise ValueError("the lead trainer process needs a replay queue, staleness and weight sync")
    if self.multi and not config.gather_weights and weight_sync is None:
      raise ValueError(
        f"trainer process {jax.process_index()} has no weight sync: with gather_weights=False "
        "every process publishes the shards it holds"
      )
    if not self.lead and (replay is not None or rollout is not None):
      raise ValueError(
        f"trainer process {jax.process_index()} got a replay queue or rollout controller: "
        "only process 0 owns them (the others receive its batches)"
      )
    if staleness is not None and config.batch_groups != staleness.config.batch_groups:
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
    # Held around each learner step: an in-process engine on the same cores pauses meanwhile
    # (`Driver.learner_step`, DriverConfig.yield_to_learner); None: nothing to tell.
    self._learner_step = learner_step or contextlib.nullcontext
    self._uncommitted: list[str] = []  # trained since the last checkpoint
    self._saving: list[str] = []  # trained and in the checkpoint Orbax is still writing
    self.trained_ids: list[list[str]] = []  # per step of this process (tests, summaries)
    self.history: list[dict[str, float]] = []  # the last HISTORY_STEPS steps' metrics
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
      if self.replay is not None:
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
    if self.replay is not None:
      self._finish_commit(meta["uncommitted"])
      self.staleness.restore(version=version, queued=len(self.replay) + self.replay.num_leased)
    if self.rollout is not None and meta.get("rollout") is not None:
      self.rollout.load_state_dict(meta["rollout"], queued_ids=self.replay.pending_ids())
    self.publish()  # the engine samples the restored policy
    log.info("resumed at version %d", version)
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
      if max_seconds is not None and distributed.agree(
        time.perf_counter() - self._t_start >= max_seconds
      ):  # the lead's clock decides for every process
        log.info("time budget of %.0f s reached at version %d", max_seconds, self.learner.version)
        if self.checkpointer is not None and self.config.checkpoint_every:
          self._final_checkpoint()
        break
    self.flush_weights()
    self._commit_saved(wait=True)
    self.writer.flush()
    return last

  def flush_weights(self) -> None:
    """Waits for a weight sync that writes in the background (`WeightSyncConfig.background`)
    to commit the last version, so a finished run leaves its newest policy published."""
    if self.weight_sync is not None:
      self.weight_sync.flush()

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
    groups, wait_s = self._next_batch()
    t1 = time.perf_counter()
    version_before = self.learner.version
    metrics = agreement_metrics(self._train(groups), self.config.sampler_tag)
    t2 = time.perf_counter()
    metrics.update(self.publish())
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
      **metric_writer.host_memory(),
    })  # fmt: skip
    self._log(metrics)
    return metrics

  def _next_batch(self) -> tuple[list[Group], float]:
    """This step's groups: taken from the replay queue on one process; on several, taken by the
    lead and broadcast (see the module docstring)."""
    if not self.multi:
      return self._wait_batch()
    t0 = time.perf_counter()
    if not self.lead:
      while True:
        status = distributed.agree(_NO_BATCH_YET)
        if status == _LEAD_FAILED:
          raise RuntimeError("the lead trainer process failed to produce a batch (see its log)")
        if status > 0:
          payload = distributed.broadcast_bytes(None)
          return [decode_group(b) for b in msgpack.unpackb(payload)], time.perf_counter() - t0
    try:
      groups, _ = self._wait_batch(announce=True)
    except BaseException:
      distributed.agree(_LEAD_FAILED)
      raise
    distributed.agree(len(groups))
    distributed.broadcast_bytes(msgpack.packb([encode_group(g) for g in groups]))
    return groups, time.perf_counter() - t0

  def _wait_batch(self, *, announce: bool = False) -> tuple[list[Group], float]:
    """B oldest groups; polls in slices so a crashed rollout loop fails the run instead of
    hanging it. `announce`: tell the other processes after each empty slice that none came."""
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
      if announce:
        distributed.agree(_NO_BATCH_YET)
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
      with self._learner_step():
        metrics = self.learner.train_step(groups)
    except Exception:
      if self.replay is not None:
        self.replay.release(ids)  # nothing was learned from them: they stay queued
      raise
    self._uncommitted += ids
    self.trained_ids.append(ids)
    return metrics

  def publish(self) -> dict[str, float]:
    """Publishes the learner's version to the samplers, then tells the staleness manager (the
    lead's) that version; every process calls it. The sync returns once the samplers run the
    version or (a background write) once they will stamp tokens with what they run, so no
    group is admitted against weights no sampler has. Several processes: each process's weight
    sync writes its own shards, or with `gather_weights` the parameters are gathered to host
    memory (a collective) and the lead's sync writes them."""
    if not self.multi or not self.config.gather_weights:
      metrics = self.weight_sync.publish(self.learner)
    else:
      t0 = time.perf_counter()
      host = distributed.gather_to_host(self.learner.params_copy())
      metrics = {"weight_sync/gather_s": time.perf_counter() - t0}
      if not self.lead:
        return metrics
      metrics.update(self.weight_sync.publish(HostPolicy(host, self.learner.version)))
    if self.staleness is not None:
      self.staleness.set_version(self.learner.version)
    return metrics

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
    meta = {  # JSON items are written by the lead alone: its values are the ones kept
      "version": version,
      "uncommitted": list(self._uncommitted),
      "staleness": self.staleness.state_dict() if self.staleness is not None else None,
      "rollout": self._rollout_state(),
    }
    if self.replay is not None:  # after the rollout state: a group queued since is in both
      self.replay.sync()  # shipped logs (a bucket) hold every group the checkpoint counts queued
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
    if self._uncommitted and self.replay is not None:
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
    if self.replay is not None:
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
    }
    if self.staleness is not None:
      out["staleness/version_now"] = float(self.staleness.version)
    for k, n in zip(*np.unique(lag, return_counts=True)):
      out[f"staleness/hist_{int(k)}"] = float(n) / lag.size
    return out

  def _log(self, metrics: dict[str, Any]) -> None:
    if self.rollout is not None:
      metrics.update(self.rollout.metrics())
    if self.replay is not None:
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
      for k in CUMULATIVE_STATS:  # engine-thread seconds, calls and tokens so far
        metrics[f"engine/{k}"] = float(s.get(k, 0.0))
    metrics = {k: float(v) for k, v in metrics.items()}
    self.history.append(metrics)
    del self.history[:-HISTORY_STEPS]
    self.writer.write(self.learner.version, metrics)
    log.info("%s", step_line(self.learner.version, metrics))
