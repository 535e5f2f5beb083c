"""Attention kernels of the decoder, behind one choice (`ModelConfig.attention`).

Training and scoring run packed rows: causal attention that never crosses a segment boundary
(`packed_causal`), computed by one of
  * "dense": the reference; a [B, T, T] mask and each query block's fp32 scores kept for the
    backward pass (memory quadratic in T);
  * "flash": blockwise online softmax with a custom VJP (the flash-attention recurrence), pure
    JAX, any backend; memory linear in T;
  * "splash": the Pallas TPU splash-attention kernel that ships with JAX.
"auto" picks one for the target platform (`resolve_attention`). The serving path
(`Transformer.extend`) attends a KV cache under an explicit mask (`attend_blocked`), a fixed one
or a paged one (`paged_attention`, the pure-JAX gather reference of a ragged paged kernel).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from asearcher_jax.model import kv_cache
from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model.config import ATTENTION_CHOICES, ModelConfig

_NEG_INF = -1e30
# Segment id of the positions flash/splash pad a row with up to a whole block: no real token has
# it (real ids are >= 0, padding 0), and a padded query still sees itself, so no row is empty.
_PAD_SEGMENT = -1
# The choice "auto" makes on each platform, flash where unnamed. CPU: flash also trains faster
# than dense at the quickstart's 1-2k-token rows (docs/measurements.md, "Attention memory").
_AUTO = {"tpu": "splash"}


def resolve_attention(choice: str, platform: str) -> str:
  """The attention a model compiled for `platform` ("cpu", "gpu"/"cuda"/"rocm", "tpu") runs.

  Anything but "auto" is returned as is, so an AOT compile for a TPU slice on a CPU host can
  resolve once for its target: `cfg.replace(attention=resolve_attention(cfg.attention, "tpu"))`.
  """
  if choice not in ATTENTION_CHOICES:
    raise ValueError(f"ModelConfig.attention must be one of {ATTENTION_CHOICES}, got {choice!r}")
  if choice != "auto":
    return choice
  return _AUTO.get(platform.lower(), "flash")


def packed_mask(segment_ids: jax.Array) -> jax.Array:
  """[B, T, T] boolean: query t sees key s <= t of the same segment (the dense reference)."""
  t = segment_ids.shape[1]
  causal = jnp.tril(jnp.ones((t, t), bool))[None]
  return causal & (segment_ids[:, :, None] == segment_ids[:, None, :])


def packed_causal(
  q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, cfg: ModelConfig
) -> jax.Array:
  """Causal, segment-separated GQA over packed rows. q [B,T,H,hd], k/v [B,T,K,hd] -> [B,T,H,hd]."""
  choice = resolve_attention(cfg.attention, jax.default_backend())
  if choice == "flash":
    return flash_causal(q, k, v, segment_ids, cfg.flash_block)
  if choice == "splash":
    return splash_causal(q, k, v, segment_ids, interpret=cfg.attention_interpret)
  return attend_causal(q, k, v, packed_mask(segment_ids), cfg.attention_block)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Grouped-query attention. q: [B,T,H,hd], k/v: [B,S,K,hd], mask: [B,T,S] -> [B,T,H,hd].

  The G query heads that share a key head are folded into the query length, so both products
  are plain batched matmuls over [B, K] (about 2x faster on CPU than the 5-D einsum).
  """
  b, t, h, hd = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  g = h // kv_heads
  qg = q.reshape(b, t, kv_heads, g, hd).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, g * t, hd)
  kt = k.transpose(0, 2, 3, 1)  # [B, K, hd, S]
  scores = jnp.matmul(qg, kt.astype(qg.dtype), preferred_element_type=jnp.float32)
  scores = scores.reshape(b, kv_heads, g, t, s) * (hd**-0.5)
  scores = jnp.where(mask[:, None, None, :, :], scores, _NEG_INF)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, kv_heads, g * t, s)
  out = jnp.matmul(probs, v.transpose(0, 2, 1, 3))  # [B, K, G*T, hd]
  return out.reshape(b, kv_heads, g, t, hd).transpose(0, 3, 1, 2, 4).reshape(b, t, h, hd)


def attend_causal(
  q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, block: int
) -> jax.Array:
  """Causal attention over [B, T] computed in query blocks, each against only the keys at or
  before its end: skips ~(1 - (n+1)/2n) of the score matrix that causality masks anyway."""
  t = q.shape[1]
  if block <= 0 or t <= block or t % block:
    return attend(q, k, v, mask)
  outs = []
  for i in range(t // block):
    q_sl, end = slice(i * block, (i + 1) * block), (i + 1) * block
    outs.append(attend(q[:, q_sl], k[:, :end], v[:, :end], mask[:, q_sl, :end]))
  return jnp.concatenate(outs, axis=1)


def attend_blocked(
  q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, block: int, *, causal: bool
) -> jax.Array:
  """Attention over many queries in blocks of `block`, so the [B, H, T, S] score tensor is never
  whole: a prefill of 8 prompts x 2,048 tokens would otherwise hold ~0.5 GB of f32 scores per
  copy (measured: +1.9 GB peak RSS in the quickstart's engine). causal: query t sits at position
  t (a prefill into an empty cache), so each block also skips the keys after its end."""
  if causal:
    return attend_causal(q, k, v, mask, block)
  t = q.shape[1]
  if block <= 0 or t <= block:
    return attend(q, k, v, mask)
  outs = []
  for i in range(0, t, block):
    sl = slice(i, min(i + block, t))
    outs.append(attend(q[:, sl], k, v, mask[:, sl]))
  return jnp.concatenate(outs, axis=1)


def paged_attention(
  q: jax.Array,
  kv_pages: jax.Array,
  table: jax.Array,
  positions: jax.Array,
  attend_len: int,
  block: int,
  *,
  causal: bool = False,
) -> jax.Array:
  """Attention of queries q [B, T, H, hd] at positions [B, T] over each row's own pages: table
  [B, n] (n * page_size >= attend_len) names the pages holding the row's positions 0, 1, ...;
  query t sees the keys at positions <= positions[b, t] (its own length) and nothing beyond.

  The reference ("gather"): the row's pages are gathered end to end into the [B, attend_len]
  layout a fixed cache has and attended exactly as `attend_blocked` does, so both layouts give
  the same numbers. The pool is combined, [num_pages, page_size, 2K, hd] (`kv_cache.PagedKVCache`;
  K may be the model's heads repeated, which grouped-query attention reads the same)."""
  keys, values = kv_cache.paged_gather(kv_pages, table)
  keys, values = keys[:, :attend_len].astype(q.dtype), values[:, :attend_len].astype(q.dtype)
  mask = jnp.arange(attend_len)[None, None, :] <= positions[:, :, None]
  return attend_blocked(q, keys, values, mask, block, causal=causal)


def _pad_rows(
  q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, multiple: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Pads T up to a multiple of `multiple`; the padded positions form their own segment."""
  pad = -q.shape[1] % multiple
  if not pad:
    return q, k, v, segment_ids
  widths = ((0, 0), (0, pad), (0, 0), (0, 0))
  return (
    jnp.pad(q, widths),
    jnp.pad(k, widths),
    jnp.pad(v, widths),
    jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=_PAD_SEGMENT),
  )


# ---- flash: blockwise online softmax, custom VJP ----------------------------------------------


def flash_causal(
  q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, block: int
) -> jax.Array:
  """Packed causal GQA whose memory is linear in T. q [B,T,H,hd], k/v [B,T,K,hd] -> [B,T,H,hd].

  Query and key blocks are both `block` long (T is padded up to a multiple; a row shorter than a
  block is one block). Each query block visits only the key blocks at or before it; the forward
  keeps the output and the per-row logsumexp, and the backward recomputes every block's scores,
  so no [T, T] array (scores or mask) exists at any point.
  """
  if block <= 0:
    raise ValueError(f"ModelConfig.flash_block must be positive, got {block}")
  t = q.shape[1]
  blk = min(block, t)
  q, k, v, seg = _pad_rows(q, k, v, segment_ids, blk)
  return _flash(q, k, v, seg.astype(jnp.int32), blk)[:, :t]


def _q_blocks(x, kv_heads, blk):
  """[B, T, H, hd] -> [n, B, K, G*blk, hd]: the G query heads of a key head folded into rows (as
  `attend` does), so every block product is a plain batched matmul over [B, K]."""
  b, t, h, hd = x.shape
  n, g = t // blk, h // kv_heads
  x = x.reshape(b, n, blk, kv_heads, g, hd).transpose(1, 0, 3, 4, 2, 5)
  return x.reshape(n, b, kv_heads, g * blk, hd)


def _kv_blocks(x, blk):
  """[B, T, K, hd] -> [n, B, K, blk, hd]."""
  b, t, kv_heads, hd = x.shape
  return x.reshape(b, t // blk, blk, kv_heads, hd).transpose(1, 0, 3, 2, 4)


def _from_blocks(xb, b, g):
  """Inverse of `_q_blocks`: [n, B, K, G*blk, hd] -> [B, T, H, hd]."""
  n, _, kvh, rows, hd = xb.shape
  blk = rows // g
  x = xb.reshape(n, b, kvh, g, blk, hd).transpose(1, 0, 4, 2, 3, 5)
  return x.reshape(b, n * blk, kvh * g, hd)


def _block_mask(sb, i, j, blk, g):
  """[B, 1, G*blk, blk]: query block i sees key block j (same segment, not in the future)."""
  sq, sk = sb[i], sb[j]
  same = sq[:, :, None] == sk[:, None, :]
  pos = jnp.arange(blk)
  causal = (i * blk + pos)[:, None] >= (j * blk + pos)[None, :]
  mask = same & causal[None]  # [B, blk, blk]
  b = mask.shape[0]
  return jnp.broadcast_to(mask[:, None, None], (b, 1, g, blk, blk)).reshape(b, 1, g * blk, blk)


def _scores(qi, kj, scale):
  return jnp.matmul(qi, kj.swapaxes(-1, -2), preferred_element_type=jnp.float32) * scale


def _flash_forward(qb, kb, vb, sb, g):
  n, b, kvh, rows, hd = qb.shape
  blk = rows // g
  scale = hd**-0.5

  def one_query_block(i, qi):
    def body(j, carry):
      m, denom, acc = carry
      kj, vj = kb[j], vb[j]
      mask = _block_mask(sb, i, j, blk, g)
      s = jnp.where(mask, _scores(qi, kj, scale), _NEG_INF)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
      corr = jnp.exp(m - m_new)
      pv = jnp.matmul(p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
      return m_new, denom * corr + p.sum(-1), acc * corr[..., None] + pv

    init = (
      jnp.full((b, kvh, rows), _NEG_INF, jnp.float32),
      jnp.zeros((b, kvh, rows), jnp.float32),
      jnp.zeros((b, kvh, rows, hd), jnp.float32),
    )
    m, denom, acc = jax.lax.fori_loop(0, i + 1, body, init)  # key blocks after i: all future
    return (acc / denom[..., None]).astype(qb.dtype), m + jnp.log(denom)

  def step(_, xs):
    i, qi = xs
    return None, one_query_block(i, qi)

  _, (ob, lse) = jax.lax.scan(step, None, (jnp.arange(n), qb))
  return ob, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, seg, blk):
  out, _ = _flash_fwd(q, k, v, seg, blk)
  return out


def _flash_fwd(q, k, v, seg, blk):
  g = q.shape[2] // k.shape[2]
  kvh = k.shape[2]
  qb, kb, vb = _q_blocks(q, kvh, blk), _kv_blocks(k, blk), _kv_blocks(v, blk)
  sb = seg.reshape(seg.shape[0], -1, blk).transpose(1, 0, 2)  # [n, B, blk]
  ob, lse = _flash_forward(qb, kb, vb, sb, g)
  return _from_blocks(ob, q.shape[0], g), (qb, kb, vb, sb, ob, lse)


def _flash_bwd(blk, res, dout):
  """FlashAttention-2's backward: per key block, the query blocks at or after it recompute their
  probabilities from the saved logsumexp; dK, dV accumulate in the loop, dQ in one fp32 carry."""
  qb, kb, vb, sb, ob, lse = res
  n, b, kvh, rows, hd = qb.shape
  g = rows // blk
  scale = hd**-0.5
  dob = _q_blocks(dout, kvh, blk)
  delta = jnp.sum(dob.astype(jnp.float32) * ob.astype(jnp.float32), axis=-1)  # [n, B, K, rows]

  def one_key_block(j, dq):
    kj, vj = kb[j], vb[j]

    def body(i, carry):
      dk, dv, dq = carry
      qi, doi = qb[i], dob[i]
      mask = _block_mask(sb, i, j, blk, g)
      p = jnp.where(mask, jnp.exp(_scores(qi, kj, scale) - lse[i][..., None]), 0.0)
      dv = dv + jnp.matmul(p.astype(doi.dtype).swapaxes(-1, -2), doi,
                           preferred_element_type=jnp.float32)  # fmt: skip
      dp = jnp.matmul(doi, vj.swapaxes(-1, -2), preferred_element_type=jnp.float32)
      ds = (p * (dp - delta[i][..., None]) * scale).astype(qi.dtype)
      dk = dk + jnp.matmul(ds.swapaxes(-1, -2), qi, preferred_element_type=jnp.float32)
      dqi = dq[i] + jnp.matmul(ds, kj, preferred_element_type=jnp.float32)
      return dk, dv, jax.lax.dynamic_update_index_in_dim(dq, dqi, i, 0)

    zeros = jnp.zeros((b, kvh, blk, hd), jnp.float32)
    dk, dv, dq = jax.lax.fori_loop(j, n, body, (zeros, zeros, dq))  # query blocks before j: none
    return dq, (dk, dv)

  def step(dq, j):
    return one_key_block(j, dq)

  dq0 = jnp.zeros(qb.shape, jnp.float32)
  dq, (dkb, dvb) = jax.lax.scan(step, dq0, jnp.arange(n))
  dq = _from_blocks(dq, b, g).astype(qb.dtype)
  dk = dkb.transpose(1, 0, 3, 2, 4).reshape(b, n * blk, kvh, hd).astype(kb.dtype)
  dv = dvb.transpose(1, 0, 3, 2, 4).reshape(b, n * blk, kvh, hd).astype(vb.dtype)
  return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---- splash: the Pallas TPU kernel ------------------------------------------------------------

# Largest splash block that divides the (128-padded) row: 512 keeps the kernel's tiles large on
# v4-v6 (MaxText's default); the kernel's key blocks must be multiples of 128 lanes.
_SPLASH_BLOCKS = (512, 256, 128)


def splash_causal(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  segment_ids: jax.Array,
  *,
  interpret: bool = False,
) -> jax.Array:
  """Packed causal GQA through JAX's Pallas splash-attention kernel (TPU; CPU only with
  interpret=True). q [B,T,H,hd], k/v [B,T,K,hd] -> [B,T,H,hd].

  T is padded to a multiple of 128 (a segment of its own) and the block is the largest of
  512/256/128 dividing it. Under `sharding.activation_sharding` the kernel runs per shard
  (`shard_map`): batch over the mesh's batch axes, heads over tensor, as the constraints on q lay
  them out; a kernel call sees whole rows. The kernel shares each key head among its G query
  heads itself, so k/v are not repeated (unless the tensor axis splits the key heads unevenly).
  """
  b, t, h, hd = q.shape
  kvh = k.shape[2]
  q, k, v, seg = _pad_rows(q, k, v, segment_ids, 128)
  tp = q.shape[1]
  blk = next(x for x in _SPLASH_BLOCKS if tp % x == 0)
  # The kernel applies no softmax scale: fold it into q (what MaxText does).
  q = (q * hd**-0.5).astype(q.dtype).transpose(0, 2, 1, 3)  # [B, H, T, hd]
  k, v, seg = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), seg.astype(jnp.int32)
  kernel = functools.partial(_splash_local, block=blk, interpret=interpret)
  ctx = sharding_lib.activation_context()
  if ctx is None:
    out = kernel(q, k, v, seg)
  else:
    mesh, rules = ctx
    spec = sharding_lib.logical_to_spec(("batch", "length", "act_heads", None), (b, t, h, hd),
                                        mesh, rules)  # fmt: skip
    batch_spec, head_spec = spec[0], spec[2]
    if head_spec is not None:
      shards = sharding_lib.axis_size(mesh, head_spec)
      if kvh % shards:  # key heads cannot follow their query heads: one per query head
        k, v = jnp.repeat(k, h // kvh, axis=1), jnp.repeat(v, h // kvh, axis=1)
    qkv_spec = jax.sharding.PartitionSpec(batch_spec, head_spec, None, None)
    out = jax.shard_map(
      kernel,
      mesh=mesh,
      in_specs=(qkv_spec, qkv_spec, qkv_spec, jax.sharding.PartitionSpec(batch_spec, None)),
      out_specs=qkv_spec,
      check_vma=False,
    )(q, k, v, seg)
  return out.transpose(0, 2, 1, 3)[:, :t]


def _splash_local(q, k, v, seg, *, block, interpret):
  """One shard: q [b, h, T, hd], k/v [b, kv, T, hd], seg [b, T] -> [b, h, T, hd]."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

  heads, t = q.shape[1], q.shape[2]
  mask = masks.MultiHeadMask([masks.CausalMask((t, t))] * heads)
  sizes = splash.BlockSizes(
    block_q=block, block_kv=block, block_kv_compute=block,
    block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
    block_q_dq=block, block_kv_dq=block,
  )  # fmt: skip
  kernel = splash.make_splash_mha(
    mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
  )
  return jax.vmap(kernel)(q, k, v, segment_ids=splash.SegmentIds(q=seg, kv=seg))
