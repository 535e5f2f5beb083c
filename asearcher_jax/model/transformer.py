"""The Qwen2 / Qwen2.5 / Qwen3 decoder in Flax NNX.

One set of layers serves two call paths:
  * `__call__` runs packed training/scoring batches: `segment_ids` separate sequences that share a
    row, `positions` restart at 0 for each, and attention never crosses a segment boundary;
  * `extend` runs prefill and decode against a fixed-shape `KVCache`: each row appends T tokens at
    its own offset, so one compiled step serves slots of different lengths.
Numerics follow transformers' Qwen2/Qwen3 modules (RMSNorm in float32, rotate-half RoPE, GQA by
head grouping) so that checkpoints load with matching logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from asearcher_jax.model import attention as attention_lib
from asearcher_jax.model import kv_cache as kv_lib
from asearcher_jax.model import ragged_paged
from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.model.kv_cache import KVCache, PagedKVCache, write, write_rows

RopeTables = tuple[jax.Array, jax.Array]  # cos, sin: [B, T, 1, head_dim / 2], float32


class PageView(NamedTuple):
  """Where one forward over a paged cache writes and reads, computed once for every layer."""

  write_page: jax.Array  # [B, T] page of each new token's keys/values (the null page: dropped)
  write_offset: jax.Array  # [B, T]
  read_table: jax.Array  # [B, n] the pages that hold each row's first n * page_size positions
  # [B] each row's length through this call's tokens (ragged attention's kv_lens; its queries
  # sit at lengths - T .. lengths - 1), at most read_table's positions
  lengths: jax.Array
  attention: str  # kv_cache.PAGED_ATTENTION: how the pages are read
  mesh: Mesh | None  # where the ragged kernel runs per chip on its heads (PagedKVCache.mesh)
  # Ragged, where some rows ride along (`Transformer.extend`'s live): the order the kernel gets
  # the rows in, live ones first ([B]; read_table and lengths are in this order), its inverse,
  # the rows that run ([B] bool) and how many sequences the kernel reads ([1]). None: every row
  # runs, in order.
  ragged_rows: tuple[jax.Array, jax.Array, jax.Array, jax.Array] | None = None


def _param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
  # Logical axis names ride along as metadata; sharding.py maps them onto mesh axes.
  return nnx.Param(value, logical_axes=axes)


class Dense(nnx.Module):
  """y = x @ kernel (+ bias); kernel stored [in, out] (the transpose of torch's Linear.weight)."""

  def __init__(
    self,
    din: int,
    dout: int,
    *,
    bias: bool,
    axes: tuple[str, str],
    cfg: ModelConfig,
    rngs: nnx.Rngs,
  ):
    init = jax.nn.initializers.normal(stddev=0.02)
    pdt = jnp.dtype(cfg.param_dtype)
    self.kernel = _param(init(rngs.params(), (din, dout), pdt), axes)
    self.bias = _param(jnp.zeros((dout,), pdt), (axes[1],)) if bias else None
    self.dtype = jnp.dtype(cfg.dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    # A 2-D matmul over flattened [B*T, din]: XLA:CPU runs the 3-D dot_general and its weight
    # gradient ~1.7x slower (it transposes activations); on TPU/GPU the reshape is free.
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(self.dtype)
    y = jnp.dot(x2, self.kernel.get_value().astype(self.dtype))
    if self.bias is not None:
      y = y + self.bias.get_value().astype(self.dtype)
    return y.reshape(*lead, y.shape[-1])


class RMSNorm(nnx.Module):
  """RMSNorm computed in float32; the scale multiplies after casting back (as transformers does)."""

  def __init__(self, dim: int, *, eps: float, cfg: ModelConfig):
    self.scale = _param(jnp.ones((dim,), jnp.dtype(cfg.param_dtype)), ("norm",))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale.get_value().astype(x.dtype) * y.astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float, factor: float):
  """cos and sin [B, T, 1, hd/2] for rotate-half RoPE; built once per forward, shared by layers."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  freqs = (positions.astype(jnp.float32) / factor)[..., None] * inv_freq
  return jnp.cos(freqs)[:, :, None, :], jnp.sin(freqs)[:, :, None, :]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotate-half RoPE on x [B, T, N, hd]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, hd = cfg.hidden_size, cfg.resolved_head_dim
    self.cfg = cfg
    o_bias = cfg.model_type == "qwen3" and cfg.qkv_bias  # Qwen3's attention_bias covers o_proj too
    self.q_proj = Dense(d, cfg.num_heads * hd, bias=cfg.qkv_bias, axes=("embed", "q_heads"),
                        cfg=cfg, rngs=rngs)  # fmt: skip
    self.k_proj = Dense(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias, axes=("embed", "kv_heads"),
                        cfg=cfg, rngs=rngs)  # fmt: skip
    self.v_proj = Dense(d, cfg.num_kv_heads * hd, bias=cfg.qkv_bias, axes=("embed", "kv_heads"),
                        cfg=cfg, rngs=rngs)  # fmt: skip
    self.o_proj = Dense(cfg.num_heads * hd, d, bias=o_bias, axes=("q_heads", "embed"),
                        cfg=cfg, rngs=rngs)  # fmt: skip
    if cfg.qk_norm:
      self.q_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, cfg=cfg)
      self.k_norm = RMSNorm(hd, eps=cfg.rms_norm_eps, cfg=cfg)
    else:
      self.q_norm = self.k_norm = None

  def _qkv(self, x: jax.Array, rope: RopeTables) -> tuple[jax.Array, jax.Array, jax.Array]:
    cfg = self.cfg
    b, t, _ = x.shape
    hd = cfg.resolved_head_dim
    q = self.q_proj(x).reshape(b, t, cfg.num_heads, hd)
    k = self.k_proj(x).reshape(b, t, cfg.num_kv_heads, hd)
    v = self.v_proj(x).reshape(b, t, cfg.num_kv_heads, hd)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    q = sharding_lib.constrain(q, ("batch", "length", "act_heads", None))
    return q, k, v

  def __call__(self, x: jax.Array, rope: RopeTables, segment_ids: jax.Array) -> jax.Array:
    q, k, v = self._qkv(x, rope)
    out = attention_lib.packed_causal(q, k, v, segment_ids, self.cfg)
    return self.o_proj(out.reshape(x.shape[0], x.shape[1], -1))

  def extend(
    self,
    x: jax.Array,
    rope: RopeTables,
    positions: jax.Array,
    start: jax.Array,
    k_buf: jax.Array,
    v_buf: jax.Array | None,
    attend_len: int | None = None,
    rows: jax.Array | None = None,
    fresh: bool = False,
    pages: PageView | None = None,
  ) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Attention of x's new tokens over a fixed cache row (k_buf, v_buf) or, given `pages`, a
    combined page pool (k_buf; v_buf None, and None comes back in its place)."""
    q, k, v = self._qkv(x, rope)
    # Only the first attend_len cache positions are read (the caller guarantees every row's
    # keys live there): decode cost follows the live context, not the cache size.
    n = k_buf.shape[1] if attend_len is None else attend_len
    if pages is not None:  # k_buf is a combined page pool: scatter the new keys, attend the row's
      pool = kv_lib.paged_write(k_buf, k, v, pages.write_page, pages.write_offset)
      if pages.attention == "gather":
        out = attention_lib.paged_attention(
          q, pool, pages.read_table, positions, n, self.cfg.attention_block, causal=fresh
        )
      else:  # rows end to end, each its own sequence of T queries, over its own length
        b, t = x.shape[:2]
        order = inverse = live = None
        num = jnp.full((1,), b, jnp.int32)
        if pages.ragged_rows is not None:
          order, inverse, live, num = pages.ragged_rows
        out = ragged_paged.attention(
          (q if order is None else q[order]).reshape(b * t, *q.shape[2:]), pool, pages.lengths,
          pages.read_table, jnp.arange(b + 1, dtype=jnp.int32) * t, num,
          kernel=pages.attention == "ragged", mesh=pages.mesh,
        ).reshape(q.shape)  # fmt: skip
        if order is not None:  # rows past num_seqs come out of the kernel unwritten
          out = jnp.where(live[:, None, None, None], out[inverse], 0.0).astype(out.dtype)
      return self.o_proj(out.reshape(x.shape[0], x.shape[1], -1)), pool, None
    if rows is None:
      k_buf, v_buf = write(k_buf, k, start), write(v_buf, v, start)
      keys, values = k_buf[:, :n], v_buf[:, :n]
    else:  # x row i belongs to cache row rows[i]: the other cache rows are neither read nor written
      k_buf, v_buf = write_rows(k_buf, k, rows, start), write_rows(v_buf, v, rows, start)
      keys, values = k_buf[rows, :n], v_buf[rows, :n]
    keys, values = keys.astype(q.dtype), values.astype(q.dtype)
    # Query t of row b sits at start[b] + t and may see every cached key at or before it.
    mask = jnp.arange(n)[None, None, :] <= positions[:, :, None]
    out = attention_lib.attend_blocked(
      q, keys, values, mask, self.cfg.attention_block, causal=fresh
    )
    return self.o_proj(out.reshape(x.shape[0], x.shape[1], -1)), k_buf, v_buf


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, f = cfg.hidden_size, cfg.intermediate_size
    self.gate_proj = Dense(d, f, bias=False, axes=("embed", "mlp"), cfg=cfg, rngs=rngs)
    self.up_proj = Dense(d, f, bias=False, axes=("embed", "mlp"), cfg=cfg, rngs=rngs)
    self.down_proj = Dense(f, d, bias=False, axes=("mlp", "embed"), cfg=cfg, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
    h = sharding_lib.constrain(h, ("batch", "length", "act_mlp"))
    return self.down_proj(h)


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, cfg=cfg)
    self.self_attn = Attention(cfg, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, cfg=cfg)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x: jax.Array, rope: RopeTables, segment_ids: jax.Array) -> jax.Array:
    x = x + self.self_attn(self.input_layernorm(x), rope, segment_ids)
    x = x + self.mlp(self.post_attention_layernorm(x))
    return sharding_lib.constrain(x, ("batch", "length", "act_embed"))

  def extend(
    self, x, rope, positions, start, k_buf, v_buf, attend_len=None, rows=None, fresh=False,
    pages=None,
  ):  # fmt: skip
    h, k_buf, v_buf = self.self_attn.extend(
      self.input_layernorm(x), rope, positions, start, k_buf, v_buf, attend_len, rows, fresh,
      pages,
    )  # fmt: skip
    x = x + h
    x = x + self.mlp(self.post_attention_layernorm(x))
    return x, k_buf, v_buf


# ModelConfig.remat_policy -> what jax.checkpoint saves of a decoder block (None: no remat).
REMAT_POLICIES: dict[str, Callable | None] = {
  "none": None,
  "full": jax.checkpoint_policies.nothing_saveable,
  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  "dots_saveable": jax.checkpoint_policies.dots_saveable,
}


def _block_fn(graphdef: nnx.GraphDef, cfg: ModelConfig, rope: RopeTables, segment_ids: jax.Array):
  """(layer state, x) -> x: one decoder block as a pure function, under the remat policy."""

  def block(state: nnx.State, x: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, state)(x, rope, segment_ids)

  policy = REMAT_POLICIES[cfg.remat_policy]
  if policy is None:
    return block
  # prevent_cse=False: a scan body cannot be CSE'd across iterations anyway (jax.checkpoint docs).
  return jax.checkpoint(block, policy=policy, prevent_cse=not cfg.scan_layers)


def stack_layers(layers: Sequence[nnx.Module], cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
  """One graphdef and the layers' states stacked on a new leading axis, for `jax.lax.scan`.

  The stack is built inside the traced step (the parameter tree stays a list of layers, as
  hf_io, checkpoints and the engine expect); gradients flow back through it to each layer.
  Leaves are cast to the compute dtype first where that narrows them (fp32 masters, bf16
  matmuls): every use casts to it anyway, so the copy costs one layer stack in compute dtype.
  Each stacked leaf keeps its per-layer sharding, the layer axis replicated.
  """
  graphdef, first = nnx.split(layers[0])
  states = [first, *(nnx.split(layer)[1] for layer in layers[1:])]
  dt = jnp.dtype(cfg.dtype)

  def stack(*variables: nnx.Variable) -> nnx.Variable:
    values = [v.get_value() for v in variables]
    if jnp.issubdtype(values[0].dtype, jnp.floating) and dt.itemsize < values[0].dtype.itemsize:
      values = [x.astype(dt) for x in values]
    axes = variables[0].get_metadata().get("logical_axes")
    stacked = jnp.stack(values)
    if axes is not None:
      stacked = sharding_lib.constrain(stacked, (None, *axes))
    return variables[0].replace(stacked)

  return graphdef, jax.tree.map(stack, *states, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def _stacked_layer(layers: Sequence[nnx.Module]) -> nnx.Module:
  """One layer module whose variables hold every layer's value on a new leading axis (stored
  that way, in the variables' own dtype; the layer axis is a leading None in `logical_axes`)."""
  graphdef, first = nnx.split(layers[0])
  states = [first, *(nnx.split(layer)[1] for layer in layers[1:])]

  def stack(*variables: nnx.Variable) -> nnx.Variable:
    axes = variables[0].get_metadata().get("logical_axes")
    value = jnp.stack([v.get_value() for v in variables])
    if axes is None:
      return variables[0].replace(value)
    return variables[0].replace(value, logical_axes=(None, *axes))

  return nnx.merge(graphdef, jax.tree.map(stack, *states, is_leaf=_is_var))


def _unstacked_layers(stacked: nnx.Module, num_layers: int) -> list[nnx.Module]:
  """The inverse of `_stacked_layer`: `num_layers` modules with the original metadata."""
  graphdef, state = nnx.split(stacked)

  def layer(i: int) -> nnx.Module:
    def one(v: nnx.Variable) -> nnx.Variable:
      axes = v.get_metadata().get("logical_axes")
      if axes is None:
        return v.replace(v.get_value()[i])
      return v.replace(v.get_value()[i], logical_axes=tuple(axes[1:]))

    return nnx.merge(graphdef, jax.tree.map(one, state, is_leaf=_is_var))

  return [layer(i) for i in range(num_layers)]


class Transformer(nnx.Module):
  """Decoder-only policy. Parameter names mirror the Hugging Face module tree (see hf_io).

  Layers are stored one module each (`layers`, what hf_io, the engine, the weights store and
  exports read) or stacked (`stacked_layers`: one module whose variables carry a leading layer
  axis, `layers` empty), which is how the learner keeps them under `scan_layers`: the scan then
  reads its weights in place, and the optimizer updates a dozen stacked leaves instead of a
  dozen per layer (the train step's compile time stops growing with depth). `stack` and
  `unstack` convert in place; see `stack_params` / `unstack_params` for states."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    init = jax.nn.initializers.normal(stddev=0.02)
    pdt = jnp.dtype(cfg.param_dtype)
    self.embed_tokens = _param(
      init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), pdt), ("vocab", "embed")
    )
    self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.stacked_layers: nnx.Module | None = nnx.data(None)
    self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, cfg=cfg)
    if cfg.tie_word_embeddings:
      self.lm_head = None
    else:
      # Stored like the embedding, [vocab, embed], so tied and untied share one code path.
      self.lm_head = _param(
        init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), pdt), ("vocab", "embed")
      )

  def stack(self) -> None:
    """Moves the layers into `stacked_layers` (one leading layer axis per variable)."""
    if self.stacked_layers is None:
      self.stacked_layers = nnx.data(_stacked_layer(list(self.layers)))
      self.layers = nnx.List([])

  def unstack(self) -> None:
    """Moves `stacked_layers` back into one module per layer, metadata as they were built."""
    if self.stacked_layers is not None:
      self.layers = nnx.List(_unstacked_layers(self.stacked_layers, self.cfg.num_layers))
      self.stacked_layers = None

  def rope(self, positions: jax.Array) -> RopeTables:
    cfg = self.cfg
    return rope_tables(positions, cfg.resolved_head_dim, cfg.rope_theta, cfg.rope_scaling_factor)

  def embed(self, tokens: jax.Array) -> jax.Array:
    x = jnp.take(self.embed_tokens.get_value(), tokens, axis=0).astype(jnp.dtype(self.cfg.dtype))
    return sharding_lib.constrain(x, ("batch", "length", "act_embed"))

  def logits(self, hidden: jax.Array) -> jax.Array:
    """Final norm and output projection; logits in float32."""
    h = self.norm(hidden)
    w = self.embed_tokens if self.lm_head is None else self.lm_head
    b, t, d = h.shape  # flattened for the same XLA:CPU reason as Dense
    out = jnp.einsum(
      "nd,vd->nv",
      h.reshape(b * t, d),
      w.get_value().astype(h.dtype),
      preferred_element_type=jnp.float32,
    ).reshape(b, t, -1)
    return sharding_lib.constrain(out, ("batch", "length", "act_vocab"))

  def hidden_states(
    self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> jax.Array:
    """Runs the blocks over a packed batch; returns the last hidden state [B, T, D]."""
    x = self.embed(tokens)
    rope = self.rope(positions)
    if self.stacked_layers is not None:  # stored stacked: the scan reads them in place
      graphdef, stacked = nnx.split(self.stacked_layers)
    elif not self.cfg.scan_layers:  # the reference: one traced copy of the block per layer
      for layer in self.layers:
        graphdef, state = nnx.split(layer)
        x = _block_fn(graphdef, self.cfg, rope, segment_ids)(state, x)
      return x
    else:
      graphdef, stacked = stack_layers(self.layers, self.cfg)
    block = _block_fn(graphdef, self.cfg, rope, segment_ids)
    x, _ = jax.lax.scan(lambda h, state: (block(state, h), None), x, stacked)
    return x

  def __call__(
    self,
    tokens: jax.Array,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
  ) -> jax.Array:
    """Logits [B, T, V] for a (possibly packed) batch; unpacked when positions/segments are None."""
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    if segment_ids is None:
      segment_ids = jnp.ones_like(tokens)
    return self.logits(self.hidden_states(tokens, positions, segment_ids))

  def extend(
    self,
    tokens: jax.Array,
    start: jax.Array,
    cache: KVCache | PagedKVCache,
    attend_len: int | None = None,
    *,
    return_hidden: bool = False,
    rows: jax.Array | None = None,
    fresh: bool = False,
    write_len: jax.Array | None = None,
    live: jax.Array | None = None,
  ) -> tuple[jax.Array, KVCache | PagedKVCache]:
    """Appends tokens [B, T] at per-row offsets start [B]; returns logits [B, T, V] and the cache.

    Prefill is `extend(prompt, zeros, cache)`; one decode step is `extend(next[:, None], lengths,
    cache)`. Rows must satisfy start + T <= cache.max_len, and start + T <= attend_len (static)
    when given. return_hidden=True returns the final hidden states [B, T, D] instead of logits
    (prefill needs logits at one position only: `logits(hidden[:, i:i+1])`). rows [B] (distinct
    cache rows) maps token row i to cache row rows[i], so a decode step can cover a few slots of
    a large cache; by default token row i is cache row i. fresh=True promises start == 0 and a
    cache of exactly T positions (a prefill), letting attention skip the keys a query block
    cannot see. Queries run in blocks of `attention_block` either way, bounding memory.

    A `PagedKVCache` is read and written through its page table (row i is table row rows[i], or
    i): the same keys at the same positions, so the same outputs as a fixed cache. write_len [B]
    (paged only) keeps the keys/values of each row's first write_len tokens and drops the rest
    (padding; 0 for a row whose positions are cached already or that only rides along).
    live [B] bool (paged only; default every row): rows that run. The others (idle decode slots)
    write nothing and read no page: the gather reads the null page for them, the ragged program
    hands them to the kernel after its last sequence with length 0, so they cost it nothing and
    whatever their table maps (pages since freed or owned by another sequence) reaches no row.
    Their outputs are meaningless. A fixed cache ignores it (an idle row there reads its own row).
    """
    if self.stacked_layers is not None:
      raise ValueError("extend runs over layers stored one module each: unstack() first")
    positions = start[:, None] + jnp.arange(tokens.shape[1])[None, :]
    x = self.embed(tokens)
    rope = self.rope(positions)
    view = None
    if isinstance(cache, PagedKVCache):
      table = cache.page_table if rows is None else cache.page_table[rows]
      n = attend_len = cache.max_len if attend_len is None else attend_len
      valid = jnp.ones(positions.shape, bool)
      if write_len is not None:
        valid = jnp.arange(tokens.shape[1])[None, :] < write_len[:, None]
      if live is not None:
        valid = valid & live[:, None]
        table = jnp.where(live[:, None], table, kv_lib.NULL_PAGE)
      page, offset = kv_lib.page_coordinates(table, positions, valid, cache.page_size)
      # The gather reads the window's pages; ragged attention reads each row's own length only,
      # which for a padded suffix may pass the window and even the context (query positions
      # follow from the length: clipping it would move every query back). So the ragged table
      # runs on over null pages far enough to address a padded bucket at the context's end:
      # only padding queries read there, and padding writes nowhere.
      if cache.attention == "gather":
        read = table[:, : -(-n // cache.page_size)]
      else:
        pad = -(-tokens.shape[1] // cache.page_size)
        read = jnp.pad(table, ((0, 0), (0, pad)), constant_values=kv_lib.NULL_PAGE)
      lengths = jnp.minimum(start + tokens.shape[1], read.shape[1] * cache.page_size)
      lengths, ragged_rows = lengths.astype(jnp.int32), None
      if live is not None and cache.attention != "gather":
        read, lengths, ragged_rows = _live_first(read, lengths, live, tokens.shape[1])
      view = PageView(page, offset, read, lengths, cache.attention, cache.mesh, ragged_rows)
      rows = None  # the table rows already select the pages
      pools = []
      for layer, pool in zip(self.layers, cache.kv, strict=True):
        x, pool, _ = layer.extend(x, rope, positions, start, pool, None, attend_len, rows, fresh,
                                  view)  # fmt: skip
        pools.append(pool)
      out = x if return_hidden else self.logits(x)
      return out, cache.replace(kv=tuple(pools))
    ks, vs = [], []
    for layer, k_buf, v_buf in zip(self.layers, cache.k, cache.v, strict=True):
      x, k_buf, v_buf = layer.extend(
        x, rope, positions, start, k_buf, v_buf, attend_len, rows, fresh, view
      )
      ks.append(k_buf)
      vs.append(v_buf)
    out = x if return_hidden else self.logits(x)
    return out, cache.replace(k=tuple(ks), v=tuple(vs))


def _live_first(read: jax.Array, lengths: jax.Array, live: jax.Array, t: int):
  """The ragged kernel's rows when only `live` ones run: those first, the rest after its last
  sequence (num_seqs), length 0, which it never reads. Left in place with length 0, a row would
  break the kernel's contract (each sequence's kv_len at least its queries) and its prefetch
  (which starts the next sequence's first block whether that sequence reads one or not). With
  no row live, one sequence still runs, T positions of the null page (a kernel of no sequence
  would leave its first block's copy unwaited). Returns (table, lengths, PageView.ragged_rows)."""
  order = jnp.argsort(~live, stable=True).astype(jnp.int32)
  inverse = jnp.argsort(order).astype(jnp.int32)
  lengths = jnp.where(live, lengths, 0)[order].at[0].max(t)  # row 0 is live, if any is
  num = jnp.maximum(jnp.sum(live, dtype=jnp.int32), 1)[None]
  return read[order], lengths, (order, inverse, live, num)


def stack_params(graphdef: nnx.GraphDef, params: nnx.State) -> tuple[nnx.GraphDef, nnx.State]:
  """The stacked form (`Transformer.stack`) of a model given one module per layer; works on
  arrays, tracers (under jit) and ShapeDtypeStructs alike. A stacked state passes through."""
  if is_stacked(params):
    return graphdef, params
  model = nnx.merge(graphdef, params)
  model.stack()
  return nnx.split(model)


def unstack_params(graphdef: nnx.GraphDef, params: nnx.State) -> tuple[nnx.GraphDef, nnx.State]:
  """One module per layer again (what hf_io, the engine and exports read), the graphdef and
  state structure exactly those the model was built with. A list-form state passes through."""
  if not is_stacked(params):
    return graphdef, params
  model = nnx.merge(graphdef, params)
  model.unstack()
  return nnx.split(model)


def is_stacked(params: nnx.State) -> bool:
  """Whether a Transformer state holds its layers stacked (see `Transformer`)."""
  return "stacked_layers" in params


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature=1.0) -> jax.Array:
  """log softmax(logits / temperature) gathered at `tokens`; logits [..., V], tokens [...].

  The one sampling-distribution logprob used by the engine (for behaviour logprobs) and the
  learner (for proximal and current logprobs), so the two can never disagree on temperature.
  temperature may be a scalar or broadcast against logits[..., :1]. Written as two fused passes
  over the vocabulary (max, then sum of exp) plus a gather from the raw logits: materialising
  logits / temperature first costs ~3x on CPU at a 150k vocabulary.
  """
  logits = logits.astype(jnp.float32)
  m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  lse = jnp.log(jnp.sum(jnp.exp((logits - m) / temperature), axis=-1))
  picked = jnp.take_along_axis(logits, tokens[..., None], axis=-1)
  return ((picked - m) / temperature)[..., 0] - lse


def token_entropy(logits: jax.Array, temperature=1.0) -> jax.Array:
  """Entropy of softmax(logits / temperature) over the last axis (nats); logits [..., V].

  H = log Z - E_p[z] with z = (logits - max) / temperature, written with the same exp as
  `token_logprobs` so XLA computes it once when both are asked for."""
  logits = logits.astype(jnp.float32)
  m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  z = (logits - m) / temperature
  e = jnp.exp(z)
  s = jnp.sum(e, axis=-1)
  return jnp.log(s) - jnp.sum(e * z, axis=-1) / s


def _next_token_stats(
  model: Transformer,
  hidden: jax.Array,
  targets: jax.Array,
  temperature,
  entropy: bool,
  correct: bool = False,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
  """Logprob of targets [B, T] (and the entropy; and with `correct` 1.0 where the greedy argmax
  is the target) under the logits of hidden [B, T, D], computed
  `cfg.logits_chunk` positions of every row at a time so that no [B, T, V] array is live.

  Each chunk runs under jax.checkpoint (nothing saved): the backward recomputes its logits, one
  more lm-head matmul per token, rather than keep all T of them. The chunk runs over positions,
  not flattened tokens, so rows stay on their data shards."""

  def stats(h, tgt):
    logits = model.logits(h)
    lp = token_logprobs(logits, tgt, temperature)
    ent = jax.lax.stop_gradient(token_entropy(logits, temperature)) if entropy else None
    hit = (jnp.argmax(logits, axis=-1) == tgt).astype(jnp.float32) if correct else None
    return lp, ent, hit

  b, t, d = hidden.shape
  chunk = model.cfg.logits_chunk
  if chunk <= 0 or t <= chunk:
    return stats(hidden, targets)
  n = -(-t // chunk)
  pad = n * chunk - t  # zero hidden states score finite logits; their outputs are cut off below
  hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
  targets = jnp.pad(targets, ((0, 0), (0, pad)))
  xs = (
    hidden.reshape(b, n, chunk, d).swapaxes(0, 1),
    targets.reshape(b, n, chunk).swapaxes(0, 1),
  )
  chunk_stats = jax.checkpoint(stats, prevent_cse=False)
  _, out = jax.lax.scan(lambda carry, x: (carry, chunk_stats(*x)), None, xs)
  return jax.tree.map(lambda y: y.swapaxes(0, 1).reshape(b, n * chunk)[:, :t], out)


def score_and_entropy(
  model: Transformer,
  tokens: jax.Array,
  positions: jax.Array,
  segment_ids: jax.Array,
  temperature: float = 1.0,
  *,
  entropy: bool = True,
) -> tuple[jax.Array, jax.Array | None]:
  """Per-token logprobs of a packed batch and the entropy of the sampling distribution
  (softmax(logits / temperature)) each was drawn from, both aligned as in `score` (0 where
  nothing predicts the token); one forward pass. entropy=False returns None for it."""
  hidden = model.hidden_states(tokens, positions, segment_ids)
  # Position t predicts token t + 1; the last position predicts nothing (its target is a dummy
  # and its outputs are dropped), so chunks run over all T positions.
  targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
  lp, ent, _ = _next_token_stats(model, hidden, targets, temperature, entropy)
  return _align(lp, segment_ids), (None if ent is None else _align(ent, segment_ids))


def _align(x: jax.Array, segment_ids: jax.Array) -> jax.Array:
  """Stats of position t's prediction moved to the token it predicts (t + 1), 0 where nothing
  of the same segment predicts a token."""
  same = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
  x = jnp.where(same, x[:, :-1], 0.0)
  return jnp.concatenate([jnp.zeros_like(x[:, :1]), x], axis=1)


def score_and_correct(
  model: Transformer, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Per-token logprobs (temperature 1) and greedy hits (1.0 where the argmax of the logits
  predicting a token is that token), aligned as in `score`; over chunks of positions, so SFT's
  loss and accuracy hold no [rows, T, V] logits either."""
  hidden = model.hidden_states(tokens, positions, segment_ids)
  targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
  lp, _, hit = _next_token_stats(model, hidden, targets, 1.0, False, correct=True)
  return _align(lp, segment_ids), _align(hit, segment_ids)


def score(
  model: Transformer,
  tokens: jax.Array,
  positions: jax.Array,
  segment_ids: jax.Array,
  temperature: float = 1.0,
) -> jax.Array:
  """Per-token logprobs of a packed batch, aligned with the token being predicted.

  out[b, t] = log p(tokens[b, t] | earlier tokens of the same segment), and 0 at the first token
  of every segment (and on padding, segment id 0), where nothing predicts it. Logits are
  computed `cfg.logits_chunk` positions at a time (see `_next_token_stats`).
  """
  return score_and_entropy(model, tokens, positions, segment_ids, temperature, entropy=False)[0]
