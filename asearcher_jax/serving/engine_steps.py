"""The engine's device side: its state types and the pure step functions, jitted once per process.

`Engine` (engine.py) is the thin stateful wrapper the JetStream contract and the driver call;
everything that runs on the device is here, at module level (prefill, insert, one decode step over
every slot or over a few rows, several decode steps in one call, the two halves of a suffix
prefill of one or several slots, release). Every generate step writes, per slot, the sampled
token, its logprob under the sampling distribution and the policy version of the weights that
produced it into one packed `ResultTokens` array (columns below), so nothing else crosses back to
the host per step.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asearcher_jax.model import kv_cache as kv_lib
from asearcher_jax.model.kv_cache import KVCache, PagedKVCache
from asearcher_jax.model.transformer import Transformer
from asearcher_jax.serving.jetstream import engine_api
from asearcher_jax.serving.sampling import SamplingMode, sample
from asearcher_jax.serving.types import MAX_TOP_LOGPROBS

# ResultTokens.data columns. A step asked for top logprobs (top_n > 0) appends top_n columns of
# token ids, then top_n of their logprob bits.
TOKEN, VALID, LENGTH, LOGPROB, VERSION = range(5)
COLUMNS = 5

# Alternatives per token a step computes when any request asks (`SamplingParams.top_logprobs`, up
# to this many): one static size, so asking compiles one more variant of each step, and a step in
# which no request asks (every RL step) computes and returns nothing more.
TOP_N = MAX_TOP_LOGPROBS


def _top(logits, temperature, top_n: int) -> tuple[jax.Array, jax.Array]:
  """The top_n most likely tokens per row and their logprobs under the sampling distribution
  (softmax of logits / temperature; temperature 1 when greedy), as the chosen token's logprob is
  reported: [R, V] -> ([R, top_n] int32, [R, top_n] float32)."""
  if not top_n:
    return jnp.zeros((logits.shape[0], 0), jnp.int32), jnp.zeros((logits.shape[0], 0), jnp.float32)
  temp = jnp.where(temperature <= 0.0, 1.0, temperature)
  lp = jax.nn.log_softmax(logits.astype(jnp.float32) / temp[:, None], axis=-1)
  values, ids = jax.lax.top_k(lp, top_n)
  return ids.astype(jnp.int32), values


def _top_columns(logits, temperature, top_n: int) -> jax.Array:
  """[R, 2 * top_n] int32 ResultTokens columns: ids, then logprob bits."""
  ids, values = _top(logits, temperature, top_n)
  return jnp.concatenate([ids, jax.lax.bitcast_convert_type(values, jnp.int32)], axis=1)


@flax.struct.dataclass
class VersionedParams:
  """Model weights with the policy version they are (the version rides into every token)."""

  state: nnx.State
  version: jax.Array  # int32 scalar


@flax.struct.dataclass
class Prefix:
  """A prefilled request, ready to insert: its cache rows and its first sampled token."""

  cache: KVCache  # batch 1, length = bucket
  true_length: jax.Array  # tokens in the cache
  next_token: jax.Array  # sampled from the last prompt position; fed at the first generate step
  next_logprob: jax.Array
  version: jax.Array  # policy version of the weights that sampled next_token
  key: jax.Array  # [2] uint32 request key
  temperature: jax.Array
  top_p: jax.Array
  top_k: jax.Array
  top_ids: jax.Array  # [top_n] alternatives to next_token ([0] unless asked)
  top_logprobs: jax.Array  # [top_n]


@flax.struct.dataclass
class DecodeState:
  # [slots, max_seq_len, ...] (EngineConfig.kv_layout "fixed"), or page pools and a page table
  # [slots, pages_per_seq] that the driver's host tables (pages.py) keep up to date ("paged").
  cache: KVCache | PagedKVCache
  lengths: jax.Array  # [S] tokens in each slot's cache = position of the token fed next
  next_tokens: jax.Array  # [S] sampled but not yet in the cache
  keys: jax.Array  # [S, 2]
  temperature: jax.Array  # [S]
  top_p: jax.Array  # [S]
  top_k: jax.Array  # [S]
  # [S] bool: slot holds a request being decoded. Inactive slots (empty, or parked by the
  # driver's prefix cache) still ride through every step, but write their throwaway key/value at
  # the last cache position, which no reusable prefix ever covers (paged: nowhere, reading no
  # page either: `Transformer.extend`'s live), and keep their length.
  active: jax.Array


def _prefill(graphdef, mode: SamplingMode, params: VersionedParams, tokens, true_length, key,
             temperature, top_p, top_k, *, top_n: int = 0) -> Prefix:  # fmt: skip
  model: Transformer = nnx.merge(graphdef, params.state)
  cache = KVCache.init(model.cfg, batch=1, max_len=tokens.shape[1])
  hidden, cache = model.extend(
    tokens, jnp.zeros((1,), jnp.int32), cache, return_hidden=True, fresh=True
  )
  # The output head only at the last prompt position: [1, V] instead of [bucket, V] logits.
  h_last = jax.lax.dynamic_slice_in_dim(hidden, true_length - 1, 1, axis=1)
  last = model.logits(h_last)[0, 0]
  tok, lp = sample(
    last[None], key[None], (true_length - 1)[None], temperature[None], top_p[None], top_k[None],
    mode,
  )  # fmt: skip
  top_ids, top_lps = _top(last[None], temperature[None], top_n)
  return Prefix(cache=cache, true_length=true_length, next_token=tok[0], next_logprob=lp[0],
                version=params.version, key=key, temperature=temperature, top_p=top_p,
                top_k=top_k, top_ids=top_ids[0], top_logprobs=top_lps[0])  # fmt: skip


def _put_prefix(cache: KVCache | PagedKVCache, prefix: KVCache, slot, true_length):
  """A prefilled row [1, bucket] into a slot: the whole row (fixed), or its first true_length
  positions into the pages the slot's table maps (paged; padding is dropped)."""
  if isinstance(cache, PagedKVCache):
    positions = jnp.arange(prefix.max_len)[None]
    table = jax.lax.dynamic_slice_in_dim(cache.page_table, slot, 1, axis=0)
    page, off = kv_lib.page_coordinates(table, positions, positions < true_length, cache.page_size)
    pairs = zip(cache.kv, prefix.k, prefix.v, strict=True)
    return cache.replace(kv=tuple(kv_lib.paged_write(b, k, v, page, off) for b, k, v in pairs))

  def put(buf, new):
    return jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype), (slot, 0, 0, 0))

  return KVCache(
    k=tuple(put(b, n) for b, n in zip(cache.k, prefix.k, strict=True)),
    v=tuple(put(b, n) for b, n in zip(cache.v, prefix.v, strict=True)),
  )


def _insert(prefix: Prefix, state: DecodeState, slot) -> DecodeState:
  cache = _put_prefix(state.cache, prefix.cache, slot, prefix.true_length)
  return DecodeState(
    cache=cache,
    lengths=state.lengths.at[slot].set(prefix.true_length),
    next_tokens=state.next_tokens.at[slot].set(prefix.next_token),
    keys=state.keys.at[slot].set(prefix.key),
    temperature=state.temperature.at[slot].set(prefix.temperature),
    top_p=state.top_p.at[slot].set(prefix.top_p),
    top_k=state.top_k.at[slot].set(prefix.top_k),
    active=state.active.at[slot].set(True),
  )


def _prefill_many(graphdef, mode: SamplingMode, params: VersionedParams, tokens, true_length,
                  key, temperature, top_p, top_k, *, top_n: int = 0) -> Prefix:  # fmt: skip
  """k requests of one bucket in one call: tokens [k, 1, bucket], the rest [k]; every leaf of the
  returned Prefix gains a leading k axis."""
  one = functools.partial(_prefill, graphdef, mode, params, top_n=top_n)
  return jax.vmap(one)(tokens, true_length, key, temperature, top_p, top_k)


def _insert_many(prefixes: Prefix, state: DecodeState, slots) -> DecodeState:
  for i in range(slots.shape[0]):  # k is static: one compiled insert chain per (bucket, k)
    state = _insert(jax.tree.map(lambda x, i=i: x[i], prefixes), state, slots[i])
  return state


def _idle_start(cache: KVCache | PagedKVCache) -> int:
  """Where a row that decodes nothing this step sits. Paged: position 0, not live (it writes
  nothing and reads no page; the ragged kernel gets it with length 0: an idle row at the last
  position made every free slot of a 512-slot replica attend 32k positions each step). Fixed:
  the last position, the scratch token's (never part of a parked prefix)."""
  return 0 if isinstance(cache, PagedKVCache) else cache.max_len - 1


def _generate(
  graphdef,
  attend_len: int,
  mode: SamplingMode,
  params: VersionedParams,
  state: DecodeState,
  *,
  top_n: int = 0,
):
  model: Transformer = nnx.merge(graphdef, params.state)
  # Live slots stay inside the window (the caller's max_length says so). Inactive slots sit at
  # `_idle_start` (paged: position 0, reading and writing nothing; fixed: the cache's last
  # position, never part of a parked prefix) and their samples are discarded.
  last = _idle_start(state.cache)
  start = jnp.where(state.active, jnp.minimum(state.lengths, attend_len - 1), last)
  logits, cache = model.extend(
    state.next_tokens[:, None], start, state.cache, attend_len,
    write_len=state.active.astype(jnp.int32), live=state.active,
  )  # fmt: skip
  tokens, logprobs = sample(
    logits[:, 0], state.keys, start, state.temperature, state.top_p, state.top_k, mode
  )
  lengths = state.lengths + state.active.astype(jnp.int32)
  new_state = state.replace(cache=cache, lengths=lengths, next_tokens=tokens)
  n = tokens.shape[0]
  data = jnp.stack(
    [
      tokens,
      jnp.ones((n,), jnp.int32),
      new_state.lengths,
      jax.lax.bitcast_convert_type(logprobs.astype(jnp.float32), jnp.int32),
      jnp.broadcast_to(params.version, (n,)).astype(jnp.int32),
    ],
    axis=1,
  )
  if top_n:
    data = jnp.concatenate([data, _top_columns(logits[:, 0], state.temperature, top_n)], axis=1)
  result = engine_api.ResultTokens(
    data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3), samples_per_slot=1
  )
  return new_state, result


def _generate_rows(
  graphdef,
  attend_len: int,
  mode: SamplingMode,
  params: VersionedParams,
  state: DecodeState,
  rows,
  live,
  *,
  top_n: int = 0,
):
  """One decode step over the slots `rows` [R] only (distinct; live [R] bool marks the ones that
  decode, the rest pad the step to R and are treated as inactive). Every other slot is untouched.
  Returns the same [S]-row result as _generate: rows not computed carry no valid token."""
  model: Transformer = nnx.merge(graphdef, params.state)
  last = _idle_start(state.cache)
  active = state.active[rows] & live
  start = jnp.where(active, jnp.minimum(state.lengths[rows], attend_len - 1), last)
  logits, cache = model.extend(
    state.next_tokens[rows][:, None], start, state.cache, attend_len, rows=rows,
    write_len=active.astype(jnp.int32), live=active,
  )  # fmt: skip
  tokens, logprobs = sample(
    logits[:, 0], state.keys[rows], start, state.temperature[rows], state.top_p[rows],
    state.top_k[rows], mode,
  )  # fmt: skip
  lengths = state.lengths.at[rows].add(active.astype(jnp.int32))
  next_tokens = state.next_tokens.at[rows].set(jnp.where(active, tokens, state.next_tokens[rows]))
  new_state = state.replace(cache=cache, lengths=lengths, next_tokens=next_tokens)
  n = state.lengths.shape[0]
  lp_bits = jax.lax.bitcast_convert_type(logprobs.astype(jnp.float32), jnp.int32)
  version = jnp.broadcast_to(params.version, rows.shape).astype(jnp.int32)
  computed = jnp.stack([tokens, active.astype(jnp.int32), lengths[rows], lp_bits, version], axis=1)
  if top_n:
    top = _top_columns(logits[:, 0], state.temperature[rows], top_n)
    computed = jnp.concatenate([computed, top], axis=1)
  data = jnp.zeros((n, computed.shape[1]), jnp.int32).at[rows].set(computed)
  result = engine_api.ResultTokens(
    data=data, tokens_idx=(0, 1), valid_idx=(1, 2), length_idx=(2, 3), samples_per_slot=1
  )
  return new_state, result


class ChunkPlan(NamedTuple):
  """What one multi-step decode call runs (a pytree of device arrays; `_decode_chunk`)."""

  rows: jax.Array  # [R] distinct slots computed; R == S means every slot, in order
  live: jax.Array  # [R] bool: rows that decode (the rest pad the call to R)
  budget: jax.Array  # [R] int32: most tokens each row may emit in this call
  stop_ids: jax.Array  # [R, M] int32: token ids that end each row's request (-1 pads)
  steps: jax.Array  # int32 scalar: steps to run, at most the static `max_steps`


def _decode_chunk(graphdef, attend_len: int, mode: SamplingMode, max_steps: int,
                  params: VersionedParams, state: DecodeState, plan: ChunkPlan, *,
                  top_n: int = 0, loop: str = "while"):  # fmt: skip
  """Up to plan.steps decode steps in one call (a while_loop; one dispatch and one host copy
  instead of one per token). Each step is exactly `_generate_rows`' (same sampling keys and
  positions, so the same tokens and logprobs); a row stops emitting once it samples one of its
  stop ids or has emitted its budget, and the loop ends early when no row emits. A row stopped
  by a stop id leaves the call inactive (no later call advances it before the host parks it).
  Returns (state, [max_steps, R, COLUMNS + 2 * top_n] int32): per step and row, the
  `ResultTokens` columns, VALID = the row emitted that token. loop: "while" stops early; "fixed"
  and "unrolled" run max_steps iterations (known trip count), the ones past plan.steps or every
  row's stop emitting nothing and writing only the scratch cache position (EngineConfig)."""
  model: Transformer = nnx.merge(graphdef, params.state)
  rows, n_slots = plan.rows, state.lengths.shape[0]
  every = rows.shape[0] == n_slots  # static: no gather, row i is slot i
  last = _idle_start(state.cache)
  run = state.active[rows] & plan.live & (plan.budget > 0)
  keys, temp = state.keys[rows], state.temperature[rows]
  top_p, top_k = state.top_p[rows], state.top_k[rows]
  version = jnp.broadcast_to(params.version, rows.shape).astype(jnp.int32)
  out = jnp.zeros((max_steps, rows.shape[0], COLUMNS + 2 * top_n), jnp.int32)

  def emitting(i, done):
    return ~done & (i < plan.budget) & (i < plan.steps)

  def cond(carry):
    i, *_, done, _, _ = carry
    return (i < plan.steps) & jnp.any(emitting(i, done))

  def body(carry):
    i, cache, lengths, tok, done, stopped, out = carry
    go = emitting(i, done)
    start = jnp.where(go, jnp.minimum(lengths, attend_len - 1), last)
    logits, cache = model.extend(
      tok[:, None], start, cache, attend_len, rows=None if every else rows,
      write_len=go.astype(jnp.int32), live=go,
    )  # fmt: skip
    new, lp = sample(logits[:, 0], keys, start, temp, top_p, top_k, mode)
    lengths = lengths + go.astype(jnp.int32)
    tok = jnp.where(go, new, tok)
    hit = go & jnp.any(new[:, None] == plan.stop_ids, axis=1)
    lp_bits = jax.lax.bitcast_convert_type(lp.astype(jnp.float32), jnp.int32)
    step = jnp.stack([new, go.astype(jnp.int32), lengths, lp_bits, version], axis=1)
    if top_n:
      step = jnp.concatenate([step, _top_columns(logits[:, 0], temp, top_n)], axis=1)
    return i + 1, cache, lengths, tok, done | hit | ~go, stopped | hit, out.at[i].set(step)

  carry = (jnp.int32(0), state.cache, state.lengths[rows], state.next_tokens[rows], ~run,
           jnp.zeros_like(run), out)  # fmt: skip
  if loop == "while":
    carry = jax.lax.while_loop(cond, body, carry)
  else:
    unroll = max_steps if loop == "unrolled" else 1
    carry = jax.lax.fori_loop(0, max_steps, lambda _, c: body(c), carry, unroll=unroll)
  _, cache, lengths, tok, _, stopped, out = carry
  new_state = state.replace(
    cache=cache,
    lengths=state.lengths.at[rows].set(lengths),
    next_tokens=state.next_tokens.at[rows].set(tok),
    active=state.active.at[rows].set(state.active[rows] & ~stopped),
  )
  return new_state, out


class RowSampling(NamedTuple):
  """One slot's sampling arrays (a pytree): PRNG key, temperature, top-p, top-k."""

  key: jax.Array
  temperature: jax.Array
  top_p: jax.Array
  top_k: jax.Array


def _extend_row(graphdef, attend_len: int, mode: SamplingMode, params: VersionedParams,
                cache: KVCache, slot, tokens, start, true_length, samp: RowSampling, *,
                top_n: int = 0):  # fmt: skip
  """The compute half of a suffix prefill: reads the slot's cache row (a copy of one row; the
  decode state is not donated here), prefills the suffix tokens [1, bucket] (true_length of them)
  at offset start and samples the first new token from the last suffix position. Returns (the
  row's new cache, token, logprob, version, (top ids [top_n], their logprobs))."""
  key, temperature, top_p, top_k = samp
  model: Transformer = nnx.merge(graphdef, params.state)

  def row(buf):
    return jax.lax.dynamic_slice_in_dim(buf, slot, 1, axis=0)

  row_cache = KVCache(k=tuple(map(row, cache.k)), v=tuple(map(row, cache.v)))
  hidden, row_cache = model.extend(tokens, start[None], row_cache, attend_len, return_hidden=True)
  h_last = jax.lax.dynamic_slice_in_dim(hidden, true_length - 1, 1, axis=1)
  last = model.logits(h_last)[0, 0]
  pos = start + true_length - 1
  tok, lp = sample(
    last[None], key[None], pos[None], temperature[None], top_p[None], top_k[None], mode
  )  # fmt: skip
  top_ids, top_lps = _top(last[None], temperature[None], top_n)
  return row_cache, tok[0], lp[0], params.version, (top_ids[0], top_lps[0])


def _put_row(state: DecodeState, row_cache: KVCache, slot, length, token, key, temperature,
             top_p, top_k) -> DecodeState:  # fmt: skip
  """The write half of a suffix prefill: the row goes back into the donated decode state in
  place, and the slot is activated. Kept apart from `_extend_row` because XLA:CPU copies the
  whole cache (every slot, ~200 MB in the quickstart) when one jitted call both reads a row of a
  donated buffer and writes it back: 88 ms per admission, against 13-18 ms for both halves
  split like this (20- to 120-token suffixes on the quickstart model)."""

  def put(buf, new):
    return jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype), (slot, 0, 0, 0))

  cache = KVCache(
    k=tuple(put(b, n) for b, n in zip(state.cache.k, row_cache.k, strict=True)),
    v=tuple(put(b, n) for b, n in zip(state.cache.v, row_cache.v, strict=True)),
  )
  return _activate(state.replace(cache=cache), slot, length, token, key, temperature, top_p, top_k)


def _activate(state: DecodeState, slot, length, token, key, temperature, top_p,
              top_k) -> DecodeState:  # fmt: skip
  """Makes a slot live with `length` positions cached and `token` to feed next, under a
  request's sampling arrays: the next decode step feeds the token at position `length` and
  samples from it, as a prefill of the same prompt would have (same key, same position)."""
  return DecodeState(
    cache=state.cache,
    lengths=state.lengths.at[slot].set(length),
    next_tokens=state.next_tokens.at[slot].set(token),
    keys=state.keys.at[slot].set(key),
    temperature=state.temperature.at[slot].set(temperature),
    top_p=state.top_p.at[slot].set(top_p),
    top_k=state.top_k.at[slot].set(top_k),
    active=state.active.at[slot].set(True),
  )


def _extend_rows(graphdef, attend_len: int, mode: SamplingMode, params: VersionedParams,
                 cache: KVCache, slots, tokens, starts, true_lengths, samp: RowSampling, *,
                 top_n: int = 0):  # fmt: skip
  """`_extend_row` for k parked slots in one call: slots [k] (distinct), tokens [k, bucket],
  starts and true_lengths [k], samp's leaves [k]. One dispatch, one pass over the weights and k
  rows of work instead of k of each: an agent's turns come back from their tools in bursts, and
  on a small model each suffix prefill is mostly fixed cost. Returns (the rows' new caches [k,
  ...], tokens [k], logprobs [k], version, (top ids [k, top_n], their logprobs))."""
  model: Transformer = nnx.merge(graphdef, params.state)
  rows = KVCache(k=tuple(b[slots] for b in cache.k), v=tuple(b[slots] for b in cache.v))
  hidden, rows = model.extend(tokens, starts, rows, attend_len, return_hidden=True)
  h_last = jnp.take_along_axis(hidden, (true_lengths - 1)[:, None, None], axis=1)
  last = model.logits(h_last)[:, 0]
  pos = starts + true_lengths - 1
  tok, lp = sample(last, samp.key, pos, samp.temperature, samp.top_p, samp.top_k, mode)
  return rows, tok, lp, params.version, _top(last, samp.temperature, top_n)


def _put_rows(state: DecodeState, rows: KVCache, slots, lengths, tokens,
              samp: RowSampling) -> DecodeState:  # fmt: skip
  """The write half of `_extend_rows`: row i goes into slot slots[i] in place (k is static: a
  chain of row writes, as `_insert_many`), and the slots are activated."""
  for i in range(slots.shape[0]):
    row = KVCache(k=tuple(b[i : i + 1] for b in rows.k), v=tuple(b[i : i + 1] for b in rows.v))
    state = _put_row(state, row, slots[i], lengths[i], tokens[i], samp.key[i],
                     samp.temperature[i], samp.top_p[i], samp.top_k[i])  # fmt: skip
  return state


def _extend_paged(graphdef, attend_len: int, mode: SamplingMode, params: VersionedParams,
                  state: DecodeState, slots, tokens, starts, true_lengths, write_lengths,
                  samp: RowSampling, *, top_n: int = 0):  # fmt: skip
  """A suffix prefill of k slots over a paged cache, in place: tokens [k, bucket] (true_lengths
  of them) at offsets starts attend the pages each slot's table maps, write the keys/values of
  their first write_lengths tokens into them (0 where those positions are cached already, in
  pages other slots share), sample each first token and activate the slots. No row copy is
  needed (the write is a scatter into the donated pools), so one call does what `_extend_rows`
  and `_put_rows` do for a fixed cache. Returns (state, tokens [k], logprobs [k], version, (top
  ids [k, top_n], their logprobs))."""
  model: Transformer = nnx.merge(graphdef, params.state)
  hidden, cache = model.extend(
    tokens, starts, state.cache, attend_len, return_hidden=True, rows=slots,
    write_len=write_lengths,
  )  # fmt: skip
  h_last = jnp.take_along_axis(hidden, (true_lengths - 1)[:, None, None], axis=1)
  last = model.logits(h_last)[:, 0]
  pos = starts + true_lengths - 1
  tok, lp = sample(last, samp.key, pos, samp.temperature, samp.top_p, samp.top_k, mode)
  state = DecodeState(
    cache=cache,
    lengths=state.lengths.at[slots].set(starts + true_lengths),
    next_tokens=state.next_tokens.at[slots].set(tok),
    keys=state.keys.at[slots].set(samp.key),
    temperature=state.temperature.at[slots].set(samp.temperature),
    top_p=state.top_p.at[slots].set(samp.top_p),
    top_k=state.top_k.at[slots].set(samp.top_k),
    active=state.active.at[slots].set(True),
  )
  return state, tok, lp, params.version, _top(last, samp.temperature, top_n)


def _release(state: DecodeState, slot) -> DecodeState:
  return state.replace(active=state.active.at[slot].set(False))


def result_logprobs(result: engine_api.ResultTokens) -> np.ndarray:
  """Per-slot logprobs [S] from a host copy of a ResultTokens."""
  return np.asarray(result.data[:, LOGPROB]).astype(np.int32).view(np.float32)


def result_versions(result: engine_api.ResultTokens) -> np.ndarray:
  return np.asarray(result.data[:, VERSION])


def result_top(data: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
  """Per-slot top alternatives (ids [S, top_n], logprobs [S, top_n]) from a host copy of a
  ResultTokens' data, or None when the step computed none."""
  n = (data.shape[1] - COLUMNS) // 2
  if n <= 0:
    return None
  lps = np.ascontiguousarray(data[:, COLUMNS + n :]).astype(np.int32).view(np.float32)
  return data[:, COLUMNS : COLUMNS + n], lps


# Compiled once per process and shared by every Engine over the same model structure (graphdef,
# window and mode are static; shapes key the rest), so building a second engine or restarting a
# driver pays no compile.
PREFILL = jax.jit(_prefill, static_argnums=(0, 1), static_argnames="top_n")
PREFILL_MANY = jax.jit(_prefill_many, static_argnums=(0, 1), static_argnames="top_n")
INSERT = jax.jit(_insert, donate_argnums=1)
INSERT_MANY = jax.jit(_insert_many, donate_argnums=1)
GENERATE = jax.jit(_generate, static_argnums=(0, 1, 2), static_argnames="top_n", donate_argnums=4)
GENERATE_ROWS = jax.jit(
  _generate_rows, static_argnums=(0, 1, 2), static_argnames="top_n", donate_argnums=4
)
DECODE_CHUNK = jax.jit(
  _decode_chunk, static_argnums=(0, 1, 2, 3), static_argnames=("top_n", "loop"), donate_argnums=5
)
EXTEND_ROW = jax.jit(_extend_row, static_argnums=(0, 1, 2), static_argnames="top_n")
PUT_ROW = jax.jit(_put_row, donate_argnums=0)
ACTIVATE = jax.jit(_activate, donate_argnums=0)
EXTEND_ROWS = jax.jit(_extend_rows, static_argnums=(0, 1, 2), static_argnames="top_n")
PUT_ROWS = jax.jit(_put_rows, donate_argnums=0)
RELEASE = jax.jit(_release, donate_argnums=0)
EXTEND_PAGED = jax.jit(
  _extend_paged, static_argnums=(0, 1, 2), static_argnames="top_n", donate_argnums=4
)
