"""Layers under a scan equal the Python loop, every remat policy gives the loop's gradients, and
log-probs / entropies computed over chunks of positions equal the whole-logits computation, with
the compiled program not growing with depth and the loss's memory not holding [rows, T, V]."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model import steps, transformer
from asearcher_jax.model.config import REMAT_POLICIES
from tests.model.test_model import small_cfg

T = 16


def _batch(cfg, b: int = 2, t: int = T, seed: int = 0) -> dict[str, jax.Array]:
  """Packed rows: two segments per row, trailing padding on the first row."""
  rng = np.random.default_rng(seed)
  seg = np.ones((b, t), np.int32)
  seg[:, 7:] = 2
  seg[0, -3:] = 0
  pos = np.where(np.arange(t) < 7, np.arange(t), np.arange(t) - 7)[None].repeat(b, 0)
  mask = (seg > 0).astype(np.float32)
  mask[:, 0] = 0
  return {
    "tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32),
    "positions": jnp.asarray(pos, jnp.int32), "segment_ids": jnp.asarray(seg),
    "loss_mask": jnp.asarray(mask),
  }  # fmt: skip


def _params(cfg, seed: int = 0):
  return nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(seed)))


def _stats_and_grads(cfg, batch, temperature: float = 1.0):
  """(logprobs, entropy, logits, grads of a temperature-scaled NLL) under cfg, one jit."""
  graphdef, params = _params(cfg)

  def loss(p):
    lp, ent = steps.score_batch_and_entropy(graphdef, p, batch, temperature)
    return -(lp * batch["loss_mask"]).sum(), (lp, ent)

  @jax.jit
  def run(p):
    (_, (lp, ent)), grads = jax.value_and_grad(loss, has_aux=True)(p)
    logits = nnx.merge(graphdef, p)(batch["tokens"], batch["positions"], batch["segment_ids"])
    return lp, ent, logits, grads

  return jax.tree.map(np.asarray, run(params))


def _assert_trees_close(a, b, **tol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, **tol)


@pytest.mark.slow
def test_scan_equals_the_loop_in_logits_and_gradients():
  base = small_cfg(num_layers=3, logits_chunk=0)
  batch = _batch(base)
  loop = _stats_and_grads(base.replace(scan_layers=False), batch)
  scan = _stats_and_grads(base.replace(scan_layers=True), batch)
  np.testing.assert_allclose(scan[2], loop[2], atol=1e-6, rtol=0)  # logits
  np.testing.assert_allclose(scan[0], loop[0], atol=1e-6, rtol=0)  # logprobs
  _assert_trees_close(scan[3], loop[3], atol=1e-6, rtol=1e-5)  # gradients, per layer
  # The parameter tree is still one entry per layer (hf_io, checkpoints, the engine).
  assert len(_params(base)[1]["layers"]) == 3


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [5, 8])  # 5 does not divide T = 16: the last chunk is padded
def test_chunked_scores_entropy_and_gradients_equal_unchunked(chunk):
  base = small_cfg(num_layers=2, logits_chunk=0)
  batch = _batch(base, seed=1)
  want = _stats_and_grads(base, batch, temperature=0.7)
  got = _stats_and_grads(base.replace(logits_chunk=chunk), batch, temperature=0.7)
  np.testing.assert_allclose(got[0], want[0], atol=1e-6, rtol=0)
  np.testing.assert_allclose(got[1], want[1], atol=1e-6, rtol=0)
  _assert_trees_close(got[3], want[3], atol=1e-6, rtol=1e-5)


def test_entropy_is_the_sampling_distributions_and_aligned_like_logprobs():
  cfg = small_cfg(num_layers=1, logits_chunk=4)
  batch = _batch(cfg, seed=2)
  lp, ent, logits, _ = _stats_and_grads(cfg, batch, temperature=0.7)
  z = logits.astype(np.float64) / 0.7
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  direct = -(p * np.log(p)).sum(-1)  # H at position t is the distribution token t + 1 came from
  seg = np.asarray(batch["segment_ids"])
  same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
  np.testing.assert_allclose(ent[:, 1:][same], direct[:, :-1][same], atol=1e-5)
  # Zero exactly where the logprob is zero: segment starts and padding.
  assert (ent[:, 1:][~same] == 0).all() and (ent[:, 0] == 0).all()
  assert (lp[:, 1:][~same] == 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("scan", [True, False])
def test_every_remat_policy_gives_the_same_gradients(scan):
  base = small_cfg(num_layers=2, scan_layers=scan, logits_chunk=0)
  batch = _batch(base, seed=3)
  want = _stats_and_grads(base.replace(remat_policy="none"), batch)[3]
  for policy in [p for p in REMAT_POLICIES if p != "none"]:
    _assert_trees_close(
      _stats_and_grads(base.replace(remat_policy=policy), batch)[3], want, atol=1e-6, rtol=1e-5
    )


def test_config_mistakes_name_the_field():
  with pytest.raises(ValueError, match=r"ModelConfig\.remat_policy 'dots_with_no_batch_dims'"):
    small_cfg(remat_policy="dots_with_no_batch_dims")
  with pytest.raises(ValueError, match=r"ModelConfig\.logits_chunk must be >= 0"):
    small_cfg(logits_chunk=-1)
  with pytest.raises(TypeError, match="remat"):
    small_cfg(remat=True)  # the old boolean is gone rather than silently ignored


def _grad_hlo_chars(cfg) -> int:
  graphdef, params = jax.eval_shape(lambda: _params(cfg))
  batch = _batch(cfg)
  grad = jax.jit(jax.grad(lambda p, b: steps.nll_loss(graphdef, p, b)[0]))
  return len(grad.lower(params, batch).as_text())


def test_the_scanned_program_does_not_grow_with_depth():
  """Compile time follows program size: the scan traces the block once, the loop once per layer.
  What still grows under the scan is one argument and one stack operand per layer parameter."""
  scan = [_grad_hlo_chars(small_cfg(num_layers=n)) for n in (2, 8)]
  loop = [_grad_hlo_chars(small_cfg(num_layers=n, scan_layers=False)) for n in (2, 8)]
  assert scan[1] / scan[0] < 1.5, scan
  assert loop[1] / loop[0] > 2.5, loop


@pytest.mark.slow
def test_chunked_loss_temporaries_do_not_hold_rows_x_t_x_vocab():
  """XLA:CPU's compiled memory of the loss and its gradient at a 32k vocabulary and 2k tokens:
  unchunked holds several fp32 [T, V] buffers (256 MB each); 64-token chunks hold 1/32 of one per
  copy (what remains is mostly the dense attention's [T, T] masks)."""
  cfg = small_cfg(vocab_size=32768, hidden_size=16, intermediate_size=32, num_layers=1,
                  num_heads=2, num_kv_heads=1)  # fmt: skip
  t = 2048
  one_tv = t * cfg.vocab_size * 4

  def temp_bytes(chunk: int) -> int:
    c = cfg.replace(logits_chunk=chunk)
    graphdef, params = jax.eval_shape(lambda: _params(c))
    batch = _batch(c, b=1, t=t)
    grad = jax.jit(jax.grad(lambda p, b: steps.nll_loss(graphdef, p, b)[0]))
    return grad.lower(params, batch).compile().memory_analysis().temp_size_in_bytes

  whole, chunked = temp_bytes(0), temp_bytes(64)
  assert whole > 1.5 * one_tv, whole
  assert chunked < 0.25 * one_tv and chunked * 8 < whole, (whole, chunked)


def test_stacked_layers_keep_their_per_layer_sharding():
  """Under an fsdp x tensor mesh the stacked copy is sharded like each layer, the layer axis
  replicated: the scan then slices one layer locally and all-gathers only it (FSDP)."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 (fake) devices")
  cfg = small_cfg(num_layers=3, hidden_size=64, intermediate_size=96)
  graphdef, params = _params(cfg)
  mesh = sharding_lib.make_mesh(data=1, fsdp=4, tensor=2)
  p_sh = sharding_lib.param_shardings(params, mesh)
  sharded = jax.device_put(params, p_sh)

  def stacked(p):
    model = nnx.merge(graphdef, p)
    return nnx.to_pure_dict(transformer.stack_layers(model.layers, cfg)[1])

  with sharding_lib.activation_sharding(mesh):
    out = jax.jit(stacked, in_shardings=(p_sh,))(sharded)
  q = out["self_attn"]["q_proj"]["kernel"]
  assert q.shape == (3, 64, 64)
  assert q.sharding.spec == PartitionSpec(None, "fsdp", "tensor")
  assert out["mlp"]["down_proj"]["kernel"].sharding.spec == PartitionSpec(None, "tensor", "fsdp")


def test_stacking_casts_fp32_masters_to_the_compute_dtype():
  cfg = small_cfg(num_layers=2, dtype="bfloat16")
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  stacked = nnx.to_pure_dict(transformer.stack_layers(model.layers, cfg)[1])
  kernel = stacked["self_attn"]["q_proj"]["kernel"]
  assert kernel.dtype == jnp.bfloat16 and kernel.shape[0] == 2
  # ... and never widens: bf16 parameters computing in fp32 stack as bf16.
  cfg32 = small_cfg(num_layers=2, param_dtype="bfloat16")
  model = transformer.Transformer(cfg32, rngs=nnx.Rngs(0))
  stacked = nnx.to_pure_dict(transformer.stack_layers(model.layers, cfg32)[1])
  assert stacked["self_attn"]["q_proj"]["kernel"].dtype == jnp.bfloat16


def test_stacked_form_round_trips_exactly_and_scores_as_the_list_form():
  """The learner's stacked layers (`Transformer.stack`): unstacking gives back the list form's
  graphdef, tree structure (metadata included: the engine's jitted steps key on it) and values;
  the stacked model's logits equal the list form's under the scan; a layer's leaves carry a
  leading layer axis with a None logical axis (replicated over the layers)."""
  cfg = small_cfg(num_layers=3, logits_chunk=0)
  graphdef, params = _params(cfg)
  sgd, stacked = transformer.stack_params(graphdef, params)
  assert transformer.is_stacked(stacked) and not transformer.is_stacked(params)
  q = stacked["stacked_layers"]["self_attn"]["q_proj"]["kernel"]
  one = params["layers"][0]["self_attn"]["q_proj"]["kernel"]
  assert q.get_value().shape == (3, *one.get_value().shape)
  assert q.get_metadata()["logical_axes"] == (None, *one.get_metadata()["logical_axes"])
  ugd, back = transformer.unstack_params(sgd, stacked)
  assert ugd == graphdef and jax.tree.structure(back) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
    np.testing.assert_array_equal(a, b)
  assert steps.list_form(sgd, stacked)["layers"][2]["mlp"]["down_proj"]["kernel"].shape == (
    params["layers"][2]["mlp"]["down_proj"]["kernel"].shape
  )
  batch = _batch(cfg)
  args = (batch["tokens"], batch["positions"], batch["segment_ids"])
  got = jax.jit(lambda p: nnx.merge(sgd, p)(*args))(stacked)
  want = jax.jit(lambda p: nnx.merge(graphdef, p)(*args))(params)
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
  with pytest.raises(ValueError, match="unstack"):
    nnx.merge(sgd, stacked).extend(batch["tokens"], jnp.zeros((2,), jnp.int32), None)


def test_the_optimizer_decays_the_same_leaves_stacked_or_not():
  """Weight decay applies to matrices only; a stacked norm scale [L, D] is still a vector."""
  cfg = small_cfg(num_layers=2)
  graphdef, params = _params(cfg)
  _, stacked = transformer.stack_params(graphdef, params)

  def decayed(tree):
    return sorted(
      "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path if hasattr(k, "key"))
      for path, on in jax.tree_util.tree_flatten_with_path(steps._decayed(tree))[0]
      if on
    )

  listed = {p.replace("layers/0/", "L/") for p in decayed(params) if "layers/1/" not in p}
  assert {p.replace("stacked_layers/", "L/") for p in decayed(stacked)} == listed
  assert not any("layernorm" in p for p in listed) and any("q_proj/kernel" in p for p in listed)


def _step_hlo_chars(cfg, stacked: bool) -> int:
  """Text size of the whole AdamW step over the model's stacked or list form."""
  graphdef, params = steps.abstract_params(cfg, stacked=stacked)
  opt = steps.make_optimizer(steps.OptimizerConfig(learning_rate=1e-3))
  state = steps.abstract_train_state(params, opt)
  step = steps.compile_train_step(graphdef, opt, steps.nll_loss, state)
  return len(step.lower(state, _batch(cfg)).as_text())


def test_the_train_step_over_stacked_layers_does_not_grow_with_depth():
  """With the layers stored stacked the optimizer's update is one chain per stacked leaf, so
  the whole step's program (what compile time follows) is the same size at 2 and 8 layers; in
  the list form it grows by a dozen update chains per layer."""
  cfgs = [small_cfg(num_layers=n) for n in (2, 8)]
  assert all(steps.trains_stacked(c) for c in cfgs)  # the learner's form by default
  stacked = [_step_hlo_chars(c, stacked=True) for c in cfgs]
  listed = [_step_hlo_chars(c, stacked=False) for c in cfgs]
  assert stacked[1] / stacked[0] < 1.1, stacked
  assert listed[1] / listed[0] > 1.5, listed
