"""Per-slot sampling: greedy, temperature, top-k, top-p, with per-request seeds.

Every slot carries its own sampling parameters and PRNG key, so requests with different settings
share one compiled decode step. The key for a token is fold_in(request key, position), which
makes sampling independent of which slot or batch a request lands in. The reported logprob is
`transformer.token_logprobs` at the request's temperature (1 when greedy), before truncation:
the learner recomputes exactly that number.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import jax
import jax.numpy as jnp

from asearcher_jax.model.transformer import token_logprobs
from asearcher_jax.serving.types import SamplingParams

_NEG_INF = -1e30
_BLOCK = 128  # vocabulary block for the two-level reductions and draws


def _largest_threshold(
  values: jax.Array, lo: jax.Array, hi: jax.Array, ok, iters: int = 24
) -> jax.Array:
  """Per row, the largest t in [lo, hi] with ok(t) (ok must hold at lo and be monotone: true
  below some point, false above), by bisection: ~iters cheap passes instead of a sort."""

  def body(_, bounds):
    lo, hi = bounds
    mid = 0.5 * (lo + hi)
    good = ok(mid)
    return jnp.where(good, mid, lo), jnp.where(good, hi, mid)

  lo, hi = jax.lax.fori_loop(0, iters, body, (lo, hi))
  return jnp.where(ok(hi), hi, lo)


def _truncate(scaled: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
  """Masks logits outside top-k and outside the top-p nucleus (the smallest set of most likely
  tokens whose mass reaches top_p; ties at the boundary are kept, and the most likely token
  always survives). Thresholds come from bisection, not a sort: sorting 150k logits per row is
  ~100x slower on CPU."""
  vocab = scaled.shape[-1]
  top = jnp.max(scaled, axis=-1)
  bottom = jnp.min(scaled, axis=-1)
  probs = jax.nn.softmax(scaled, axis=-1)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)

  def enough_count(t):
    return jnp.sum(scaled >= t[:, None], axis=-1) >= k

  def enough_mass(t):
    return jnp.sum(jnp.where(scaled >= t[:, None], probs, 0.0), axis=-1) >= top_p

  # Each search runs only when some row needs it (24 halvings of the logit range: ~1e-6).
  t_k = jax.lax.cond(
    jnp.any(top_k > 0),
    lambda: _largest_threshold(scaled, bottom, top, enough_count),
    lambda: bottom,
  )
  t_p = jax.lax.cond(
    jnp.any(top_p < 1.0),
    lambda: jnp.where(top_p < 1.0, _largest_threshold(scaled, bottom, top, enough_mass), bottom),
    lambda: bottom,
  )
  keep = scaled >= jnp.minimum(jnp.maximum(t_k, t_p), top)[:, None]
  return jnp.where(keep, scaled, _NEG_INF)


def argmax_with_max(x: jax.Array, block: int = 128) -> tuple[jax.Array, jax.Array]:
  """First index of the row maximum and the maximum itself, [S, V] -> ([S] int32, [S]). Block
  maxima first, then an argmax over the blocks and one within the winning block: XLA:CPU's
  variadic argmax reduction over a 150k vocabulary is ~10x slower than these plain reductions.
  The row maximum falls out of the block maxima, so callers that also need it (log-softmax) skip
  a full pass over the vocabulary. Ties resolve to the first index."""
  rows, vocab = x.shape
  nb = -(-vocab // block)
  if nb * block != vocab:
    x = jnp.pad(x, ((0, 0), (0, nb * block - vocab)), constant_values=-jnp.inf)
  xb = x.reshape(rows, nb, block)
  block_max = xb.max(-1)
  b = jnp.argmax(block_max, axis=-1)
  inner = jnp.take_along_axis(xb, b[:, None, None], axis=1)[:, 0]
  best = (b * block + jnp.argmax(inner, axis=-1)).astype(jnp.int32)
  return best, jnp.take_along_axis(block_max, b[:, None], axis=1)[:, 0]


def argmax(x: jax.Array, block: int = 128) -> jax.Array:
  """First index of the row maximum, [S, V] -> [S] (see argmax_with_max)."""
  return argmax_with_max(x, block)[0]


def _blocks(x: jax.Array, block: int) -> jax.Array:
  """[S, V] -> [S, ceil(V / block), block], padding the last block with -inf (exp -> 0). Free
  when block divides V (Qwen's 151,936 = 128 * 1,187), a copy otherwise."""
  rows, vocab = x.shape
  nb = -(-vocab // block)
  if nb * block != vocab:
    x = jnp.pad(x, ((0, 0), (0, nb * block - vocab)), constant_values=-jnp.inf)
  return x.reshape(rows, nb, block)


def _block_mass(xb: jax.Array, top: jax.Array, temp: jax.Array) -> jax.Array:
  """sum exp((x - top) / temp) per block, [S, nb, block] -> [S, nb]. Summing blocks first and the
  block masses second is ~2x faster on XLA:CPU than one exp-sum over the 150k minor axis, provided
  the second level is a cumsum (`_draw` needs one anyway): a plain sum there lets XLA fuse the
  two levels back into the slow single reduction (measured: 1.5 vs 2.9 ms at [32, 151936])."""
  return jnp.sum(jnp.exp((xb - top[:, None, None]) / temp[:, None, None]), axis=-1)


def _draw(
  keys: jax.Array,
  xb: jax.Array,
  mass: jax.Array,
  cdf: jax.Array,
  top: jax.Array,
  temp: jax.Array,
) -> jax.Array:
  """Exact categorical sampling from softmax(x / temp), x in blocks [S, nb, block] with their
  masses [S, nb] (`_block_mass`) and the masses' cumsum `cdf`: one uniform per row against the
  CDF, in two levels (blocks of the vocabulary, then tokens in the chosen block, whose weights
  are recomputed from its logits). Avoids Gumbel-max, which draws one random number per
  vocabulary entry, a 150k-long cumsum, and materialising the [S, V] weights, each several times
  slower on CPU. Returns [S] int32."""
  _, nb, block = xb.shape
  u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
  target = u * cdf[:, -1]
  b = jnp.minimum(jnp.sum(cdf < target[:, None], axis=-1), nb - 1)
  before = (
    jnp.take_along_axis(cdf, b[:, None], 1)[:, 0] - jnp.take_along_axis(mass, b[:, None], 1)[:, 0]
  )
  inner = jnp.take_along_axis(xb, b[:, None, None], 1)[:, 0]  # [rows, block]
  inner = jnp.exp((inner - top[:, None]) / temp[:, None])
  j = jnp.sum(jnp.cumsum(inner, axis=-1) < (target - before)[:, None], axis=-1)
  last_valid = jnp.max(jnp.where(inner > 0, jnp.arange(block)[None], 0), axis=-1)
  return (b * block + jnp.minimum(j, last_valid)).astype(jnp.int32)


SamplingMode = Literal["argmax", "greedy", "sample", "truncate"]


def mode_for(settings: Iterable[SamplingParams]) -> SamplingMode:
  """The cheapest compiled path that serves every slot: all greedy without logprobs (argmax
  only); all greedy; plain temperature sampling; or top-p/top-k truncation (bisection for the
  thresholds) when any slot asks for it."""
  settings = list(settings)
  if all(s.greedy for s in settings):
    return "greedy" if any(s.logprobs for s in settings) else "argmax"
  if any(not s.greedy and (s.top_p < 1.0 or s.top_k > 0) for s in settings):
    return "truncate"
  return "sample"


def sample(
  logits: jax.Array,
  keys: jax.Array,
  positions: jax.Array,
  temperature: jax.Array,
  top_p: jax.Array,
  top_k: jax.Array,
  mode: SamplingMode = "truncate",
) -> tuple[jax.Array, jax.Array]:
  """Samples one token per row. logits [S, V]; keys [S, 2] uint32; the rest [S].

  `mode` (static) picks the compiled path; "truncate" is correct for any mix of settings, the
  others are faster when `mode_for` allows them. Returns (tokens [S] int32, logprobs [S]; NaN in
  "argmax" mode).
  """
  greedy = temperature <= 0.0
  temp = jnp.where(greedy, 1.0, temperature)
  logits = logits.astype(jnp.float32)
  best, top = argmax_with_max(logits)
  if mode == "argmax":
    return best, jnp.full(best.shape, jnp.nan, jnp.float32)  # no slot wants its logprob
  xb = _blocks(logits, _BLOCK)
  # mass holds the exp-sum terms of token_logprobs (the chosen logit minus the row maximum, over
  # temp, minus log sum exp((logits - max) / temp)) and, in "sample" mode, the draw's block weights
  # too: one exp pass over [S, V] serves both.
  mass = _block_mass(xb, top, temp)
  cdf = jnp.cumsum(mass, axis=-1)
  log_total = jnp.log(cdf[:, -1])
  if mode == "greedy":
    return best, -log_total  # the chosen logit is the row maximum
  step_keys = jax.vmap(jax.random.fold_in)(keys, positions)
  if mode == "sample":
    tokens = jnp.where(greedy, best, _draw(step_keys, xb, mass, cdf, top, temp))
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return tokens, (picked - top) / temp - log_total
  scaled = _truncate(logits / temp[:, None], top_p, top_k)
  sb = _blocks(scaled, _BLOCK)
  one = jnp.ones_like(temp)
  smass = _block_mass(sb, top / temp, one)
  drawn = _draw(step_keys, sb, smass, jnp.cumsum(smass, axis=-1), top / temp, one)
  tokens = jnp.where(greedy, best, drawn).astype(jnp.int32)
  return tokens, token_logprobs(logits, tokens, temp[:, None])
