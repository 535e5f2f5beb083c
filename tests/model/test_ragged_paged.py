"""model/ragged_paged.py on CPU: the gather reference against JAX's own ragged paged attention
reference on mixed prefill + decode batches, the layout conversion the kernel needs, and the
decode entry point against plain attention over the same keys laid end to end. (The Pallas
kernel itself does not run in jax 0.10.2's TPU interpret mode; it is compiled for TPU in
benchmarks/aot_compile.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

from asearcher_jax.model import attention, ragged_paged

H, K, HD, PS, PAGES, PPS = 8, 2, 32, 8, 40, 6


def _batch(seqs: list[tuple[int, int]], max_seqs: int, tokens: int, seed: int = 0):
  """A ragged batch: seqs = (new query tokens, length incl. them) per sequence; the pages of
  every sequence drawn at random from the pool (page 0 left unused, as the engine's null page)."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((tokens, H, HD)), jnp.float32)
  k_pages = jnp.asarray(rng.standard_normal((PAGES, PS, K, HD)), jnp.float32)
  v_pages = jnp.asarray(rng.standard_normal((PAGES, PS, K, HD)), jnp.float32)
  table = np.zeros((max_seqs, PPS), np.int32)
  free = rng.permutation(np.arange(1, PAGES))
  lengths = np.zeros((max_seqs,), np.int32)
  cu = np.zeros((max_seqs + 1,), np.int32)
  for i, (q_len, kv_len) in enumerate(seqs):
    need = -(-kv_len // PS)
    table[i, :need], free = free[:need], free[need:]
    lengths[i] = kv_len
    cu[i + 1] = cu[i] + q_len
  cu[len(seqs) + 1 :] = cu[len(seqs)]
  num = np.array([len(seqs)], np.int32)
  return q, k_pages, v_pages, *(jnp.asarray(x) for x in (lengths, table, cu, num))


MIXED = [
  [(5, 21), (1, 40), (1, 9), (3, 3)],  # suffix prefill, two decodes, a fresh prefill
  [(1, 48), (8, 30), (1, 1)],  # a full-table decode, a chunk, a length-1 decode
]


@pytest.mark.parametrize("seqs", MIXED)
def test_reference_matches_jax_ragged_paged_reference(seqs):
  q, kp, vp, lengths, table, cu, num = _batch(seqs, max_seqs=6, tokens=16)
  ours = ragged_paged.reference(q, kp, vp, lengths, table, cu, num)
  theirs = rpa.ref_ragged_paged_attention(
    q, ragged_paged.combine_kv(kp, vp), lengths, table, cu, num, sm_scale=HD**-0.5
  )
  n = int(cu[int(num[0])])
  np.testing.assert_allclose(np.asarray(ours[:n]), np.asarray(theirs), atol=1e-5, rtol=1e-5)
  assert not np.asarray(ours[n:]).any()  # padding tokens past the last sequence
  # jittable with static shapes (what an engine step needs)
  jitted = jax.jit(ragged_paged.reference)(q, kp, vp, lengths, table, cu, num)
  np.testing.assert_allclose(np.asarray(jitted), np.asarray(ours), atol=1e-6)


def test_combined_layout_round_trips_and_interleaves_heads():
  _, kp, vp, *_ = _batch([(1, 8)], max_seqs=1, tokens=1)
  kv = ragged_paged.combine_kv(kp, vp)
  assert kv.shape == (PAGES, PS, 2 * K, HD)
  np.testing.assert_array_equal(np.asarray(kv[:, :, 2]), np.asarray(kp[:, :, 1]))
  np.testing.assert_array_equal(np.asarray(kv[:, :, 3]), np.asarray(vp[:, :, 1]))
  k2, v2 = ragged_paged.split_kv(kv)
  np.testing.assert_array_equal(np.asarray(k2), np.asarray(kp))
  np.testing.assert_array_equal(np.asarray(v2), np.asarray(vp))


def test_decode_entry_point_matches_contiguous_attention():
  seqs = [(1, 17), (1, 48), (1, 1), (1, 30)]
  q, kp, vp, lengths, table, *_ = _batch(seqs, max_seqs=4, tokens=4, seed=3)
  out = ragged_paged.paged_decode_attention(q, kp, vp, lengths, table, kernel=False)
  keys = kp[table].reshape(4, PPS * PS, K, HD)
  values = vp[table].reshape(4, PPS * PS, K, HD)
  mask = (jnp.arange(PPS * PS)[None, :] < lengths[:, None])[:, None, :]
  want = attention.attend(q[:, None], keys, values, mask)[:, 0]
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_kernel_block_sizes_are_explicit_and_checked():
  with pytest.raises(ValueError, match="RaggedBlocks"):
    ragged_paged.RaggedBlocks(kv_pages_per_block=0)
  # Lowered for a TPU it never asks the local (CPU) device for its tuned block sizes; here the
  # trace alone shows the explicit sizes reach the kernel (its lowering needs a TPU target).
  # Shapes the kernel tiles: head_dim 128 (its lane width).
  f32, i32 = jnp.float32, jnp.int32
  args = (jax.ShapeDtypeStruct((16, 4, 128), f32), jax.ShapeDtypeStruct((PAGES, PS, 2, 128), f32),
          jax.ShapeDtypeStruct((PAGES, PS, 2, 128), f32), jax.ShapeDtypeStruct((6,), i32),
          jax.ShapeDtypeStruct((6, PPS), i32), jax.ShapeDtypeStruct((7,), i32),
          jax.ShapeDtypeStruct((1,), i32))  # fmt: skip
  blocks = ragged_paged.RaggedBlocks(kv_pages_per_block=2, queries_per_block=8)
  jaxpr = str(
    jax.make_jaxpr(lambda *a: ragged_paged.ragged_paged_attention(*a, blocks=blocks))(*args)
  )
  assert "ragged_paged_attention_kernel" in jaxpr


def paged_run(model, prompts, steps, *, repeat=1, layout=None, page_size=4, pages_per_seq=8):
  """Prefill every prompt in one ragged step, then `steps` greedy decode steps of all of them,
  through `ragged_paged.paged_step` (reference attention); returns tokens [S, steps + 1] and the
  pools. Sequence s owns pages 1 + s * pages_per_seq ... (page 0 is the null page). layout:
  (mesh, rules, pool sharding) to run sharded (weights placed by the rules)."""
  cfg = model.cfg
  s = len(prompts)
  table = jnp.asarray(1 + np.arange(s * pages_per_seq).reshape(s, pages_per_seq), jnp.int32)
  heads = cfg.num_kv_heads * repeat
  pools = tuple(
    jnp.zeros((1 + s * pages_per_seq, page_size, 2 * heads, cfg.resolved_head_dim), jnp.float32)
    for _ in range(cfg.num_layers)
  )

  def run(t, p, kv, ln, cu):
    return ragged_paged.paged_step(
      model, t, p, kv, table, ln, cu, jnp.array([s], jnp.int32), kernel=False, repeat=repeat
    )

  step = jax.jit(run)
  if layout is not None:
    from flax import nnx

    from asearcher_jax.model import sharding as sharding_lib

    mesh, rules, pool_sharding = layout
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, jax.device_put(state, sharding_lib.param_shardings(state, mesh,
                                                                                   rules)))  # fmt: skip
    pools = jax.device_put(pools, pool_sharding)

    def sharded(*a):
      with sharding_lib.activation_sharding(mesh, rules):
        return run(*a)

    step = jax.jit(sharded, out_shardings=(None, (pool_sharding,) * cfg.num_layers))
  lens = np.array([len(p) for p in prompts], np.int32)
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  tokens = np.concatenate(prompts).astype(np.int32)
  positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
  logits, pools = step(jnp.asarray(tokens), jnp.asarray(positions), pools, jnp.asarray(lens),
                       jnp.asarray(cu))  # fmt: skip
  out = [np.asarray(jnp.argmax(logits, -1))]
  for _ in range(steps):
    positions = lens.copy()
    lens = lens + 1
    logits, pools = step(jnp.asarray(out[-1], jnp.int32), jnp.asarray(positions), pools,
                         jnp.asarray(lens), jnp.arange(s + 1, dtype=jnp.int32))  # fmt: skip
    out.append(np.asarray(jnp.argmax(logits, -1)))
  return np.stack(out, axis=1), pools


def _fixed_run(model, prompts, steps):
  """The same greedy tokens through `Transformer.extend` on a fixed KVCache, one row a prompt."""
  from asearcher_jax.model.kv_cache import KVCache

  out = []
  for prompt in prompts:
    cache = KVCache.init(model.cfg, 1, 32, dtype="float32")
    logits, cache = model.extend(jnp.asarray([prompt], jnp.int32), jnp.zeros((1,), jnp.int32),
                                 cache)  # fmt: skip
    row, n = [int(jnp.argmax(logits[0, -1]))], len(prompt)
    for _ in range(steps):
      logits, cache = model.extend(jnp.asarray([[row[-1]]], jnp.int32),
                                   jnp.asarray([n], jnp.int32), cache)  # fmt: skip
      row.append(int(jnp.argmax(logits[0, -1])))
      n += 1
    out.append(row)
  return np.asarray(out)


PROMPTS = ([3, 17, 99, 4, 8], [120, 5], [7] * 11)


@pytest.mark.slow
def test_paged_step_mirrors_the_transformer_on_mixed_batches():
  from flax import nnx

  from asearcher_jax.model import transformer
  from tests.model.test_model import small_cfg

  model = transformer.Transformer(small_cfg(vocab_size=128), rngs=nnx.Rngs(0))
  paged, _ = paged_run(model, PROMPTS, steps=6)
  np.testing.assert_array_equal(paged, _fixed_run(model, PROMPTS, steps=6))
