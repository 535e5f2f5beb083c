"""The off-policy corrections of `losses.OffPolicyConfig` against hand-computed batches, the
default's loss bit for bit the decoupled PPO loss it replaced, and the agreement statistics.

The hand batch: one packed row of two sequences (segment ids 1 and 2), four loss tokens, logp ==
prox (u = 1, nothing clipped) and A = 1, so each kept token adds -c_t and the loss is
-sum(kept c_t) / 4. The off-policy ratios w = pi_prox / pi_behav of the loss tokens are
3, 0.25 (sequence 1, W = 0.75) and 8, 0.5 (sequence 2, W = 4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asearcher_jax import main
from asearcher_jax.apps.train_config import LearnerConfig, TrainConfig
from asearcher_jax.rl.learner import PPOConfig
from asearcher_jax.rl.losses import OffPolicyConfig, agreement_stats, ppo_loss
from asearcher_jax.rl.trainer import TrainerConfig, agreement_metrics

SEGMENTS = np.array([[1, 1, 1, 2, 2, 2, 0]], np.int32)
MASK = np.array([[0, 1, 1, 0, 1, 1, 0]], np.float32)
W = np.array([[1.0, 3.0, 0.25, 1.0, 8.0, 0.5, 1.0]])


def _hand_loss(cfg: OffPolicyConfig) -> tuple[float, dict]:
  behav = np.full(W.shape, -2.0)
  prox = behav + np.log(W)
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  loss, stats = ppo_loss(
    f32(prox), f32(prox), f32(behav), f32(np.ones(W.shape)), f32(MASK),
    off_policy=cfg, segment_ids=jnp.asarray(SEGMENTS),
  )  # fmt: skip
  return float(loss), stats


def test_default_correction_is_decoupled_ppo_with_the_mask_at_5():
  assert OffPolicyConfig() == OffPolicyConfig(kind="decoupled", cap=5.0)
  # Masked at 5: the 8 goes, c = w on the rest.
  assert _hand_loss(OffPolicyConfig())[0] == pytest.approx(-(3 + 0.25 + 0.5) / 4, rel=1e-6)


def test_truncated_is_token_clamps_each_weight():
  loss, stats = _hand_loss(OffPolicyConfig(kind="tis_token", cap=2.0))
  assert loss == pytest.approx(-(2 + 0.25 + 2 + 0.5) / 4, rel=1e-6)  # min(w, 2), nothing dropped
  assert float(stats["cap_masked_frac"]) == 0.0


def test_truncated_is_sequence_clamps_the_product_per_sequence():
  loss, _ = _hand_loss(OffPolicyConfig(kind="tis_seq", cap=2.0))
  assert loss == pytest.approx(-(0.75 * 2 + 2 * 2) / 4, rel=1e-6)  # min(0.75, 2), min(4, 2)


def test_truncated_is_sequence_without_segments_takes_each_row_as_one_sequence():
  behav = np.full(W.shape, -2.0)
  prox = jnp.asarray(behav + np.log(W), jnp.float32)
  loss, _ = ppo_loss(prox, prox, jnp.asarray(behav, jnp.float32), jnp.ones(W.shape),
                     jnp.asarray(MASK), off_policy=OffPolicyConfig(kind="tis_seq", cap=10.0))  # fmt: skip
  assert float(loss) == pytest.approx(-(3.0 * 4) / 4, rel=1e-6)  # W = 3 on all four tokens


def test_masked_is_token_drops_tokens_outside_the_bounds():
  one_sided, _ = _hand_loss(OffPolicyConfig(kind="mis_token", cap=2.0))
  assert one_sided == pytest.approx(-(0.25 + 0.5) / 4, rel=1e-6)
  loss, stats = _hand_loss(OffPolicyConfig(kind="mis_token", cap=2.0, floor=0.5))
  assert loss == pytest.approx(-0.5 / 4, rel=1e-6)  # 0.25 < floor, 3 and 8 > cap
  assert float(stats["cap_masked_frac"]) == pytest.approx(3 / 4)


def test_masked_is_sequence_by_ratio_drops_whole_sequences():
  loss, stats = _hand_loss(OffPolicyConfig(kind="mis_seq", cap=2.0, floor=0.5))
  # W = 0.75 kept (c = 0.75 on both tokens), W = 4 > 2 dropped whole.
  assert loss == pytest.approx(-(0.75 * 2) / 4, rel=1e-6)
  assert float(stats["cap_masked_frac"]) == pytest.approx(2 / 4)
  assert float(stats["correction_mean"]) == pytest.approx(0.75, rel=1e-6)


def test_masked_is_sequence_by_geometric_mean_filters_token_weights():
  # Geometric means sqrt(0.75) = 0.87 (kept) and sqrt(4) = 2 (> 1.9, dropped); kept tokens keep w.
  loss, _ = _hand_loss(OffPolicyConfig(kind="mis_seq", cap=1.9, floor=0.5, seq_stat="geo_mean"))
  assert loss == pytest.approx(-(3 + 0.25) / 4, rel=1e-6)
  # Both kept with a cap above 2.
  loss, _ = _hand_loss(OffPolicyConfig(kind="mis_seq", cap=2.5, floor=0.5, seq_stat="geo_mean"))
  assert loss == pytest.approx(-(3 + 0.25 + 8 + 0.5) / 4, rel=1e-6)


def test_icepop_masks_two_sided_and_passes_no_gradient_through_masked_tokens():
  cfg = OffPolicyConfig(kind="icepop", cap=5.0, floor=0.5)
  loss, _ = _hand_loss(cfg)
  assert loss == pytest.approx(-(3 + 0.5) / 4, rel=1e-6)  # 0.25 < 0.5 and 8 > 5 masked
  behav = jnp.full(W.shape, -2.0)
  prox = behav + jnp.log(jnp.asarray(W, jnp.float32))
  grad = jax.grad(
    lambda lp: ppo_loss(
      lp,
      prox,
      behav,
      jnp.ones(W.shape),
      jnp.asarray(MASK),
      off_policy=cfg,
      segment_ids=jnp.asarray(SEGMENTS),
    )[0]
  )(prox)
  # d/dlogp of -c * A * u / n at u = 1: -c / 4 on kept tokens, 0 elsewhere.
  np.testing.assert_allclose(np.asarray(grad)[0], [0, -3 / 4, 0, 0, 0, -0.5 / 4, 0], rtol=1e-6)


@pytest.mark.parametrize(
  "kw, match",
  [
    (dict(kind="tis"), "kind must be one of"),
    (dict(cap=0.0), "cap must be > 0"),
    (dict(kind="icepop"), "floor must be > 0"),
    (dict(kind="mis_token", cap=2.0, floor=3.0), r"floor must be in \[0, cap\)"),
    (dict(kind="mis_seq", seq_stat="mean"), "seq_stat must be ratio or geo_mean"),
  ],
)
def test_a_bad_off_policy_config_is_one_line(kw, match):
  with pytest.raises(ValueError, match=match):
    OffPolicyConfig(**kw)


def _decoupled_loss_before(logp, prox_logp, behav_logp, advantages, loss_mask, *, cap=5.0):
  """The decoupled PPO loss as it was before the corrections became configurable (eps 0.2, no
  dual clip), kept verbatim as the default's oracle."""
  f32 = jnp.float32
  mask = loss_mask.astype(f32) > 0
  n = jnp.maximum(mask.sum().astype(f32), 1.0)
  adv = advantages.astype(f32)
  prox = jax.lax.stop_gradient(prox_logp.astype(f32))
  log_u = jnp.where(mask, logp.astype(f32) - prox, 0.0)
  u = jnp.exp(log_u)
  u_clip = jnp.clip(u, 1.0 - 0.2, 1.0 + 0.2)
  pg = jnp.maximum(-adv * u, -adv * u_clip)
  log_w = jax.lax.stop_gradient(prox - behav_logp.astype(f32))
  log_w = jnp.where(mask & jnp.isfinite(log_w), log_w, 0.0)
  w = jnp.exp(log_w)
  keep = mask & (w <= cap)
  return jnp.where(keep, w * pg, 0.0).sum() / n


@pytest.mark.parametrize("jit", [False, True])
def test_the_default_loss_is_bit_identical_to_the_decoupled_loss_before(jit):
  rng = np.random.default_rng(3)
  shape = (4, 33)
  behav = rng.normal(-2.0, 1.0, shape)
  prox = behav + rng.normal(0.0, 0.8, shape)  # some w above 5
  logp = prox + rng.normal(0.0, 0.3, shape)
  args = [jnp.asarray(x, jnp.float32) for x in
          (logp, prox, behav, rng.normal(0, 1.5, shape), rng.random(shape) < 0.7)]  # fmt: skip
  new = jax.value_and_grad(lambda lp: ppo_loss(lp, *args[1:])[0])
  old = jax.value_and_grad(lambda lp: _decoupled_loss_before(lp, *args[1:]))
  if jit:
    new, old = jax.jit(new), jax.jit(old)
  (a, ga), (b, gb) = new(args[0]), old(args[0])
  assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  assert np.asarray(ga).tobytes() == np.asarray(gb).tobytes()


def test_agreement_stats_by_hand():
  learner = jnp.asarray([[-1.0, -2.0, -3.0, -0.5, -4.0]])
  sampler = jnp.asarray([[-1.0, -2.1, -1.0, jnp.nan, -9.0]])
  mask = jnp.asarray([[True, True, True, True, False]])  # the nan is left out, so is the last
  s = {k: float(v) for k, v in agreement_stats(learner, sampler, mask).items()}
  d = np.array([0.0, 0.1, -2.0])
  assert s["agree_tokens"] == 3
  assert s["agree_abs_mean"] == pytest.approx(2.1 / 3, rel=1e-5)
  assert s["agree_abs_max"] == pytest.approx(2.0, rel=1e-6)
  assert s["agree_kl_k3"] == pytest.approx(float(np.mean(np.expm1(d) - d)), rel=1e-5)
  assert s["agree_out_frac"] == pytest.approx(1 / 3)  # only r = e^-2 leaves [0.5, 2]


def test_agreement_metrics_are_named_by_the_sampler_tag_and_dropped_without_tokens():
  step = {"ppo/loss": 1.0, "ppo/agree_abs_mean": 0.1, "ppo/agree_abs_max": 0.5,
          "ppo/agree_tokens": 7.0}  # fmt: skip
  out = agreement_metrics(step, "paged-gather.bfloat16")
  assert out == {"ppo/loss": 1.0, "agreement/paged-gather.bfloat16/abs_mean": 0.1,
                 "agreement/paged-gather.bfloat16/abs_max": 0.5,
                 "agreement/paged-gather.bfloat16/tokens": 7.0}  # fmt: skip
  # No token of the trained version: only the count, a zero mismatch would read as agreement.
  none = agreement_metrics({**step, "ppo/agree_tokens": 0.0}, "fixed.float32")
  assert none == {"ppo/loss": 1.0, "agreement/fixed.float32/tokens": 0.0}
  assert agreement_metrics({"ppo/loss": 1.0}, "x") == {"ppo/loss": 1.0}  # recompute off
  with pytest.raises(ValueError, match="sampler_tag"):
    TrainerConfig(train_steps=1, batch_groups=1, sampler_tag="a/b")


def test_the_train_program_binds_the_correction_in_gin(capsys):
  tis = OffPolicyConfig(kind="tis_token", cap=2.0)
  assert TrainConfig().ppo().off_policy == OffPolicyConfig()  # the default: decoupled, 5
  derived = TrainConfig(learner=LearnerConfig(off_policy=tis)).ppo()
  assert derived.off_policy == tis and derived.row_len == TrainConfig().engine.max_seq_len
  given = TrainConfig(learner=LearnerConfig(ppo=PPOConfig(row_len=64), off_policy=tis)).ppo()
  assert given.off_policy == tis and given.row_len == 64
  check = ["train", "--check", "gin/runs/train.gin"]
  assert main.main([*check, "--gin_param=losses.OffPolicyConfig.kind='tis_seq'"]) == 0
  assert main.main([*check, "--gin_param=losses.OffPolicyConfig.kind='icepop'"]) == 2
  assert "floor must be > 0" in capsys.readouterr().err
