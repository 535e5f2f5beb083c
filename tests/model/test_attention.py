"""The packed-attention kernels against the dense reference: values, gradients, memory growth."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asearcher_jax.model import attention, sharding, transformer
from asearcher_jax.model.config import ModelConfig


def _packed(b: int, t: int, h: int, kv: int, hd: int, *, seed: int = 0, dtype=jnp.float32):
  """q, k, v and segment ids of packed rows: 3-4 segments each, then trailing padding (id 0)."""
  rng = np.random.default_rng(seed)
  q, k, v = (
    jnp.asarray(rng.standard_normal(shape), dtype)
    for shape in ((b, t, h, hd), (b, t, kv, hd), (b, t, kv, hd))
  )
  seg = np.zeros((b, t), np.int32)
  for row in range(b):
    end = t - int(rng.integers(1, max(2, t // 4)))
    cuts = np.sort(rng.choice(np.arange(1, end), size=min(3, end - 1), replace=False))
    for sid, (lo, hi) in enumerate(zip(np.r_[0, cuts], np.r_[cuts, end], strict=True), 1):
      seg[row, lo:hi] = sid
  return q, k, v, jnp.asarray(seg)


def _dense(q, k, v, seg):
  return attention.attend_causal(q, k, v, attention.packed_mask(seg), 16)


def _loss_and_grads(fn):
  """A scalar that weighs every output differently (so any misplaced row shows), and its
  gradients with respect to q, k and v."""

  def loss(q, k, v, seg):
    out = fn(q, k, v, seg).astype(jnp.float32)
    weights = jnp.sin(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
    return jnp.mean(out * weights)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _max_diffs(a, b):
  (la, ga), (lb, gb) = a, b
  return float(abs(la - lb)), [float(jnp.max(jnp.abs(x - y))) for x, y in zip(ga, gb, strict=True)]


def test_resolve_attention_by_target_platform():
  assert attention.resolve_attention("auto", "tpu") == "splash"
  assert attention.resolve_attention("auto", "gpu") == "flash"
  assert attention.resolve_attention("auto", "cuda") == "flash"
  assert attention.resolve_attention("auto", "cpu") == "flash"
  assert attention.resolve_attention("dense", "tpu") == "dense"  # an explicit choice stays
  # An AOT compile for TPU on a CPU host resolves before tracing; the model keeps its choice.
  cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                    num_heads=2, num_kv_heads=1)  # fmt: skip
  assert cfg.attention == "auto"
  assert cfg.replace(attention=attention.resolve_attention(cfg.attention, "tpu")).attention == (
    "splash"
  )
  with pytest.raises(ValueError, match=r"ModelConfig\.attention must be one of"):
    cfg.replace(attention="flashy")
  with pytest.raises(ValueError, match=r"ModelConfig\.attention must be one of"):
    attention.resolve_attention("flashy", "cpu")
  with pytest.raises(ValueError, match=r"ModelConfig\.flash_block must be positive"):
    cfg.replace(flash_block=0)


@pytest.mark.parametrize(
  "t,block,heads,kv_heads",
  [
    pytest.param(64, 16, 4, 2, marks=pytest.mark.slow),  # 4 blocks, GQA
    pytest.param(50, 16, 4, 4, marks=pytest.mark.slow),  # T not a block multiple (padded), MHA
    (12, 32, 4, 1),  # T shorter than one block, MQA
  ],
)
def test_flash_matches_dense_fp32(t, block, heads, kv_heads):
  q, k, v, seg = _packed(2, t, heads, kv_heads, 8, seed=t)
  flash = _loss_and_grads(lambda q, k, v, s: attention.flash_causal(q, k, v, s, block))
  np.testing.assert_allclose(
    np.asarray(attention.flash_causal(q, k, v, seg, block)),
    np.asarray(_dense(q, k, v, seg)),
    atol=1e-5,
    rtol=0,
  )
  loss_diff, grad_diffs = _max_diffs(flash(q, k, v, seg), _loss_and_grads(_dense)(q, k, v, seg))
  assert loss_diff <= 1e-5
  assert max(grad_diffs) <= 1e-5, grad_diffs


def _relative_diffs(a, ref):
  """|a - ref| / max |ref| of the loss and of each gradient."""
  (la, ga), (lr, gr) = a, ref
  grads = [
    float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y))) for x, y in zip(ga, gr, strict=True)
  ]
  return [float(abs(la - lr) / abs(lr)), *grads]


@pytest.mark.slow  # > 10 s on 2 cores
def test_flash_bf16_within_its_rounding():
  """bf16 inputs (fp32 softmax statistics inside) against the fp32 reference on the same rounded
  inputs. Tolerance: relative error <= 2^-6 (4 bf16 ulps; measured ~2^-8, what dense-in-bf16
  gets too) and no worse than dense-in-bf16's error doubled plus one ulp."""
  q, k, v, seg = _packed(2, 64, 4, 2, 16, seed=3, dtype=jnp.bfloat16)
  q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
  ref = _loss_and_grads(_dense)(q32, k32, v32, seg)
  flash = _loss_and_grads(lambda q, k, v, s: attention.flash_causal(q, k, v, s, 16))(q, k, v, seg)
  dense = _loss_and_grads(_dense)(q, k, v, seg)
  ulp = 2.0**-8
  flash_err, dense_err = _relative_diffs(flash, ref), _relative_diffs(dense, ref)
  for f, d in zip(flash_err, dense_err, strict=True):
    assert f <= 4 * ulp and f <= 2 * d + ulp, (flash_err, dense_err)
  out = attention.flash_causal(q, k, v, seg, 16)
  assert out.dtype == jnp.bfloat16
  want = _dense(q32, k32, v32, seg)
  assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - want))) <= 4 * ulp * float(
    jnp.max(jnp.abs(want))
  )


def _tiny(attn: str, **kw) -> transformer.Transformer:
  cfg = ModelConfig(
    vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
    num_kv_heads=2, rope_theta=10000.0, attention=attn, flash_block=8, **kw,
  )  # fmt: skip
  return transformer.Transformer(cfg, rngs=nnx.Rngs(3))


def _packed_tokens(rows: int, t: int):
  _, _, _, seg = _packed(rows, t, 1, 1, 1, seed=11)
  seg = np.asarray(seg)
  pos = np.zeros_like(seg)
  for r in range(rows):
    for sid in np.unique(seg[r]):
      idx = np.flatnonzero(seg[r] == sid)
      pos[r, idx] = np.arange(len(idx))
  tokens = np.random.default_rng(12).integers(0, 61, seg.shape)
  return jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg)


@pytest.mark.slow  # > 10 s on 2 cores
def test_transformer_flash_equals_dense_logits_scores_and_param_grads():
  tokens, pos, seg = _packed_tokens(2, 30)  # 30 tokens: 4 flash blocks of 8, the last padded
  dense, flash = _tiny("dense"), _tiny("flash")

  np.testing.assert_allclose(
    np.asarray(nnx.jit(lambda m: m(tokens, pos, seg))(flash)),
    np.asarray(nnx.jit(lambda m: m(tokens, pos, seg))(dense)),
    atol=1e-5,
    rtol=0,
  )

  def loss(model):
    lp = transformer.score(model, tokens, pos, seg)
    return -jnp.mean(lp)

  (loss_d, grads_d), (loss_f, grads_f) = (
    nnx.jit(nnx.value_and_grad(loss))(m) for m in (dense, flash)
  )
  assert abs(float(loss_d) - float(loss_f)) <= 1e-5
  leaves_d, leaves_f = jax.tree.leaves(grads_d), jax.tree.leaves(grads_f)
  assert len(leaves_d) == len(leaves_f) > 10
  for a, b in zip(leaves_d, leaves_f, strict=True):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)


@pytest.mark.slow  # > 10 s on 2 cores
def test_transformer_flash_under_remat_equals_dense():
  tokens, pos, seg = _packed_tokens(1, 20)

  def loss(model):
    return -jnp.mean(transformer.score(model, tokens, pos, seg))

  g_dense = nnx.jit(nnx.grad(loss))(_tiny("dense"))
  g_flash = nnx.jit(nnx.grad(loss))(_tiny("flash", remat_policy="full"))
  for a, b in zip(jax.tree.leaves(g_dense), jax.tree.leaves(g_flash), strict=True):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=0)


def _attention_temp_bytes(fn, t: int) -> int:
  """Compiled temporary bytes of one attention forward + backward at T tokens (XLA:CPU)."""
  q = jax.ShapeDtypeStruct((1, t, 4, 32), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, t, 2, 32), jnp.float32)
  seg = jax.ShapeDtypeStruct((1, t), jnp.int32)

  def loss(q, k, v, s):
    return jnp.sum(fn(q, k, v, s))

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow  # > 10 s on 2 cores
def test_flash_memory_grows_linearly_dense_quadratically():
  """4x the tokens: flash's temporaries grow < 6x, dense's > 10x (it keeps [T, T] arrays)."""
  flash = lambda q, k, v, s: attention.flash_causal(q, k, v, s, 128)  # noqa: E731
  dense = lambda q, k, v, s: attention.attend_causal(q, k, v, attention.packed_mask(s), 256)  # noqa: E731
  f_small, f_big = _attention_temp_bytes(flash, 512), _attention_temp_bytes(flash, 2048)
  d_small, d_big = _attention_temp_bytes(dense, 512), _attention_temp_bytes(dense, 2048)
  assert f_big / f_small < 6, (f_small, f_big)
  assert d_big / d_small > 10, (d_small, d_big)
  assert f_big < d_big / 4


def test_splash_interpret_matches_dense():
  """The Pallas kernel (interpret mode, fp32) with segments and GQA; T = 200 is padded to 256."""
  q, k, v, seg = _packed(1, 200, 4, 2, 32, seed=5)
  splash = _loss_and_grads(lambda q, k, v, s: attention.splash_causal(q, k, v, s, interpret=True))
  loss_diff, grad_diffs = _max_diffs(splash(q, k, v, seg), _loss_and_grads(_dense)(q, k, v, seg))
  assert loss_diff <= 1e-5
  assert max(grad_diffs) <= 1e-5, grad_diffs


@pytest.mark.slow  # > 10 s on 2 cores
def test_splash_under_a_mesh_runs_per_shard():
  """Under activation sharding the kernel runs in shard_map over batch (data) and heads (tensor);
  it computes what the unsharded dense reference does."""
  q, k, v, seg = _packed(2, 128, 4, 2, 32, seed=6)
  mesh = sharding.make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4])

  def sharded(q, k, v, s):
    with sharding.activation_sharding(mesh):
      return attention.splash_causal(q, k, v, s, interpret=True)

  loss_diff, grad_diffs = _max_diffs(
    _loss_and_grads(sharded)(q, k, v, seg), _loss_and_grads(_dense)(q, k, v, seg)
  )
  assert loss_diff <= 1e-5
  assert max(grad_diffs) <= 1e-5, grad_diffs
  hlo = jax.jit(sharded).lower(q, k, v, seg).as_text()
  assert "shard_map" in hlo or "manual" in hlo.lower()


_TPU_AOT = """
import jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P
from asearcher_jax.model import attention, sharding
devices = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices
mesh = sharding.make_mesh(data=1, fsdp=2, tensor=2, devices=devices)
q = jax.ShapeDtypeStruct((2, 1024, 4, 128), jnp.bfloat16)
kv = jax.ShapeDtypeStruct((2, 1024, 2, 128), jnp.bfloat16)
seg = jax.ShapeDtypeStruct((2, 1024), jnp.int32)
def loss(q, k, v, s):
  with sharding.activation_sharding(mesh):
    return jnp.sum(attention.splash_causal(q, k, v, s).astype(jnp.float32))
heads, rows = NamedSharding(mesh, P("fsdp", None, "tensor", None)), NamedSharding(mesh, P("fsdp"))
grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), in_shardings=(heads, heads, heads, rows))
compiled = grad.lower(q, kv, kv, seg).compile()
print("MOSAIC", "tpu_custom_call" in compiled.as_text())
"""


@pytest.mark.slow
def test_splash_compiles_for_a_tpu_slice_under_shard_map():
  """The real kernel (not interpret mode), forward and backward, compiled ahead of time for a
  v5p 2x2x1 slice on this CPU host (libtpu's compiler), per shard over fsdp x tensor."""
  import importlib.util
  import os
  import subprocess
  import sys

  if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu is not installed")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
         "TPU_ACCELERATOR_TYPE": "v5p-8"}  # fmt: skip
  out = subprocess.run(
    [sys.executable, "-c", _TPU_AOT], env=env, capture_output=True, text=True, timeout=600
  )
  assert "MOSAIC True" in out.stdout, out.stderr[-3000:]
