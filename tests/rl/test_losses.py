"""Decoupled PPO loss against a direct float64 numpy computation, for every switch combination,
plus gradient sanity (no gradient through masked, capped, clipped tokens or through pi_prox /
pi_behav)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asearcher_jax.rl.losses import OffPolicyConfig, ppo_loss


def _inputs(seed=0, shape=(4, 33)):
  rng = np.random.default_rng(seed)
  behav = rng.normal(-2.0, 1.0, shape)
  prox = behav + rng.normal(0.0, 0.8, shape)  # some w = exp(prox - behav) well above 5
  logp = prox + rng.normal(0.0, 0.3, shape)  # ratios well outside [0.8, 1.2]
  adv = rng.normal(0.0, 1.5, shape)
  mask = (rng.random(shape) < 0.7).astype(np.float64)
  mask[0, :] = 0
  mask[0, 3] = 1
  # garbage where the mask is 0 must not matter (padding), even huge values
  logp = np.where(mask > 0, logp, 50.0)
  return logp, prox, behav, adv, mask


def _reference(logp, prox, behav, adv, mask, *, eps, eps_high, decoupled, cap, dual):
  """The DESIGN formula, written out in float64."""
  m = mask > 0
  u = np.exp(np.where(m, logp - prox, 0.0))
  hi = eps if eps_high is None else eps_high
  pg = np.maximum(-adv * u, -adv * np.clip(u, 1 - eps, 1 + hi))
  if dual is not None:
    pg = np.where(adv < 0, np.minimum(pg, dual * np.abs(adv)), pg)
  if decoupled:
    w = np.exp(np.where(m, prox - behav, 0.0))
    keep = m & (w <= cap) if cap is not None else m
  else:
    w = np.ones_like(u)
    keep = m
  n = max(m.sum(), 1)
  loss = np.where(keep, w * pg, 0.0).sum() / n
  clip_frac = (m & (-adv * np.clip(u, 1 - eps, 1 + hi) > -adv * u)).sum() / n
  return loss, {
    "clip_frac": clip_frac,
    "imp_weight_mean": np.where(m, w, 0).sum() / n,
    "imp_weight_max": np.where(m, w, 0).max(),
    "cap_masked_frac": (m & ~keep).sum() / n,
    "approx_kl": np.where(m, prox - logp, 0).sum() / n,
    "loss_tokens": m.sum(),
  }


SWITCHES = list(
  itertools.product(
    [True, False],  # decoupled
    [True, False],  # recompute (False: prox = behaviour)
    [None, 0.28],  # eps_clip_high
    [5.0, 1.5, None],  # cap
    [None, 3.0],  # dual clip
  )
)


@pytest.mark.parametrize("decoupled,recompute,eps_high,cap,dual", SWITCHES)
def test_loss_matches_float64_numpy(decoupled, recompute, eps_high, cap, dual):
  logp, prox, behav, adv, mask = _inputs(seed=len(str((decoupled, recompute, eps_high, cap))))
  if not recompute:
    prox = behav
  kw = dict(eps_high=eps_high, decoupled=decoupled, cap=cap, dual=dual)
  want, want_stats = _reference(logp, prox, behav, adv, mask, eps=0.2, **kw)
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  loss, stats = ppo_loss(  # eager: 48 jit compiles would dominate the suite's runtime
    f32(logp), f32(prox), f32(behav), f32(adv), f32(mask),
    eps_clip=0.2, eps_clip_high=eps_high, dual_clip=dual,
    off_policy=OffPolicyConfig(kind="decoupled" if decoupled else "none", cap=cap),
  )  # fmt: skip
  np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-5)
  for k, v in want_stats.items():
    np.testing.assert_allclose(float(stats[k]), v, rtol=1e-5, atol=1e-5, err_msg=k)
  if decoupled and recompute and cap == 1.5:
    assert 0 < float(stats["cap_masked_frac"]) < 1  # the cap really bites in this case
  assert 0 < float(stats["clip_frac"]) < 1


def test_standard_ppo_ignores_behaviour_and_decoupled_with_equal_policies_is_ppo():
  logp, prox, behav, adv, mask = _inputs(1)
  none = OffPolicyConfig(kind="none")
  a = ppo_loss(*map(jnp.asarray, (logp, prox, behav, adv, mask)), off_policy=none)[0]
  b = ppo_loss(*map(jnp.asarray, (logp, prox, behav + 3.0, adv, mask)), off_policy=none)[0]
  c = ppo_loss(*map(jnp.asarray, (logp, prox, prox, adv, mask)))[0]  # decoupled by default
  np.testing.assert_allclose([float(b), float(c)], float(a), rtol=1e-6)


def test_gradients_flow_only_through_kept_unclipped_loss_tokens():
  logp, prox, behav, adv, mask = _inputs(2)
  args = [jnp.asarray(x, jnp.float32) for x in (logp, prox, behav, adv, mask)]
  grads = jax.grad(lambda lp, px, bh: ppo_loss(lp, px, bh, *args[3:])[0], argnums=(0, 1, 2))(
    *args[:3]
  )
  g = np.asarray(grads[0], np.float64)
  assert not np.asarray(grads[1]).any() and not np.asarray(grads[2]).any()  # detached
  m = mask > 0
  u = np.exp(np.where(m, logp - prox, 0))
  w = np.exp(np.where(m, prox - behav, 0))
  capped = m & (w > 5.0)
  clipped = m & (-adv * np.clip(u, 0.8, 1.2) > -adv * u)
  assert capped.any() and clipped.any()
  assert not g[~m].any() and not g[capped].any() and not g[clipped].any()
  live = m & ~capped & ~clipped
  # d/dlogp of w * (-A * u) / n = -w * A * u / n
  np.testing.assert_allclose(g[live], (-w * adv * u)[live] / m.sum(), rtol=1e-4, atol=1e-7)
  assert np.abs(g[live]).min() > 0


def test_empty_mask_gives_zero_loss_not_nan():
  z = jnp.zeros((2, 5))
  loss, stats = ppo_loss(z, z, z, z + 1.0, z)
  assert float(loss) == 0.0 and all(np.isfinite(float(v)) for v in stats.values())
