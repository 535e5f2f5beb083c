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
