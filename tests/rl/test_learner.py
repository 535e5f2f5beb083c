"""The PPO learner on a tiny random model: PPO steps move logprobs the way advantages say, the
sharded step (fsdp=4, tensor=2 over 8 fake devices) matches one device, buckets stop
recompilation, and the switches do what they claim."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model import steps, transformer
from asearcher_jax.rl.learner import Learner, PPOConfig, ppo_objective
from asearcher_jax.rl.losses import OffPolicyConfig
from asearcher_jax.rl.replay import Group
from tests.model.test_model import small_cfg

CAP_1_2 = OffPolicyConfig(cap=1.2)  # decoupled, with a mask that bites on noisy behaviour
STANDARD = OffPolicyConfig(kind="none")

LEN, PROMPT = 12, 4


@pytest.fixture(scope="module")
def model():
  cfg = small_cfg(hidden_size=32, intermediate_size=48)
  graphdef, params = nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(0)))
  return cfg, graphdef, params


def _fresh(params):
  return jax.tree.map(jnp.copy, params)  # learners donate their state


def _groups(model, *, n_groups=4, n_traj=2, seed=0, version=0, noise=0.2):
  """Random sequences with behaviour logprobs = the model's own, plus noise (so w != 1); the
  first trajectory of each group gets reward +1, the others -1."""
  cfg, graphdef, params = model
  rng = np.random.default_rng(seed)
  n = n_groups * n_traj
  tokens = rng.integers(1, cfg.vocab_size, (n, LEN)).astype(np.int32)
  batch = {
    "tokens": jnp.asarray(tokens),
    "positions": jnp.broadcast_to(jnp.arange(LEN), (n, LEN)),
    "segment_ids": jnp.ones((n, LEN), jnp.int32),
  }
  lp = np.asarray(jax.jit(steps.score_batch, static_argnums=0)(graphdef, params, batch))
  lp = lp + rng.normal(0, noise, lp.shape)
  mask = np.zeros(LEN, np.int32)
  mask[PROMPT:] = 1
  groups = []
  for g in range(n_groups):
    trajs = []
    for t in range(n_traj):
      i = g * n_traj + t
      trajs.append([{
        "tokens": tokens[i], "loss_mask": mask, "logprobs": (lp[i] * mask).astype(np.float32),
        "versions": np.where(mask > 0, version, -1).astype(np.int32),
      }])  # fmt: skip
    advantages = [1.0] + [-1.0] * (n_traj - 1)
    groups.append(Group(group_id=f"{seed}/{g}", trajectories=trajs, advantages=advantages,
                        created_version=version))  # fmt: skip
  return groups


def _gen_logprob(learner, groups, sign):
  """Mean current logprob of generated tokens of trajectories with reward of this sign."""
  mb = learner.prepare(groups)[0]
  learner.to_device(mb)
  lp = np.asarray(learner.compute_prox_logprobs(mb.device))
  adv = mb.arrays["advantages"]
  sel = (mb.arrays["loss_mask"] > 0) & (np.sign(adv) == sign)
  return float(lp[sel].mean())


@pytest.mark.slow
def test_ppo_steps_raise_positive_and_lower_negative_sequences_without_recompiling(model):
  _, graphdef, params = model
  learner = Learner(
    graphdef, _fresh(params), ppo=PPOConfig(row_len=32, ppo_n_minibatches=2),
    optimizer=steps.OptimizerConfig(learning_rate=3e-3),
  )  # fmt: skip
  groups = _groups(model)
  pos0, neg0 = _gen_logprob(learner, groups, +1), _gen_logprob(learner, groups, -1)
  for step in range(4):
    m = learner.train_step(_groups(model, seed=step % 2) if step else groups)
    assert np.isfinite(m["ppo/loss"]) and m["ppo/grad_norm"] > 0
    assert m["ppo/loss_tokens"] == 8 * (LEN - PROMPT)
  assert learner.version == 4 and int(learner.state.step) == 8  # 2 optimizer steps per step
  assert m["staleness/token_max"] == 3.0  # tokens of version 0 trained by version-3 weights
  pos1, neg1 = _gen_logprob(learner, groups, +1), _gen_logprob(learner, groups, -1)
  assert pos1 > pos0 + 0.05 and neg1 < neg0 - 0.05
  assert learner.compiled_shapes() == 1  # every batch fell into the same bucket


@pytest.mark.slow
def test_first_minibatch_ratio_is_one_and_weights_are_decoupled(model):
  _, graphdef, params = model
  learner = Learner(
    graphdef, _fresh(params), ppo=PPOConfig(row_len=32, off_policy=CAP_1_2),
    optimizer=steps.OptimizerConfig(learning_rate=1e-3),
  )  # fmt: skip
  m = learner.train_step(_groups(model, noise=0.3))
  # pi_theta == pi_prox before the first update (AReaL's determinism check)
  assert m["ppo/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
  assert m["ppo/clip_frac"] == 0.0 and abs(m["ppo/approx_kl"]) < 1e-5
  # w = pi_prox / pi_behav is applied and capped: the behaviour noise shows up here
  assert m["ppo/imp_weight_max"] > 1.2 and 0 < m["ppo/cap_masked_frac"] < 1


def test_ppo_reports_the_sampling_entropy_over_loss_tokens(model):
  """`entropy` (-> ppo/entropy) is the mean over loss tokens of the entropy of softmax(logits / T)
  that each token was drawn from, from the loss's own forward."""
  cfg, graphdef, params = model
  rng = np.random.default_rng(7)
  n = 3
  tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (n, LEN)), jnp.int32)
  mask = np.zeros((n, LEN), np.float32)
  mask[:, PROMPT:] = 1
  mask[0, -2:] = 0
  batch = {
    "tokens": tokens, "positions": jnp.broadcast_to(jnp.arange(LEN), (n, LEN)),
    "segment_ids": jnp.ones((n, LEN), jnp.int32), "loss_mask": jnp.asarray(mask),
    "logprobs": jnp.zeros((n, LEN)), "advantages": jnp.ones((n, LEN)),
    "prox_logprobs": jnp.zeros((n, LEN)), "fresh_mask": jnp.ones((n, LEN)),
  }  # fmt: skip
  ppo = PPOConfig(row_len=LEN, temperature=0.8)
  _, metrics = jax.jit(lambda p, b: ppo_objective(ppo, graphdef, p, b))(params, batch)
  logits = np.asarray(nnx.merge(graphdef, params)(tokens), np.float64) / 0.8
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  ent = -(p * np.log(p)).sum(-1)[:, :-1]  # position t - 1 predicts token t
  want = (ent * mask[:, 1:]).sum() / mask.sum()
  np.testing.assert_allclose(float(metrics["entropy"]), want, rtol=1e-5)


@pytest.mark.slow
def test_plain_ppo_without_recompute_skips_the_extra_forward(model):
  _, graphdef, params = model
  learner = Learner(
    graphdef, _fresh(params),
    ppo=PPOConfig(row_len=32, off_policy=STANDARD, recompute_prox=False, global_norm=False),
    optimizer=steps.OptimizerConfig(learning_rate=1e-3),
  )  # fmt: skip
  m = learner.train_step(_groups(model, noise=0.3))
  assert learner._score._cache_size() == 0  # no proximal forward was compiled or run
  assert m["ppo/imp_weight_mean"] == 1.0 and m["ppo/cap_masked_frac"] == 0.0
  assert m["ppo/ratio_mean"] != pytest.approx(1.0, abs=1e-3)  # ratio is against pi_behav
  with pytest.raises(ValueError, match="recompute_prox"):
    PPOConfig(recompute_prox=False)  # decoupled by default


def test_advantage_pipeline_reward_transform_group_and_global_norm(model):
  _, graphdef, params = model
  cfg = PPOConfig(row_len=32, reward_bias=-0.5, reward_scale=10.0, reward_clip=5.0,
                  group_norm=True, global_norm=True)  # fmt: skip
  learner = Learner(graphdef, _fresh(params), ppo=cfg, optimizer=steps.OptimizerConfig())
  groups = _groups(model, n_groups=2, n_traj=3)
  groups[1].advantages = [1.0, 0.0, 0.0]
  vals = learner.compute_advantages(groups)
  np.testing.assert_allclose(vals[0], [1.1547, -0.5774, -0.5774], atol=1e-3)  # (+-5 -> z)
  mb = learner.prepare(groups)[0]
  a = mb.arrays["advantages"][mb.arrays["loss_mask"] > 0].astype(np.float64)
  assert abs(a.mean()) < 1e-6 and a.std(ddof=1) == pytest.approx(1.0, rel=1e-4)
  assert not mb.arrays["advantages"][mb.arrays["loss_mask"] == 0].any()


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")
def test_sharded_learner_matches_single_device(model):
  _, graphdef, params = model
  cfg = PPOConfig(row_len=32, ppo_n_minibatches=2)
  opt = steps.OptimizerConfig(learning_rate=1e-3)
  single = Learner(graphdef, _fresh(params), ppo=cfg, optimizer=opt)
  mesh = sharding_lib.make_mesh(data=1, fsdp=4, tensor=2)
  sharded = Learner(graphdef, _fresh(params), ppo=cfg, optimizer=opt, mesh=mesh)
  q = sharded.params["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value()
  assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  groups = _groups(model, n_groups=4, noise=0.3)
  for _ in range(2):
    m1, m2 = single.train_step(groups), sharded.train_step(groups)
  assert sharded.num_shards == 4 and m2["ppo/rows"] % 4 == 0
  for k in ("ppo/loss", "ppo/clip_frac", "ppo/imp_weight_mean", "ppo/grad_norm", "ppo/tokens"):
    np.testing.assert_allclose(m2[k], m1[k], rtol=2e-4, atol=1e-6, err_msg=k)
  for a, b in zip(jax.tree.leaves(sharded.params), jax.tree.leaves(single.params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True])
def test_micro_batches_give_the_whole_minibatch_update(model, sharded):
  """micro_rows accumulates gradients over row chunks; the update and the metrics must equal
  one pass over the whole minibatch (also with the rows sharded over a mesh)."""
  _, graphdef, params = model
  opt = steps.OptimizerConfig(learning_rate=1e-3)
  whole = Learner(graphdef, _fresh(params), ppo=PPOConfig(row_len=32), optimizer=opt)
  mesh = sharding_lib.make_mesh(data=1, fsdp=4, tensor=2) if sharded else None
  micro = Learner(
    graphdef, _fresh(params), ppo=PPOConfig(row_len=32, micro_rows=1),  # 4 rows over fsdp=4
    optimizer=opt, mesh=mesh,
  )  # fmt: skip
  groups = _groups(model, n_groups=8, noise=0.3)  # 16 trajectories of 12 tokens: 8 rows of 32
  for g in groups[:3]:  # uneven loss tokens per micro-batch: the weights must follow the counts
    for (seq,) in g.trajectories:
      seq["loss_mask"] = seq["loss_mask"].copy()
      seq["loss_mask"][-5:] = 0
      seq["logprobs"] = seq["logprobs"] * seq["loss_mask"]
  for _ in range(2):
    m1, m2 = whole.train_step(groups), micro.train_step(groups)
  assert m1["ppo/rows"] == m2["ppo/rows"] == 8
  for k in ("ppo/loss", "ppo/clip_frac", "ppo/imp_weight_mean", "ppo/imp_weight_max",
            "ppo/approx_kl", "ppo/grad_norm", "ppo/loss_tokens"):  # fmt: skip
    np.testing.assert_allclose(m2[k], m1[k], rtol=2e-4, atol=1e-6, err_msg=k)
  for a, b in zip(jax.tree.leaves(micro.params), jax.tree.leaves(whole.params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_micro_rows_count_per_shard_and_must_split_the_buckets():
  """micro_rows is per data shard: a micro-batch is micro_rows x shards rows, and a row bucket
  that does not split into such micro-batches (nor fits in one) is refused before compiling."""
  assert PPOConfig(micro_rows=2).micro_batch_rows(4) == 8
  assert PPOConfig(micro_rows=None).micro_batch_rows(4) is None
  assert PPOConfig(micro_rows=1, row_buckets=(2, 6)).micro_batch_rows(2) == 2
  with pytest.raises(ValueError, match=r"micro_rows=1 per shard x 4 shards = 4 rows .* \[6\]"):
    PPOConfig(micro_rows=1, row_buckets=(4, 6, 8)).micro_batch_rows(4)
  with pytest.raises(ValueError, match="micro_rows=3"):
    PPOConfig(micro_rows=3, row_buckets=(4, 8)).micro_batch_rows(1)
  with pytest.raises(ValueError, match="micro_rows=3 must be a power of two"):
    PPOConfig(micro_rows=3)
  with pytest.raises(ValueError, match="micro_rows must be >= 1"):
    PPOConfig(micro_rows=0)


def _scan_lengths(jaxpr) -> list[int]:
  """Lengths of every scan in a (closed) jaxpr, nested ones included."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      out.append(eqn.params["length"])
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      out.extend(_scan_lengths(sub))
  return out


@pytest.mark.slow
def test_one_row_per_shard_on_two_shards_runs_two_row_micro_batches(model):
  """micro_rows=1 over a 2-shard mesh: the step scans micro-batches of 2 rows (one per shard),
  and the update equals the one without micro-batches."""
  _, graphdef, params = model
  opt = steps.OptimizerConfig(learning_rate=1e-3)
  mesh = sharding_lib.make_mesh(fsdp=2, devices=jax.devices()[:2])
  learners = {
    micro: Learner(graphdef, _fresh(params), ppo=PPOConfig(row_len=32, micro_rows=micro),
                   optimizer=opt, mesh=mesh)
    for micro in (1, None)
  }  # fmt: skip
  groups = _groups(model, n_groups=8, noise=0.3)  # 8 rows of 32 tokens
  micro, whole = learners[1], learners[None]
  mb = micro.prepare(groups)[0]
  micro.to_device(mb)
  batch = {**mb.device, "prox_logprobs": mb.device["logprobs"]}
  assert batch["tokens"].shape[0] == 8
  lengths = _scan_lengths(micro._train.trace(micro.state, batch).jaxpr.jaxpr)
  assert 4 in lengths  # 8 rows / (1 row x 2 shards)
  assert 4 not in _scan_lengths(whole._train.trace(whole.state, batch).jaxpr.jaxpr)
  m1, m2 = whole.train_step(groups), micro.train_step(groups)
  for k in ("ppo/loss", "ppo/grad_norm", "ppo/loss_tokens"):
    np.testing.assert_allclose(m2[k], m1[k], rtol=2e-4, atol=1e-6, err_msg=k)
  for a, b in zip(jax.tree.leaves(micro.params), jax.tree.leaves(whole.params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.slow
def test_one_minibatch_takes_prox_from_the_step_forward(model):
  """With one minibatch pi_prox is the pre-step policy, so the step's own forward (stop-gradient)
  replaces the separate scoring pass: same update and metrics, and no scoring pass runs."""
  _, graphdef, params = model
  opt = steps.OptimizerConfig(learning_rate=1e-3)
  fused = Learner(graphdef, _fresh(params), ppo=PPOConfig(row_len=32, off_policy=CAP_1_2),
                  optimizer=opt)  # fmt: skip
  apart = Learner(
    graphdef, _fresh(params), ppo=PPOConfig(row_len=32, off_policy=CAP_1_2, fused_prox=False),
    optimizer=opt,
  )  # fmt: skip
  assert fused.ppo.prox_in_step and not apart.ppo.prox_in_step
  assert not PPOConfig(ppo_n_minibatches=2).prox_in_step  # later minibatches need the old pi
  for step in range(3):
    groups = _groups(model, seed=step, noise=0.3, version=step)
    m1, m2 = fused.train_step(groups), apart.train_step(groups)
    for k in ("ppo/loss", "ppo/imp_weight_mean", "ppo/imp_weight_max", "ppo/cap_masked_frac",
              "ppo/grad_norm", "ppo/behav_kl"):  # fmt: skip
      np.testing.assert_allclose(m1[k], m2[k], rtol=1e-4, atol=1e-6, err_msg=k)
  assert m1["ppo/cap_masked_frac"] > 0  # the importance weights were live, not all 1
  assert fused._score._cache_size() == 0 and apart._score._cache_size() == 1
  for a, b in zip(jax.tree.leaves(fused.params), jax.tree.leaves(apart.params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.slow
def test_short_rows_pack_short_minibatches_and_train_the_same(model):
  """short_row_lens: a minibatch packs into the shortest row length that holds its longest
  sequence; the row length changes the cost, not the update."""
  _, graphdef, params = model
  opt = steps.OptimizerConfig(learning_rate=1e-3)
  short = Learner(graphdef, _fresh(params), ppo=PPOConfig(row_len=64, short_row_lens=(16, 32)),
                  optimizer=opt)  # fmt: skip
  long = Learner(graphdef, _fresh(params), ppo=PPOConfig(row_len=64), optimizer=opt)
  groups = _groups(model, noise=0.3)  # sequences of 12 tokens
  assert short.prepare(groups)[0].arrays["tokens"].shape[1] == 16
  assert long.prepare(groups)[0].arrays["tokens"].shape[1] == 64
  m1, m2 = short.train_step(groups), long.train_step(groups)
  np.testing.assert_allclose(m1["ppo/loss"], m2["ppo/loss"], rtol=1e-4, atol=1e-6)
  assert m1["ppo/rows"] == 8 and m2["ppo/rows"] == 2  # 8 x 16 vs 2 x 64 cells for 96 tokens
  for a, b in zip(jax.tree.leaves(short.params), jax.tree.leaves(long.params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
  grown = _groups(model, seed=1, noise=0.3)  # one 20-token sequence: the minibatch needs 32
  seq = grown[0].trajectories[0][0]
  seq.update({k: np.concatenate([seq[k], seq[k][-8:]]) for k in seq})
  assert short.prepare(grown)[0].arrays["tokens"].shape[1] == 32
  with pytest.raises(ValueError, match="short_row_lens"):
    PPOConfig(row_len=64, short_row_lens=(64,))


@pytest.mark.slow
def test_ppo_epochs_reuse_the_batch_clipped_around_the_pre_step_policy(model):
  """ppo_epochs=2: two optimizer steps on the same minibatch, both clipped around the pi_prox of
  the pre-step weights (the second one sees ratios != 1 and clips), exactly two `update`s with
  the same proximal logprobs."""
  _, graphdef, params = model
  opt = steps.OptimizerConfig(learning_rate=3e-3)
  twice = Learner(graphdef, _fresh(params), ppo=PPOConfig(row_len=32, ppo_epochs=2),
                  optimizer=opt)  # fmt: skip
  assert not twice.ppo.prox_in_step  # epoch 2 needs the pre-step policy: a scoring pass
  groups = _groups(model, noise=0.3)
  pos0, neg0 = _gen_logprob(twice, groups, +1), _gen_logprob(twice, groups, -1)
  m = twice.train_step(groups)
  assert int(twice.state.step) == 2 and twice.version == 1 and m["ppo/optimizer_steps"] == 2
  assert m["ppo/loss_tokens"] == 8 * (LEN - PROMPT)  # one pass's tokens, not two
  # Epoch 1 starts at pi_prox (ratio 1, nothing clipped); epoch 2 starts one step away.
  assert abs(m["ppo/last_epoch/ratio_mean"] - 1.0) > 1e-4 and m["ppo/last_epoch/approx_kl"] != 0
  assert m["ppo/last_epoch/clip_frac"] > 0 and m["ppo/clip_frac"] == pytest.approx(
    m["ppo/last_epoch/clip_frac"] / 2
  )
  pos1, neg1 = _gen_logprob(twice, groups, +1), _gen_logprob(twice, groups, -1)
  assert pos1 > pos0 and neg1 < neg0
  # Reference: one step, then a second step of a learner whose pi_prox is still the first's.
  ref = Learner(graphdef, _fresh(params), ppo=PPOConfig(row_len=32, fused_prox=False),
                optimizer=opt)  # fmt: skip
  mbs = ref.prepare(groups)
  for mb in mbs:
    ref.to_device(mb)
    mb.device["prox_logprobs"] = ref.compute_prox_logprobs(mb.device)
  ref.update(mbs)
  ref.update(mbs)  # the same prox_logprobs: the pre-step policy
  for a, b in zip(jax.tree.leaves(twice.params), jax.tree.leaves(ref.params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
  with pytest.raises(ValueError, match="ppo_epochs"):
    PPOConfig(ppo_epochs=0)
