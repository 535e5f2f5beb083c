"""A fixed-shape key/value cache: one [batch, max_len, kv_heads, head_dim] pair per layer.

Fixed shapes keep prefill and decode compiled once. Rows are independent slots, each at its own
length, which is what continuous batching needs: the model writes new keys at each row's `start`
and attends only to positions below it.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from asearcher_jax.model.config import ModelConfig


@flax.struct.dataclass
class KVCache:
  """Per-layer key and value buffers (tuples so the pytree has one leaf per layer)."""

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]

  @classmethod
  def init(cls, cfg: ModelConfig, batch: int, max_len: int, dtype: str | None = None) -> KVCache:
    shape = (batch, max_len, cfg.num_kv_heads, cfg.resolved_head_dim)
    dt = jnp.dtype(dtype or cfg.dtype)
    zeros = tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers))
    return cls(k=zeros, v=tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers)))

  @property
  def batch(self) -> int:
    return self.k[0].shape[0]

  @property
  def max_len(self) -> int:
    return self.k[0].shape[1]


def write(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """Writes new[b] ([T, K, hd]) into buf[b] at row offset start[b] for every row b."""

  def one(row, upd, s):
    return jax.lax.dynamic_update_slice(row, upd.astype(row.dtype), (s, 0, 0))

  return jax.vmap(one)(buf, new, start)


def write_rows(buf: jax.Array, new: jax.Array, rows: jax.Array, start: jax.Array) -> jax.Array:
  """Writes new[i] ([T, K, hd]) into buf[rows[i]] at row offset start[i]; rows must be distinct.

  A scatter into the whole buffer, so that a step over a few gathered slots updates the donated
  cache in place instead of copying the slots out and back."""
  pos = start[:, None] + jnp.arange(new.shape[1])[None, :]
  return buf.at[rows[:, None], pos].set(new.astype(buf.dtype), unique_indices=True)


# ---- paged: a pool of fixed-size pages per layer, mapped per sequence by a page table ----------

# Page 0 is never handed to a sequence: unmapped table entries point at it and writes that must
# land nowhere (padding, inactive rows, positions already cached) go there. Its contents are
# garbage that attention always masks out (finite: every write is a real computation).
NULL_PAGE = 0


# How a paged cache's attention reads its pages (`PagedKVCache.attention`):
#   "gather": each row's pages gathered end to end and attended as a fixed cache row is
#     (`attention.paged_attention`); runs everywhere, the reference the others must equal;
#   "ragged": JAX's ragged paged attention TPU kernel, each sequence over its own length
#     (`ragged_paged`); TPU only;
#   "ragged_reference": the same ragged program with the kernel's pure-JAX stand-in
#     (`ragged_paged.reference`), so CPU tests run the inputs the kernel gets.
PAGED_ATTENTION = ("gather", "ragged", "ragged_reference")


@flax.struct.dataclass
class PagedKVCache:
  """Per-layer page pools of keys and values, and the page table that maps each slot's positions.

  The layout the TPU ragged-paged-attention kernel reads, so it runs on the pools in place: per
  layer one pool `kv[l]` of shape [num_pages, page_size, 2 * kv_heads, head_dim], head h's keys
  at 2h and its values at 2h + 1 (`split_kv`); `page_table` [slots, pages_per_seq] int32,
  position p of slot s living at (page_table[s, p // page_size], p % page_size). kv_heads may be
  the model's KV heads repeated (`ragged_paged.kv_repeat`: one copy per tensor-parallel chip),
  which changes no result. Per-slot lengths stay with the caller (the engine's DecodeState).
  Shapes are fixed (every slot has a full-length table row), so nothing recompiles as sequences
  grow.
  """

  kv: tuple[jax.Array, ...]
  page_table: jax.Array
  # How attention reads the pages (PAGED_ATTENTION); static, part of the compiled program.
  attention: str = flax.struct.field(pytree_node=False, default="gather")
  # The mesh whose "tensor" axis splits the pools' heads, where the ragged kernel runs per chip
  # on its own heads (shard_map); None: one device, or pools not split.
  mesh: Mesh | None = flax.struct.field(pytree_node=False, default=None)

  @classmethod
  def init(
    cls,
    cfg: ModelConfig,
    *,
    slots: int,
    num_pages: int,
    page_size: int,
    pages_per_seq: int,
    dtype: str | None = None,
    repeat: int = 1,
    attention: str = "gather",
    mesh: Mesh | None = None,
  ) -> PagedKVCache:
    if attention not in PAGED_ATTENTION:
      raise ValueError(f"paged attention must be one of {PAGED_ATTENTION}, got {attention!r}")
    shape = (num_pages, page_size, 2 * cfg.num_kv_heads * repeat, cfg.resolved_head_dim)
    dt = jnp.dtype(dtype or cfg.dtype)
    return cls(
      kv=tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers)),
      page_table=jnp.full((slots, pages_per_seq), NULL_PAGE, jnp.int32),
      attention=attention,
      mesh=mesh,
    )

  @property
  def batch(self) -> int:
    return self.page_table.shape[0]

  @property
  def page_size(self) -> int:
    return self.kv[0].shape[1]

  @property
  def num_pages(self) -> int:
    return self.kv[0].shape[0]

  @property
  def kv_heads(self) -> int:
    """KV heads the pools hold (the model's, times any repeat)."""
    return self.kv[0].shape[2] // 2

  @property
  def max_len(self) -> int:
    return self.page_table.shape[1] * self.page_size

  @property
  def k(self) -> tuple[jax.Array, ...]:
    """Each layer's keys [num_pages, page_size, kv_heads, head_dim] (a copy; for reading)."""
    return tuple(split_kv(p)[0] for p in self.kv)

  @property
  def v(self) -> tuple[jax.Array, ...]:
    return tuple(split_kv(p)[1] for p in self.kv)


def combine_kv(k: jax.Array, v: jax.Array) -> jax.Array:
  """[..., K, hd] keys and values -> [..., 2K, hd], head h's keys at 2h and values at 2h + 1."""
  return jnp.stack([k, v], axis=-2).reshape(*k.shape[:-2], 2 * k.shape[-2], k.shape[-1])


def split_kv(kv: jax.Array) -> tuple[jax.Array, jax.Array]:
  """[..., 2K, hd] combined -> ([..., K, hd] keys, [..., K, hd] values)."""
  pairs = kv.reshape(*kv.shape[:-2], kv.shape[-2] // 2, 2, kv.shape[-1])
  return pairs[..., 0, :], pairs[..., 1, :]


def repeat_heads(x: jax.Array, heads: int) -> jax.Array:
  """[..., K, hd] -> [..., heads, hd], each head repeated heads / K times (head j of the result
  is head j // (heads / K)): what a cache of duplicated heads stores."""
  k = x.shape[-2]
  return x if heads == k else jnp.repeat(x, heads // k, axis=-2)


def page_coordinates(
  table: jax.Array, positions: jax.Array, valid: jax.Array, page_size: int
) -> tuple[jax.Array, jax.Array]:
  """(page [B, T], offset [B, T]) of positions [B, T] under table rows [B, pages_per_seq]; a
  position that is not `valid` or lies past the table goes to the null page."""
  idx = positions // page_size
  inside = valid & (idx < table.shape[1]) & (positions >= 0)
  page = jnp.take_along_axis(table, jnp.clip(idx, 0, table.shape[1] - 1), axis=1)
  return jnp.where(inside, page, NULL_PAGE), positions % page_size


def paged_write(
  pool: jax.Array, k: jax.Array, v: jax.Array, page: jax.Array, offset: jax.Array
) -> jax.Array:
  """Writes keys and values k[b, t], v[b, t] ([B, T, K, hd], K the model's heads: repeated to the
  pool's) at (page[b, t], offset[b, t]) of a combined pool. Distinct except on the null page
  (several rows may drop their writes there: any one of them wins)."""
  heads = pool.shape[2] // 2
  new = combine_kv(repeat_heads(k, heads), repeat_heads(v, heads))
  return pool.at[page, offset].set(new.astype(pool.dtype))


def paged_gather(pool: jax.Array, table: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The pages of table rows [B, n] laid end to end: keys and values [B, n * page_size, K, hd]
  each (the reference read; a position's keys sit where a fixed cache row would hold them)."""
  b, n = table.shape
  out = pool[table]  # [B, n, page_size, 2K, hd]
  return split_kv(out.reshape(b, n * pool.shape[1], *pool.shape[2:]))
