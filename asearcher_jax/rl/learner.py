"""The PPO learner: groups from the replay queue in, one policy version out.

One training step, in named phases:
  prepare                  host: advantages (transform, group norm, global token norm), split
                           into `ppo_n_minibatches` minibatches of whole groups, pack each into a
                           static bucket shape with every group on one data shard;
  compute_prox_logprobs    device: logprobs of every minibatch under the pre-step weights (one
                           jitted scoring pass; skipped when recompute is off);
  update                   device: one jitted, donated optimizer step per minibatch, for
                           `ppo_epochs` passes over the batch.
The loss and the step are pure module-level functions; this class only holds the train state,
the compiled functions and the policy version.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from asearcher_jax.model import packing, steps
from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.rl import advantages as adv_lib
from asearcher_jax.rl import losses
from asearcher_jax.rl.replay import Group

# Arrays of a device minibatch; every minibatch has exactly these keys so jit never retraces on
# structure, only (rarely) on the bucket shape.
DEVICE_KEYS = (
  "tokens", "positions", "segment_ids", "loss_mask", "logprobs", "advantages", "prox_logprobs",
  "fresh_mask",
)  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOConfig:
  """Attributes:
  eps_clip: PPO clip, u in [1 - eps_clip, 1 + eps_clip] (AReaL recipes use 0.4).
  eps_clip_high: upper clip 1 + eps_clip_high (DAPO clip-higher); None = eps_clip.
  dual_clip: c > 1 bounds negative-advantage token losses by c * |A|; None disables.
  off_policy: the correction by pi_prox / pi_behav (`losses.OffPolicyConfig`): decoupled PPO
    with a mask at 5 (AReaL's), truncated / masked importance sampling per token or sequence,
    IcePop; every kind but "none" (standard PPO around pi_old) needs recompute_prox.
  recompute_prox: recompute logprobs with the pre-step weights (one extra forward per step);
    False uses the sampler's behaviour logprobs as pi_old (synchronous baseline, no forward).
  fused_prox: with one minibatch per step, take pi_prox from the optimizer step's own forward
    instead of a separate scoring pass (see `prox_in_step`); False keeps the separate pass.
  reward_bias: r -> (r + bias) * scale, before clipping.
  reward_scale: see reward_bias (ASearcher: bias -0.5, scale 10 gives +-5 for {0, 1} rewards).
  reward_clip: clip the transformed reward to +-reward_clip.
  group_norm: normalise the transformed rewards within each group (centre, and divide by the
    group std when group_norm_std).
  group_norm_std: divide by the group std in group_norm (False = Dr.GRPO, centre only).
  global_norm: normalise advantages over all loss tokens of the step (mean/std, float64).
  norm_eps: added to every std before dividing.
  ppo_n_minibatches: optimizer steps per pass over the batch; the batch is split into this
    many token-balanced minibatches of whole groups (of sequences if there are fewer groups).
  ppo_epochs: passes over the batch per training step (verl's ppo_epochs), each one optimizer
    step per minibatch, all clipped around the same pre-step pi_prox; > 1 reuses each sample
    for more updates, which is nearly free while the learner waits for generation.
  temperature: logprob temperature; must equal the sampler's (`transformer.token_logprobs`).
  row_len: tokens per packed row; the longest training sequence must fit.
  short_row_lens: shorter row lengths a minibatch may pack into instead: the smallest one that
    holds its longest sequence. Attention cost per token grows with the row length, and agent
    sequences are mostly far shorter than the context (quickstart: median 449 tokens, 99 % at
    most 1,024): 1,024-token rows train the same tokens 1.64x faster than 2,048-token ones on
    CPU. Each length is one more compiled shape per row bucket. () = row_len only.
  row_buckets: allowed total row counts of a packed minibatch (multiples of the data shard
    count); None = a power of two rows per shard.
  micro_rows: rows per data shard (data x fsdp devices) per forward/backward pass, so a
    micro-batch is micro_rows x shards rows; a minibatch with more rows accumulates exact
    gradients over micro-batches (`steps.train_step`), bounding the step's memory (XLA:CPU:
    ~630 MB of temporaries per 2,048-token row). 1 = one row per chip at a time over an fsdp
    mesh (counted in total, one row would leave all but one chip without a row, or be split
    over them). Rows per shard above it must be multiples of it (power-of-two buckets and
    micro_rows are). None = the whole minibatch.
  """

  eps_clip: float = 0.2
  eps_clip_high: float | None = None
  dual_clip: float | None = None
  off_policy: losses.OffPolicyConfig = dataclasses.field(default_factory=losses.OffPolicyConfig)
  recompute_prox: bool = True
  fused_prox: bool = True
  reward_bias: float = 0.0
  reward_scale: float = 1.0
  reward_clip: float = 20.0
  group_norm: bool = False
  group_norm_std: bool = True
  global_norm: bool = True
  norm_eps: float = 1e-5
  ppo_n_minibatches: int = 1
  ppo_epochs: int = 1
  temperature: float = 1.0
  row_len: int = 4096
  short_row_lens: tuple[int, ...] = ()
  row_buckets: tuple[int, ...] | None = None
  micro_rows: int | None = None

  def __post_init__(self):
    if not 0 < self.eps_clip < 1:
      raise ValueError(f"eps_clip must be in (0, 1), got {self.eps_clip}")
    if self.eps_clip_high is not None and self.eps_clip_high <= 0:
      raise ValueError(f"eps_clip_high must be > 0, got {self.eps_clip_high}")
    if self.dual_clip is not None and self.dual_clip <= 1:
      raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
    if self.off_policy.kind != "none" and not self.recompute_prox:
      raise ValueError(
        f"off_policy kind {self.off_policy.kind!r} needs recompute_prox=True (pi_prox is a "
        "forward pass); kind 'none' is standard PPO"
      )
    if self.reward_clip <= 0 or self.reward_scale == 0:
      raise ValueError("reward_clip must be > 0 and reward_scale non-zero")
    if self.ppo_n_minibatches < 1:
      raise ValueError(f"ppo_n_minibatches must be >= 1, got {self.ppo_n_minibatches}")
    if self.ppo_epochs < 1:
      raise ValueError(f"ppo_epochs must be >= 1, got {self.ppo_epochs}")
    if self.temperature <= 0:
      raise ValueError(f"temperature must be > 0, got {self.temperature}")
    if self.row_len < 2:
      raise ValueError(f"row_len must be >= 2, got {self.row_len}")
    if any(not 2 <= n < self.row_len for n in self.short_row_lens):
      raise ValueError(f"short_row_lens {self.short_row_lens} must be in [2, row_len)")
    if self.micro_rows is not None and self.micro_rows < 1:
      raise ValueError(f"micro_rows must be >= 1 or None, got {self.micro_rows}")
    if (
      self.micro_rows is not None
      and self.row_buckets is None
      and self.micro_rows & (self.micro_rows - 1)
    ):
      raise ValueError(
        f"micro_rows={self.micro_rows} must be a power of two with row_buckets=None (a power of "
        "two rows per shard)"
      )

  @property
  def prox_in_step(self) -> bool:
    """With one optimizer step per training step the proximal policy *is* the policy the step
    starts from, so pi_prox is the step's own forward pass (stop-gradient) rather than a second
    scoring pass: the same objective, one forward fewer (-23 % learner step time,
    benchmarks/learner_rows.py). Micro-batches accumulate gradients at the same pre-step
    weights, so it stays exact with them."""
    return (
      self.fused_prox and self.recompute_prox and self.ppo_n_minibatches == self.ppo_epochs == 1
    )

  def micro_batch_rows(self, num_shards: int) -> int | None:
    """Rows of one micro-batch over `num_shards` data shards (`micro_rows` per shard); raises
    when a row bucket does not split into such micro-batches (the bucket's rows per shard must
    be a multiple of micro_rows, or at most micro_rows)."""
    if self.micro_rows is None:
      return None
    rows = self.micro_rows * num_shards
    bad = [r for r in self.row_buckets or () if r > rows and r % rows]
    if bad:
      raise ValueError(
        f"micro_rows={self.micro_rows} per shard x {num_shards} shards = {rows} rows does not "
        f"divide row_buckets {bad}"
      )
    return rows

  def row_len_for(self, longest: int) -> int:
    """The packed row length of a minibatch whose longest sequence has `longest` tokens."""
    return min((n for n in self.short_row_lens if n >= longest), default=self.row_len)


def ppo_objective(
  cfg: PPOConfig, graphdef: nnx.GraphDef, params: nnx.State, batch: steps.Batch
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """steps.LossFn for PPO: current logprobs at the sampler's temperature, then `ppo_loss`;
  metrics add `entropy`, the mean over loss tokens of the sampling distribution's entropy (from
  the same forward: a policy collapsing onto few tokens shows here before in the reward), and,
  with recomputed pi_prox, the trainer-sampler agreement (`losses.agreement_stats`) over the
  tokens sampled at the weights being trained (`fresh_mask`): pi_prox is those weights' own
  logprobs, so the agreement costs no forward pass."""
  logp, entropy = steps.score_batch_and_entropy(graphdef, params, batch, cfg.temperature)
  prox = jax.lax.stop_gradient(logp) if cfg.prox_in_step else batch["prox_logprobs"]
  loss, stats = losses.ppo_loss(
    logp,
    prox,
    batch["logprobs"],
    batch["advantages"],
    batch["loss_mask"],
    eps_clip=cfg.eps_clip,
    eps_clip_high=cfg.eps_clip_high,
    off_policy=cfg.off_policy,
    dual_clip=cfg.dual_clip,
    segment_ids=batch["segment_ids"],
  )
  mask = batch["loss_mask"] > 0
  n = jnp.maximum(mask.sum().astype(jnp.float32), 1.0)
  stats = {**stats, "entropy": jnp.where(mask, entropy, 0.0).sum() / n}
  if cfg.recompute_prox:
    fresh = mask & (batch["fresh_mask"] > 0)
    stats.update(losses.agreement_stats(prox, batch["logprobs"], jax.lax.stop_gradient(fresh)))
  return loss, stats


def num_shards(mesh: Mesh | None) -> int:
  """Data shards of the learner's rows: data x fsdp devices (1 without a mesh)."""
  return 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]


def compile_steps(
  graphdef: nnx.GraphDef,
  state: steps.TrainState,
  *,
  ppo: PPOConfig,
  optimizer: optax.GradientTransformation,
  mesh: Mesh | None = None,
  rules: Mapping = sharding_lib.DEFAULT_RULES,
) -> tuple[Callable, Callable]:
  """The learner's jitted optimizer step (PPO objective, micro-batches of `ppo.micro_rows` per
  shard) and its proximal log-prob pass, for a concrete or an abstract `state`
  (`steps.abstract_train_state`): the Learner runs them, rl/aot.py compiles them for a slice
  that is not there, so what is compiled ahead of time is what trains."""
  train = steps.compile_train_step(
    graphdef, optimizer, functools.partial(ppo_objective, ppo), state, mesh=mesh, rules=rules,
    micro_rows=ppo.micro_batch_rows(num_shards(mesh)),
  )  # fmt: skip
  score = steps.compile_score_step(graphdef, state.params, mesh=mesh, rules=rules)
  return train, score


@dataclasses.dataclass(kw_only=True)
class Minibatch:
  """One packed minibatch: `arrays` (host numpy, DEVICE_KEYS but prox_logprobs + versions) and
  `device` (the jax arrays the jitted step takes, filled by `to_device` / prox)."""

  arrays: dict[str, np.ndarray]
  num_sequences: int
  device: dict[str, jax.Array] | None = None


class Learner:
  """Holds the TrainState (donated each optimizer step) and the policy version.

  `version` counts completed training steps: weights after step k are version k + 1. Weight sync
  reads `params` (copy it with `params_copy()` if the consumer keeps it past the next step: the
  state is donated) and publishes `version`; checkpointing saves `state` and `version` and
  restores with `restore(state, version)`.
  """

  def __init__(
    self,
    graphdef: nnx.GraphDef,
    params: nnx.State,
    *,
    ppo: PPOConfig,
    optimizer: steps.OptimizerConfig,
    precision: steps.PrecisionConfig = steps.PrecisionConfig(),
    mesh: Mesh | None = None,
    rules: Mapping = sharding_lib.DEFAULT_RULES,
    version: int = 0,
  ) -> None:
    self.ppo = ppo
    self.mesh = mesh
    self.version = version
    self._optimizer = steps.make_optimizer(optimizer)
    # The engine gets each parameter back in the dtype it was loaded in (bf16 weights to serve).
    self._serve_dtypes = jax.tree.map(lambda x: x.dtype, params)
    params = steps.cast_floating(params, precision.master_dtype)
    if mesh is None and jax.process_count() > 1:
      raise ValueError("a multi-process learner needs a mesh over every process's devices")
    if mesh is not None:
      # The same values on every process (one init seed, one checkpoint); each process places
      # only the shards its devices hold.
      params = sharding_lib.put(params, sharding_lib.param_shardings(params, mesh, rules))
    # Trained (and checkpointed) in the stacked form under scan_layers; `params` and
    # `params_copy` hand out one module per layer, as the engine and the weights store read.
    graphdef, params = steps.train_form(graphdef, params, mesh=mesh, rules=rules)
    self._graphdef = graphdef
    self.state = steps.init_train_state(params, self._optimizer)
    self.num_shards = num_shards(mesh)
    self._batch_sharding = None
    if mesh is not None:
      self._batch_sharding = sharding_lib.batch_sharding(mesh, rules=rules)
    self._train, self._score = compile_steps(
      graphdef, self.state, ppo=ppo, optimizer=self._optimizer, mesh=mesh, rules=rules
    )

  # --- state ----------------------------------------------------------------------------------

  @property
  def params(self) -> nnx.State:
    """The master parameters, one module per layer (a new copy when trained stacked)."""
    return steps.list_form(self._graphdef, self.state.params)

  def params_copy(self) -> nnx.State:
    """A copy for the engine, in the dtypes the policy was loaded in, that survives the next
    (donating) optimizer step."""
    fresh = steps.is_stacked(self.state.params)  # list_form already made new buffers
    return jax.tree.map(
      lambda x, d: x.astype(d) if x.dtype != d else (x if fresh else jnp.copy(x)), self.params,
      self._serve_dtypes,
    )  # fmt: skip

  def restore(self, state: steps.TrainState, version: int) -> None:
    self.state = state
    self.version = version

  def compiled_shapes(self) -> int:
    """Distinct compilations of the train step so far (a handful = buckets work)."""
    return self._train._cache_size()

  # --- phases ---------------------------------------------------------------------------------

  def train_step(self, groups: Sequence[Group]) -> dict[str, float]:
    """prepare -> prox logprobs -> update; bumps `version`; returns flat metrics."""
    t0 = time.perf_counter()
    minibatches = self.prepare(groups)
    t1 = time.perf_counter()
    for mb in minibatches:
      self.to_device(mb)
      # prox_in_step: the loss takes pi_prox from its own forward; this key is then unused.
      separate = self.ppo.recompute_prox and not self.ppo.prox_in_step
      mb.device["prox_logprobs"] = (
        self.compute_prox_logprobs(mb.device) if separate else mb.device["logprobs"]
      )
    metrics = self.update(minibatches)  # blocks on the last step's metrics
    t2 = time.perf_counter()
    metrics.update(self._staleness_metrics(minibatches))
    metrics["timing/prepare_s"] = t1 - t0
    metrics["timing/device_s"] = t2 - t1
    self.version += 1
    metrics["ppo/version"] = float(self.version)
    return metrics

  def compute_advantages(self, groups: Sequence[Group]) -> list[np.ndarray]:
    """Per group, per trajectory: its group-centred advantage transformed (bias, scale, clip)
    and optionally group-normalised."""
    c = self.ppo
    out = []
    for g in groups:
      r = adv_lib.transform_rewards(
        g.advantages, bias=c.reward_bias, scale=c.reward_scale, clip=c.reward_clip
      )
      if c.group_norm:
        r = adv_lib.group_normalize(r, np.zeros(len(r)), std=c.group_norm_std, eps=c.norm_eps)
      out.append(r)
    return out

  def prepare(self, groups: Sequence[Group]) -> list[Minibatch]:
    """Host side of a step: per-token advantages, minibatch split, bucketed packing."""
    if not groups:
      raise ValueError("train_step needs at least one group")
    values = self.compute_advantages(groups)
    seqs: list[dict[str, np.ndarray]] = []
    group_of: list[int] = []
    for gi, g in enumerate(groups):
      for ti, traj in enumerate(g.trajectories):
        for s in traj:
          mask = np.asarray(s["loss_mask"], np.int32).copy()
          mask[:1] = 0  # nothing predicts a sequence's first token: no logprob, no loss
          seqs.append({
            "tokens": np.asarray(s["tokens"], np.int32),
            "loss_mask": mask,
            "logprobs": np.asarray(s["logprobs"], np.float32),
            "versions": np.asarray(s["versions"], np.int32),
            "advantages": adv_lib.broadcast_to_tokens(values[gi][ti], mask),
          })  # fmt: skip
          group_of.append(gi)
    if self.ppo.global_norm:
      normed = adv_lib.normalize_tokens(
        [s["advantages"] for s in seqs], [s["loss_mask"] for s in seqs], eps=self.ppo.norm_eps
      )
      for s, a in zip(seqs, normed):
        s["advantages"] = a
    return [self._pack(seqs, group_of, idx) for idx in self._split(seqs, group_of)]

  def _split(self, seqs: Sequence[Mapping], group_of: Sequence[int]) -> list[list[int]]:
    """Sequence indices per minibatch: whole groups, token-balanced; single sequences when there
    are fewer groups than minibatches."""
    n = self.ppo.ppo_n_minibatches
    lengths = [len(s["tokens"]) for s in seqs]
    n_groups = max(group_of) + 1
    if n_groups >= n:
      weights = [0] * n_groups
      for i, g in enumerate(group_of):
        weights[g] += lengths[i]
      parts = [set(p) for p in packing.balanced_partition(weights, n)]
      return [[i for i, g in enumerate(group_of) if g in p] for p in parts]
    if len(seqs) < n:
      raise ValueError(f"{len(seqs)} sequences cannot fill {n} minibatches")
    return packing.balanced_partition(lengths, n)

  def _pack(self, seqs, group_of, idx: Sequence[int]) -> Minibatch:
    longest = max((len(seqs[i]["tokens"]) for i in idx), default=1)
    arrays, _ = packing.pack_groups(
      [seqs[i] for i in idx],
      [group_of[i] for i in idx],
      self.ppo.row_len_for(longest),
      num_shards=self.num_shards,
      row_buckets=self.ppo.row_buckets,
    )
    return Minibatch(arrays=arrays, num_sequences=len(idx))

  def to_device(self, mb: Minibatch) -> None:
    host = {k: mb.arrays[k] for k in DEVICE_KEYS if k not in ("prox_logprobs", "fresh_mask")}
    host["loss_mask"] = host["loss_mask"].astype(np.float32)
    # Tokens the sampler drew with the weights this step trains (pi_prox's): the agreement set.
    host["fresh_mask"] = (
      (mb.arrays["loss_mask"] > 0) & (mb.arrays["versions"] == self.version)
    ).astype(np.float32)
    # Every process packed the same global batch; each takes only the rows its devices hold.
    mb.device = (
      sharding_lib.put(host, self._batch_sharding)
      if self._batch_sharding is not None
      else jax.device_put(host)
    )

  def compute_prox_logprobs(self, batch: Mapping[str, jax.Array]) -> jax.Array:
    """Logprobs [rows, row_len] under the current (pre-step) weights, at the sampler's
    temperature; must run for every minibatch before the step's first update."""
    inputs = {k: batch[k] for k in ("tokens", "positions", "segment_ids")}
    return self._score(self.state.params, inputs, self.ppo.temperature)

  def update(self, minibatches: Sequence[Minibatch]) -> dict[str, float]:
    """One optimizer step per minibatch, `ppo_epochs` times over; metrics averaged over the
    steps (max for imp_weight_max; loss_tokens of one pass), and those of the last pass alone
    as ppo/last_epoch/* when there are several (clip_frac and approx_kl show how far it went)."""
    for mb in minibatches:
      if mb.device is None or "prox_logprobs" not in mb.device:
        raise ValueError("minibatch has no prox_logprobs: run compute_prox_logprobs first")
    per_step = []
    for _ in range(self.ppo.ppo_epochs):
      for mb in minibatches:
        self.state, m = self._train(self.state, {k: mb.device[k] for k in DEVICE_KEYS})
        per_step.append(m)
    per_step = jax.device_get(per_step)
    out = self._combine(per_step, passes=self.ppo.ppo_epochs)
    if self.ppo.ppo_epochs > 1:
      last = self._combine(per_step[-len(minibatches) :], passes=1)
      out.update({f"ppo/last_epoch/{k.removeprefix('ppo/')}": v for k, v in last.items()})
    out["ppo/optimizer_steps"] = float(len(per_step))
    rows = sum(mb.arrays["tokens"].shape[0] for mb in minibatches)
    cells = sum(mb.arrays["tokens"].size for mb in minibatches)
    real = sum(int((mb.arrays["segment_ids"] > 0).sum()) for mb in minibatches)
    out["ppo/minibatches"] = float(len(minibatches))
    out["ppo/rows"] = float(rows)
    out["ppo/tokens"] = float(real)
    out["ppo/padding_frac"] = 1.0 - real / max(cells, 1)
    out["ppo/sequences"] = float(sum(mb.num_sequences for mb in minibatches))
    return out

  @staticmethod
  def _combine(per_step: Sequence[Mapping[str, Any]], *, passes: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for k in per_step[0]:
      vals = [float(m[k]) for m in per_step]
      if k.endswith("_max"):
        out[f"ppo/{k}"] = max(vals)
      elif k.endswith("tokens"):
        out[f"ppo/{k}"] = sum(vals) / passes
      elif k.startswith("agree_"):  # over the agreement tokens, not the loss tokens
        n = [float(m["agree_tokens"]) for m in per_step]
        out[f"ppo/{k}"] = float(np.dot(vals, n) / max(sum(n), 1.0))
      else:
        out[f"ppo/{k}"] = float(np.mean(vals))
    return out

  def _staleness_metrics(self, minibatches: Sequence[Minibatch]) -> dict[str, Any]:
    """version - token version over generated tokens (the version being trained is self.version,
    the pre-step weights)."""
    vs = np.concatenate(
      [mb.arrays["versions"][(mb.arrays["loss_mask"] > 0) & (mb.arrays["versions"] >= 0)]
       for mb in minibatches]
    )  # fmt: skip
    if not vs.size:
      return {}
    lag = self.version - vs
    return {"staleness/token_mean": float(lag.mean()), "staleness/token_max": float(lag.max())}
