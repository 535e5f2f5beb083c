"""The decoupled PPO objective (AReaL, paper Eq. 4-5), the off-policy corrections the field
compares it with, and the trainer-sampler agreement statistics.

Three logprob streams per token: behaviour (the sampler's, stored with the token), proximal (the
learner's pre-step weights, recomputed once per step) and current (theta, being optimised):

  u = exp(logp_theta - logp_prox)                     trust-region ratio, clipped around prox
  w = stop_gradient(exp(logp_prox - logp_behav))      off-policy ratio, learner / sampler
  loss_t = c_t * max(-A * u, -A * clip(u, 1 - eps_low, 1 + eps_high))
  (dual clip, optional: loss_t = min(loss_t, c * |A|) before the c_t factor)

The correction c_t (and which tokens keep a loss) is `OffPolicyConfig.kind`, each a function of
w; the default "decoupled" is AReaL's: c_t = w, tokens with w > cap dropped from the numerator (a
hard mask, not a clip) but kept in the denominator. The loss is the token-level mean over all
loss tokens of the minibatch, whatever the correction masks. kind "none" is standard PPO (c_t = 1),
where the caller passes the behaviour logprobs (recompute off) or recomputed ones (recompute on)
as `prox_logp`. Unlike current AReaL, the weight is applied whenever the decoupled loss is on,
not only when a rejection-sampling block is configured.

w mixes two gaps: staleness (the sampler held older weights) and numerics (the sampler's kernels,
cache and dtype differ from the learner's at the same weights). `agreement_stats` isolates the
second one, over the tokens sampled at the learner's current version, where w would be exactly 1
with bit-identical numerics.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

KINDS = ("none", "decoupled", "tis_token", "tis_seq", "mis_token", "mis_seq", "icepop")

# A token whose learner/sampler ratio leaves [1/AGREE_RATIO, AGREE_RATIO] counts as an outlier in
# the agreement statistics (`agreement_stats`; the [0.5, 2] band tunix and AReaL report).
AGREE_RATIO = 2.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffPolicyConfig:
  """The off-policy correction c_t of the loss (module docstring), with w = pi_prox / pi_behav
  per token and, at sequence level, W = prod_t w over a sequence's loss tokens.

  kind:
    "decoupled" (AReaL 2.0 docs, decoupled PPO; paper Eq. 5): c_t = w, token dropped if w > cap.
    "tis_token" (truncated IS; Yao et al. 2025 "Your efficient RL framework secretly brings you
      off-policy RL training"; verl rollout_correction `rollout_is="token"`; tunix
      `sampler_is="token"`): c_t = min(w, cap), every token kept.
    "tis_seq" (verl rollout_correction `rollout_is="sequence"`): c_t = min(W, cap) on every token
      of the sequence.
    "mis_token" (masked IS; Liu et al. 2025 "When speed kills stability", verl rollout_rs="token",
      AReaL 2.0 rejection sampling token/mask): c_t = w if floor <= w <= cap, else the token is
      dropped.
    "mis_seq" (the same per sequence; AReaL 2.0 rejection sampling sequence/mask, verl
      rollout_rs="sequence" / "geometric"): the sequence statistic S = W (seq_stat "ratio") or
      exp(mean_t log w) (seq_stat "geo_mean", length-normalised); a sequence with S outside
      [floor, cap] is dropped whole; kept tokens get c_t = W ("ratio": sequence-level IS) or
      c_t = w ("geo_mean": a rejection filter over the token-level weights).
    "icepop" (IcePop, Ling team 2025 "Small leak can sink a great ship", Eq. 3: M(k) = k if
      alpha <= k <= beta else 0): c_t = w if floor <= w <= cap, else the token is dropped;
      two-sided by definition, so floor must be > 0 (the paper: alpha 0.5, beta 5).
    "none": c_t = 1 (standard PPO; the only kind allowed without recomputed pi_prox).
  Attributes:
    kind: one of KINDS above.
    cap: the upper bound on w (or W / S): the decoupled mask, the TIS truncation C, the MIS /
      IcePop upper bound beta; None = no upper bound.
    floor: the lower bound of the masking kinds (mis_*, icepop: alpha); 0 = one-sided.
    seq_stat: mis_seq's statistic, "ratio" (W) or "geo_mean" (exp of the mean log w).
  """

  kind: Literal["none", "decoupled", "tis_token", "tis_seq", "mis_token", "mis_seq", "icepop"] = (
    "decoupled"
  )
  cap: float | None = 5.0
  floor: float = 0.0
  seq_stat: Literal["ratio", "geo_mean"] = "ratio"

  def __post_init__(self) -> None:
    if self.kind not in KINDS:
      raise ValueError(f"OffPolicyConfig.kind must be one of {KINDS}, got {self.kind!r}")
    if self.cap is not None and self.cap <= 0:
      raise ValueError(f"OffPolicyConfig.cap must be > 0 or None, got {self.cap}")
    if self.floor < 0 or (self.cap is not None and self.floor >= self.cap):
      raise ValueError(f"OffPolicyConfig.floor must be in [0, cap), got {self.floor}")
    if self.kind == "icepop" and self.floor <= 0:
      raise ValueError("OffPolicyConfig(kind='icepop') masks two-sided: floor must be > 0 (0.5)")
    if self.seq_stat not in ("ratio", "geo_mean"):
      raise ValueError(f"OffPolicyConfig.seq_stat must be ratio or geo_mean, got {self.seq_stat!r}")

  @property
  def sequence_level(self) -> bool:
    return self.kind in ("tis_seq", "mis_seq")


def _sequence_sums(x: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
  """Per token, the sum of x over its sequence: a packed row holds several sequences, told apart
  by segment_ids (> 0); None = one sequence per row."""
  if segment_ids is None:
    return jnp.broadcast_to(x.sum(axis=-1, keepdims=True), x.shape)
  rows, width = x.shape
  ids = (jnp.arange(rows)[:, None] * width + segment_ids).reshape(-1)
  sums = jax.ops.segment_sum(x.reshape(-1), ids, num_segments=rows * width)
  return sums[ids].reshape(x.shape)


def correction(
  log_w: jax.Array, mask: jax.Array, cfg: OffPolicyConfig, segment_ids: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """(c, keep): the per-token factor and the tokens that keep a loss, from log w (0 off the
  mask) and the loss mask; see OffPolicyConfig for each kind's formula."""
  w = jnp.exp(log_w)
  hi = jnp.inf if cfg.cap is None else cfg.cap
  if cfg.kind == "none":
    return jnp.ones_like(w), mask
  if cfg.kind == "decoupled":
    return w, mask & (w <= hi) if cfg.cap is not None else mask
  if cfg.kind == "tis_token":
    return jnp.minimum(w, hi), mask
  if cfg.kind in ("mis_token", "icepop"):
    return w, mask & (w >= cfg.floor) & (w <= hi)
  log_big_w = _sequence_sums(jnp.where(mask, log_w, 0.0), segment_ids)
  big_w = jnp.exp(log_big_w)
  if cfg.kind == "tis_seq":
    return jnp.minimum(big_w, hi), mask
  # mis_seq
  if cfg.seq_stat == "ratio":
    stat, c = big_w, big_w
  else:
    count = jnp.maximum(_sequence_sums(mask.astype(log_w.dtype), segment_ids), 1.0)
    stat, c = jnp.exp(log_big_w / count), w
  return c, mask & (stat >= cfg.floor) & (stat <= hi)


def agreement_stats(
  learner_logp: jax.Array, sampler_logp: jax.Array, mask: jax.Array
) -> dict[str, jax.Array]:
  """How far the sampler's logprobs are from the learner's over `mask` (tokens sampled at the
  learner's current weights, where the two should agree to rounding): mean and max of
  |d|, d = logp_learner - logp_sampler; the k3 estimate of KL(sampler || learner),
  mean(r - 1 - log r) with r = exp(d) (Schulman 2020, unbiased and >= 0 per token); the fraction
  of tokens with r outside [0.5, 2]; and their count. Non-finite sampler logprobs (not asked
  for) are left out."""
  f32 = jnp.float32
  d = learner_logp.astype(f32) - sampler_logp.astype(f32)
  m = mask & jnp.isfinite(d)
  d = jnp.where(m, d, 0.0)
  n = m.sum().astype(f32)
  denom = jnp.maximum(n, 1.0)
  outside = jnp.abs(d) > jnp.log(AGREE_RATIO)
  return {
    "agree_abs_mean": jnp.abs(d).sum() / denom,
    "agree_abs_max": jnp.abs(d).max(),
    "agree_kl_k3": jnp.where(m, jnp.expm1(d) - d, 0.0).sum() / denom,
    "agree_out_frac": jnp.where(m, outside, False).sum().astype(f32) / denom,
    "agree_tokens": n,
  }


def ppo_loss(
  logp: jax.Array,
  prox_logp: jax.Array,
  behav_logp: jax.Array,
  advantages: jax.Array,
  loss_mask: jax.Array,
  *,
  eps_clip: float = 0.2,
  eps_clip_high: float | None = None,
  off_policy: OffPolicyConfig = OffPolicyConfig(),
  dual_clip: float | None = None,
  segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Token-level-mean PPO loss of one minibatch and its statistics (all arrays the same shape).

  Args:
    logp: current logprobs (differentiated).
    prox_logp: proximal logprobs, the clipping centre (not differentiated).
    behav_logp: behaviour logprobs from the sampler (unused with off_policy.kind "none").
    advantages: per-token advantages.
    loss_mask: 1 on tokens that carry loss (policy-generated), 0 elsewhere.
    eps_clip: lower clip 1 - eps_clip (and upper unless eps_clip_high is set).
    eps_clip_high: upper clip 1 + eps_clip_high (DAPO clip-higher); None = eps_clip.
    off_policy: the correction by w = pi_prox / pi_behav (OffPolicyConfig).
    dual_clip: c > 1 bounds the loss of negative-advantage tokens by c * |A|; None disables.
    segment_ids: which sequence of its packed row each token is (> 0), for the sequence-level
      corrections; None = one sequence per row.

  Returns:
    (loss, stats) with stats: clip_frac, dual_clip_frac, imp_weight_mean, imp_weight_max (of
    w), cap_masked_frac (loss tokens the correction dropped), correction_mean (c_t over kept
    tokens), approx_kl (mean of prox - theta, k1), behav_kl (mean of behav - prox), ratio_mean,
    loss_tokens.
  """
  f32 = jnp.float32
  mask = loss_mask.astype(f32) > 0
  n = jnp.maximum(mask.sum().astype(f32), 1.0)
  adv = advantages.astype(f32)
  prox = jax.lax.stop_gradient(prox_logp.astype(f32))
  # Masked positions may hold anything (padding); zero their log-ratios so exp never overflows.
  log_u = jnp.where(mask, logp.astype(f32) - prox, 0.0)
  u = jnp.exp(log_u)
  high = eps_clip if eps_clip_high is None else eps_clip_high
  u_clip = jnp.clip(u, 1.0 - eps_clip, 1.0 + high)
  unclipped, clipped = -adv * u, -adv * u_clip
  pg = jnp.maximum(unclipped, clipped)
  clip_hit = mask & (clipped > unclipped)
  dual_hit = jnp.zeros_like(mask)
  if dual_clip is not None:
    bound = dual_clip * jnp.abs(adv)
    dual_hit = mask & (adv < 0) & (pg > bound)
    pg = jnp.minimum(pg, bound)

  if off_policy.kind == "none":
    log_w = jnp.zeros_like(u)  # w = 1: standard PPO
  else:
    log_w = jax.lax.stop_gradient(prox - behav_logp.astype(f32))
    log_w = jnp.where(mask & jnp.isfinite(log_w), log_w, 0.0)
  w = jnp.exp(log_w)
  c, keep = correction(log_w, mask, off_policy, segment_ids)
  c = jax.lax.stop_gradient(c)
  per_token = jnp.where(keep, c * pg, 0.0)
  loss = per_token.sum() / n

  def mean(x):
    return jnp.where(mask, x, 0.0).sum() / n

  stats = {
    "loss": loss,
    "clip_frac": mean(clip_hit.astype(f32)),
    "dual_clip_frac": mean(dual_hit.astype(f32)),
    "imp_weight_mean": mean(w),
    "imp_weight_max": jnp.where(mask, w, 0.0).max(),
    "cap_masked_frac": mean((mask & ~keep).astype(f32)),
    "correction_mean": jnp.where(keep, c, 0.0).sum() / jnp.maximum(keep.sum().astype(f32), 1.0),
    "approx_kl": mean(-log_u),
    "behav_kl": mean(jnp.where(mask, behav_logp.astype(f32) - prox, 0.0)),
    "ratio_mean": mean(u),
    "loss_tokens": mask.sum().astype(f32),
  }
  return loss, jax.tree.map(jax.lax.stop_gradient, stats)
