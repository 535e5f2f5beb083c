"""Attention kernels of the decoder, behind one choice (`ModelConfig.attention`).

Training and scoring run packed rows: causal attention that never crosses a segment boundary
(`packed_causal`). The serving path (`Transformer.extend`) attends a KV cache under an explicit
mask (`attend_blocked`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from asearcher_jax.model.config import ModelConfig

_NEG_INF = -1e30


def packed_mask(segment_ids: jax.Array) -> jax.Array:
  """[B, T, T] boolean: query t sees key s <= t of the same segment (the dense reference)."""
  t = segment_ids.shape[1]
  causal = jnp.tril(jnp.ones((t, t), bool))[None]
  return causal & (segment_ids[:, :, None] == segment_ids[:, None, :])


def packed_causal(
  q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, cfg: ModelConfig
) -> jax.Array:
  """Causal, segment-separated GQA over packed rows. q [B,T,H,hd], k/v [B,T,K,hd] -> [B,T,H,hd]."""
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
