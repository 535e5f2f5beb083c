"""A fixed-shape key/value cache: one [batch, max_len, kv_heads, head_dim] pair per layer.

Fixed shapes keep prefill and decode compiled once. Rows are independent slots, each at its own
length, which is what continuous batching needs: the model writes new keys at each row's `start`
and attends only to positions below it.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

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


@flax.struct.dataclass
class PagedKVCache:
  """Per-layer key and value page pools and the page table that maps each slot's positions.

  The layout the TPU ragged-paged-attention kernel reads, so it can replace the gather: per
  layer `k[l]`, `v[l]` of shape [num_pages, page_size, kv_heads, head_dim]; `page_table`
  [slots, pages_per_seq] int32, position p of slot s living at (page_table[s, p // page_size],
  p % page_size). Per-slot lengths stay with the caller (the engine's DecodeState). Shapes are
  fixed (every slot has a full-length table row), so nothing recompiles as sequences grow.
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  page_table: jax.Array

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
  ) -> PagedKVCache:
    shape = (num_pages, page_size, cfg.num_kv_heads, cfg.resolved_head_dim)
    dt = jnp.dtype(dtype or cfg.dtype)
    return cls(
      k=tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers)),
      v=tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers)),
      page_table=jnp.full((slots, pages_per_seq), NULL_PAGE, jnp.int32),
    )

  @property
  def batch(self) -> int:
    return self.page_table.shape[0]

  @property
  def page_size(self) -> int:
    return self.k[0].shape[1]

  @property
  def num_pages(self) -> int:
    return self.k[0].shape[0]

  @property
  def max_len(self) -> int:
    return self.page_table.shape[1] * self.page_size


def page_coordinates(
  table: jax.Array, positions: jax.Array, valid: jax.Array, page_size: int
) -> tuple[jax.Array, jax.Array]:
  """(page [B, T], offset [B, T]) of positions [B, T] under table rows [B, pages_per_seq]; a
  position that is not `valid` or lies past the table goes to the null page."""
  idx = positions // page_size
  inside = valid & (idx < table.shape[1]) & (positions >= 0)
  page = jnp.take_along_axis(table, jnp.clip(idx, 0, table.shape[1] - 1), axis=1)
  return jnp.where(inside, page, NULL_PAGE), positions % page_size


def paged_write(pages: jax.Array, new: jax.Array, page: jax.Array, offset: jax.Array) -> jax.Array:
  """Writes new[b, t] ([B, T, K, hd]) at (page[b, t], offset[b, t]) of the pool. Distinct except
  on the null page (several rows may drop their writes there: any one of them wins)."""
  return pages.at[page, offset].set(new.astype(pages.dtype))


def paged_gather(pages: jax.Array, table: jax.Array) -> jax.Array:
  """The pages of table rows [B, n] laid end to end: [B, n * page_size, K, hd] (the reference
  read; a position's keys sit where a fixed cache row would hold them)."""
  b, n = table.shape
  out = pages[table]  # [B, n, page_size, K, hd]
  return out.reshape(b, n * pages.shape[1], *pages.shape[2:])


def copy_pages(cache: PagedKVCache, src: jax.Array, dst: jax.Array) -> PagedKVCache:
  """Copies whole pages src[i] -> dst[i] in every layer (copy-on-write of a shared page before a
  sequence writes into it); pairs (NULL_PAGE, NULL_PAGE) pad a call to a fixed size."""
  return cache.replace(
    k=tuple(p.at[dst].set(p[src]) for p in cache.k), v=tuple(p.at[dst].set(p[src]) for p in cache.v)
  )
