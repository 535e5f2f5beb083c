"""Ragged paged attention: JAX's Pallas TPU kernel over our page layout, and a pure-JAX reference.

The kernel (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`, the one vLLM's TPU backend
runs) attends a ragged batch -- sequences with any number of new query tokens each, prefill and
decode mixed -- over a paged KV cache, each sequence over its own length only. Its inputs:
  q            [tokens, q_heads, head_dim]: every sequence's new queries end to end;
  kv_pages     [num_pages, page_size, 2 * kv_heads, head_dim]: keys and values of one head
               interleaved (k at even, v at odd combined heads);
  kv_lens      [max_seqs] int32: each sequence's length, its new tokens included;
  page_indices [max_seqs, pages_per_seq] int32: the page table;
  cu_q_lens    [max_seqs + 1] int32: where each sequence's queries start in q;
  num_seqs     [1] int32: how many of the rows are real.
Our paged cache stores this combined layout (`kv_cache.PagedKVCache.kv`), so the engine runs the
kernel on its pools in place (`Transformer.extend` over a cache whose `attention` is "ragged",
through `attention`); `combine_kv` / `split_kv` convert separate k/v pools for tests.

Block sizes are explicit (`RaggedBlocks`): left unset, the kernel looks them up from the local
device's kind (`jax.devices()[0].device_kind`), which on a host compiling ahead of time for a TPU
that is not there is the CPU and raises. Nothing else in the kernel reads the local device.

On CPU the kernel does not run: jax 0.10.2's TPU interpret mode rejects the kernel's reshaped
refs (`'ReshapeTransform' object has no attribute 'indices'`). `reference` (a gather over the
same inputs) runs everywhere and is what CPU tests check against JAX's own
`ref_ragged_paged_attention`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.model.kv_cache import combine_kv, split_kv

_NEG_INF = -1e30


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedBlocks:
  """The kernel's tiling, given rather than looked up from the local device."""

  # KV pages each flash-attention block of the kernel reads (at most pages_per_seq).
  kv_pages_per_block: int = 8
  # Query tokens per block of the kernel's grid.
  queries_per_block: int = 32
  # VMEM the kernel may use; None: the compiler's default.
  vmem_limit_bytes: int | None = 64 * 2**20

  def __post_init__(self):
    if self.kv_pages_per_block <= 0 or self.queries_per_block <= 0:
      raise ValueError(
        f"RaggedBlocks.kv_pages_per_block and queries_per_block must be positive, got "
        f"{self.kv_pages_per_block}, {self.queries_per_block}"
      )


def ragged_paged_attention_combined(
  q: jax.Array,
  kv_pages: jax.Array,
  lengths: jax.Array,
  page_table: jax.Array,
  cu_q_lens: jax.Array,
  num_seqs: jax.Array,
  *,
  blocks: RaggedBlocks = RaggedBlocks(),
  sm_scale: float | None = None,
) -> jax.Array:
  """The TPU kernel on a combined cache: q [tokens, H, hd] -> [tokens, H, hd] (see the module
  docstring for the inputs). sm_scale None: head_dim ** -0.5."""
  from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

  pages_per_seq = page_table.shape[1]
  return rpa.ragged_paged_attention(
    q, kv_pages, lengths, page_table, cu_q_lens, num_seqs,
    sm_scale=q.shape[-1] ** -0.5 if sm_scale is None else sm_scale,
    num_kv_pages_per_block=min(blocks.kv_pages_per_block, pages_per_seq),
    num_queries_per_block=min(blocks.queries_per_block, q.shape[0]),
    vmem_limit_bytes=blocks.vmem_limit_bytes,
  )  # fmt: skip


def ragged_paged_attention(
  q: jax.Array,
  k_pages: jax.Array,
  v_pages: jax.Array,
  lengths: jax.Array,
  page_table: jax.Array,
  cu_q_lens: jax.Array,
  num_seqs: jax.Array,
  *,
  blocks: RaggedBlocks = RaggedBlocks(),
  sm_scale: float | None = None,
) -> jax.Array:
  """The TPU kernel over our separate k/v pools (interleaved on the way in: a copy of the pool)."""
  return ragged_paged_attention_combined(
    q, combine_kv(k_pages, v_pages), lengths, page_table, cu_q_lens, num_seqs,
    blocks=blocks, sm_scale=sm_scale,
  )  # fmt: skip


def reference(
  q: jax.Array,
  k_pages: jax.Array,
  v_pages: jax.Array,
  lengths: jax.Array,
  page_table: jax.Array,
  cu_q_lens: jax.Array,
  num_seqs: jax.Array,
  *,
  sm_scale: float | None = None,
) -> jax.Array:
  """The same attention by gathering: each query token finds its sequence in cu_q_lens, sits at
  position lengths[s] - q_len[s] + its offset, and sees that sequence's keys at or before it.
  Jittable and shape-static; tokens past cu_q_lens[num_seqs] come out 0. Memory: every token's
  sequence gathered whole ([tokens, pages_per_seq * page_size, K, hd]), fine for tests."""
  t, h, hd = q.shape
  k = k_pages.shape[2]
  scale = hd**-0.5 if sm_scale is None else sm_scale
  tok = jnp.arange(t)
  seq = jnp.clip(jnp.searchsorted(cu_q_lens, tok, side="right") - 1, 0, lengths.shape[0] - 1)
  valid = (seq < num_seqs[0]) & (tok < cu_q_lens[num_seqs[0]])
  q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
  pos = lengths[seq] - q_len + (tok - cu_q_lens[seq])
  table = page_table[seq]  # [T, pages_per_seq]
  keys = k_pages[table].reshape(t, -1, k, hd).astype(jnp.float32)
  values = v_pages[table].reshape(t, -1, k, hd).astype(jnp.float32)
  g = h // k
  qg = q.astype(jnp.float32).reshape(t, k, g, hd)
  scores = jnp.einsum("tkgd,tskd->tkgs", qg, keys) * scale
  visible = jnp.arange(keys.shape[1])[None, :] <= pos[:, None]
  scores = jnp.where(visible[:, None, None, :], scores, _NEG_INF)
  out = jnp.einsum("tkgs,tskd->tkgd", jax.nn.softmax(scores, axis=-1), values)
  out = jnp.where(valid[:, None, None, None], out, 0.0)
  return out.reshape(t, h, hd).astype(q.dtype)


def paged_decode_attention(
  q: jax.Array,
  k_pages: jax.Array,
  v_pages: jax.Array,
  lengths: jax.Array,
  page_table: jax.Array,
  *,
  kernel: bool,
  blocks: RaggedBlocks = RaggedBlocks(),
) -> jax.Array:
  """One decode step of every slot: q [B, H, hd] (slot b's new token, already written at
  position lengths[b] - 1 of its pages) -> [B, H, hd]. kernel=True runs the TPU kernel (the
  pools interleaved first), False the gather reference. A slot of length 0 comes out 0."""
  b = q.shape[0]
  cu = jnp.arange(b + 1, dtype=jnp.int32)
  num = jnp.array([b], jnp.int32)
  lengths = lengths.astype(jnp.int32)
  if kernel:
    return ragged_paged_attention(q, k_pages, v_pages, lengths, page_table, cu, num, blocks=blocks)
  out = reference(q, k_pages, v_pages, lengths, page_table, cu, num)
  return jnp.where((lengths > 0)[:, None, None], out, 0.0).astype(q.dtype)


def kv_repeat(model: ModelConfig, tensor: int) -> int:
  """Copies of each KV head a replica of `tensor` chips keeps: tensor / num_kv_heads where the
  chips outnumber the heads (and divide by them) and split the query heads, so that every chip
  holds one head's keys and values instead of all of them; 1 otherwise."""
  k = model.num_kv_heads
  split = model.num_heads % tensor == 0  # the query heads split too (else attention replicates)
  return tensor // k if split and tensor > k and tensor % k == 0 else 1


def token_pages(
  page_table: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, positions: jax.Array,
  page_size: int,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
  """(page, offset) [N] where each token of a ragged batch writes its keys and values: its
  sequence's page for its position; tokens past the batch's last sequence write to page 0 (the
  null page, never read unmasked)."""
  tok = jnp.arange(positions.shape[0])
  seq = jnp.clip(jnp.searchsorted(cu_q_lens, tok, side="right") - 1, 0, page_table.shape[0] - 1)
  valid = tok < cu_q_lens[num_seqs[0]]
  idx = jnp.clip(positions // page_size, 0, page_table.shape[1] - 1)
  page = jnp.where(valid, page_table[seq, idx], 0)
  return page, positions % page_size


def attention(
  q: jax.Array,
  kv: jax.Array,
  lengths: jax.Array,
  page_table: jax.Array,
  cu: jax.Array,
  num: jax.Array,
  *,
  kernel: bool,
  blocks: RaggedBlocks = RaggedBlocks(),
  mesh: Mesh | None = None,
) -> jax.Array:
  """Ragged attention of q [N, H, hd] over combined pages (the module docstring's inputs): the
  kernel, or `reference` where kernel is False. Over a mesh whose "tensor" axis splits the
  heads (`mesh`, or else an enclosing activation mesh), the kernel runs per chip on its own
  heads (shard_map): a Pallas call is not partitioned by the compiler, which would gather the
  whole pool onto every chip."""
  if not kernel:
    k_pages, v_pages = split_kv(kv)
    return reference(q, k_pages, v_pages, lengths, page_table, cu, num)
  fn = functools.partial(ragged_paged_attention_combined, blocks=blocks)
  if mesh is None:
    ctx = sharding_lib.activation_context()
    mesh = None if ctx is None else ctx[0]
  if mesh is None or mesh.shape["tensor"] == 1:
    return fn(q, kv, lengths, page_table, cu, num)
  heads, rep = P(None, "tensor", None), P()
  return jax.shard_map(
    fn, mesh=mesh, in_specs=(heads, P(None, None, "tensor", None), rep, rep, rep, rep),
    out_specs=heads, check_vma=False,
  )(q, kv, lengths, page_table, cu, num)  # fmt: skip


def paged_step(
  model: nnx.Module,
  tokens: jax.Array,
  positions: jax.Array,
  kv_pages: tuple[jax.Array, ...],
  page_table: jax.Array,
  lengths: jax.Array,
  cu_q_lens: jax.Array,
  num_seqs: jax.Array,
  *,
  kernel: bool,
  repeat: int = 1,
  blocks: RaggedBlocks = RaggedBlocks(),
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  """One engine step of `model` (a `Transformer`: this module sits below it, which imports the
  attention here) over a ragged batch -- decode tokens and prefill chunks mixed -- against a
  combined paged cache: tokens, positions [N] (sequence s owns tokens cu_q_lens[s] ..
  cu_q_lens[s + 1]; lengths[s] counts them), kv_pages one [P, page_size, 2 K', hd] pool a layer
  with K' = num_kv_heads x `repeat` (each head duplicated `repeat` times: `kv_repeat`). Returns
  the float32 logits of each sequence's last token [slots, V] and the updated pools.

  The layer math is the transformer's own (its norms, projections, RoPE, MLP and head, via
  `DecoderLayer`'s modules); only the attention differs: each token's keys and values are
  written to its page, then ragged paged attention reads every sequence's own pages."""
  cfg = model.cfg
  n = tokens.shape[0]
  x = model.embed(tokens[None])
  rope = model.rope(positions[None])
  page, offset = token_pages(page_table, cu_q_lens, num_seqs, positions, kv_pages[0].shape[1])
  new_pools = []
  for layer, kv in zip(model.layers, kv_pages, strict=True):
    attn = layer.self_attn
    q, k, v = attn._qkv(layer.input_layernorm(x), rope)
    if repeat > 1:  # head j of the cache is the model's head j // repeat
      k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
    k = sharding_lib.constrain(k, ("batch", "length", "act_kv_heads", None))
    v = sharding_lib.constrain(v, ("batch", "length", "act_kv_heads", None))
    new = jnp.stack([k[0], v[0]], axis=2).reshape(n, -1, cfg.resolved_head_dim)
    kv = kv.at[page, offset].set(new.astype(kv.dtype))
    out = attention(q[0], kv, lengths, page_table, cu_q_lens, num_seqs, kernel=kernel,
                     blocks=blocks)  # fmt: skip
    x = x + attn.o_proj(out.reshape(1, n, -1))
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    new_pools.append(kv)
  last = jnp.clip(cu_q_lens[1:] - 1, 0, n - 1)  # [slots]: each sequence's last token
  return model.logits(x[:, last])[0], tuple(new_pools)
