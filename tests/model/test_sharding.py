"""Sharded (fsdp=4, tensor=2 over 8 fake CPU devices) computation equals the single-device one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model import steps, transformer
from asearcher_jax.model.sharding import MeshConfig
from tests.model.test_model import small_cfg

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")


def _batch(cfg, b=8, t=16, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
  seg = np.ones((b, t), np.int32)
  seg[:, t // 2 :] = 2
  seg[::2, -3:] = 0  # padding on some rows
  pos = np.concatenate([np.arange(t // 2), np.arange(t - t // 2)])[None].repeat(b, 0)
  mask = (seg > 0).astype(np.float32)
  mask[:, 0] = 0
  return {
    "tokens": jnp.asarray(tokens), "positions": jnp.asarray(pos, jnp.int32),
    "segment_ids": jnp.asarray(seg), "loss_mask": jnp.asarray(mask),
  }  # fmt: skip


def test_mesh_and_logical_rules():
  mesh = sharding_lib.make_mesh(data=1, fsdp=4, tensor=2)
  assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
  assert sharding_lib.logical_to_spec(("embed", "mlp"), (64, 96), mesh) == PartitionSpec(
    "fsdp", "tensor"
  )
  # A dim that does not divide stays replicated rather than failing.
  assert sharding_lib.logical_to_spec(("embed", "mlp"), (6, 96), mesh) == PartitionSpec(
    None, "tensor"
  )
  assert sharding_lib.logical_to_spec(("batch", "length"), (8, 5), mesh) == PartitionSpec(
    "fsdp", None
  )
  with pytest.raises(ValueError, match="needs 16 devices"):
    sharding_lib.make_mesh(data=2, fsdp=4, tensor=2)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_sharded_forward_and_grad_match_single_device(model_type):
  cfg = small_cfg(model_type, hidden_size=64, intermediate_size=96)
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  batch = _batch(cfg)

  def loss(p, b):
    return steps.nll_loss(graphdef, p, b)[0]

  want_lp = np.asarray(steps.score_batch(graphdef, params, batch))
  want_loss, want_grads = jax.value_and_grad(loss)(params, batch)

  mesh = sharding_lib.make_mesh(data=1, fsdp=4, tensor=2)
  p_sh = sharding_lib.param_shardings(params, mesh)
  sharded = jax.device_put(params, p_sh)
  q_spec = sharded["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value().sharding.spec
  assert q_spec == PartitionSpec("fsdp", "tensor")  # really sharded two ways
  b_sh = sharding_lib.batch_sharding(mesh)
  sbatch = jax.device_put(batch, b_sh)
  score = steps.compile_score_step(graphdef, sharded, mesh=mesh)
  got_lp = score(sharded, sbatch, 1.0)
  assert got_lp.sharding.spec == b_sh.spec
  np.testing.assert_allclose(np.asarray(got_lp), want_lp, atol=2e-5)

  with sharding_lib.activation_sharding(mesh):
    grad_fn = jax.jit(
      jax.value_and_grad(loss), in_shardings=(p_sh, b_sh), out_shardings=(None, p_sh)
    )
    got_loss, got_grads = grad_fn(sharded, sbatch)
  np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_sharded_train_step_matches_single_device_and_donates():
  cfg = small_cfg(hidden_size=64, intermediate_size=96)
  graphdef, params = nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(1)))
  opt = steps.make_optimizer(steps.OptimizerConfig(learning_rate=1e-2, warmup_steps=0))
  batch = _batch(cfg, seed=3)

  s1 = steps.init_train_state(jax.tree.map(jnp.copy, params), opt)  # donated below: keep params
  single = steps.compile_train_step(graphdef, opt, steps.nll_loss, s1)
  for _ in range(3):
    s1, m1 = single(s1, batch)

  mesh = sharding_lib.make_mesh(data=2, fsdp=2, tensor=2)
  sharded = jax.device_put(params, sharding_lib.param_shardings(params, mesh))
  s2 = steps.init_train_state(sharded, opt)
  step = steps.compile_train_step(graphdef, opt, steps.nll_loss, s2, mesh=mesh)
  losses = []
  for _ in range(3):
    old = s2
    s2, m2 = step(s2, jax.device_put(batch, sharding_lib.batch_sharding(mesh)))
    losses.append(float(m2["loss"]))
    assert old.step.is_deleted()  # the input state was donated
  assert losses[-1] < losses[0]
  assert int(s2.step) == 3
  np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-5)
  # Adam divides by sqrt(v), which magnifies reduction-order noise on near-zero gradients; a real
  # sharding bug moves parameters by ~lr = 1e-2.
  for a, b in zip(jax.tree.leaves(s2.params), jax.tree.leaves(s1.params), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4)


def test_optimizer_moments_are_sharded_like_their_parameters_and_the_abstract_state_agrees():
  """Adam's moments take their parameter's sharding (a jitted init alone replicated them on
  every chip), scalars are replicated, and `abstract_train_state` over `abstract_params`
  (what an ahead-of-time compile takes) has the concrete state's shapes, dtypes and shardings."""
  cfg = small_cfg(param_dtype="bfloat16")
  mesh = sharding_lib.make_mesh(fsdp=4, tensor=2)
  opt = steps.make_optimizer(steps.OptimizerConfig())
  graphdef, params = nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(0)))
  params = steps.cast_floating(params, "float32")
  params = jax.device_put(params, sharding_lib.param_shardings(params, mesh))
  state = steps.init_train_state(params, opt)
  adam = next(s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "mu"))
              if hasattr(s, "mu"))  # fmt: skip
  for p, m, v in zip(*(jax.tree.leaves(t) for t in (state.params, adam.mu, adam.nu)), strict=True):
    assert m.sharding == v.sharding == p.sharding
  assert any(p.sharding.spec != PartitionSpec() for p in jax.tree.leaves(state.params))
  assert state.step.sharding.spec == adam.count.sharding.spec == PartitionSpec()
  abstract_graphdef, abstract = steps.abstract_params(cfg, mesh=mesh, master_dtype="float32")
  abstract_state = steps.abstract_train_state(abstract, opt)
  assert abstract_graphdef == graphdef
  assert jax.tree.structure(abstract_state) == jax.tree.structure(state)
  for a, c in zip(jax.tree.leaves(abstract_state), jax.tree.leaves(state), strict=True):
    assert (a.shape, a.dtype, a.sharding) == (c.shape, c.dtype, c.sharding)


def test_a_mesh_over_the_first_n_devices():
  """`MeshConfig.devices`: part of a host's devices (one of the 8 fake ones here); more than exist,
  or fewer than 1, is a clear error."""
  mesh = MeshConfig(devices=2).build()
  assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 1}
  assert list(mesh.devices.flat) == jax.devices()[:2]
  assert MeshConfig(devices=1, fsdp=1).build().size == 1
  with pytest.raises(ValueError, match=r"MeshConfig\.devices = 9, but 8 device"):
    MeshConfig(devices=9).build()
  with pytest.raises(ValueError, match=r"MeshConfig\.devices must be >= 1"):
    MeshConfig(devices=0)
  with pytest.raises(ValueError, match="needs 4 devices, have 2"):
    MeshConfig(devices=2, fsdp=4).build()
