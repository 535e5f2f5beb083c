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


def _inverse_cdf(keys: jax.Array, weights: jax.Array, block: int = 256) -> jax.Array:
  """Exact categorical sampling from unnormalised non-negative weights [S, V]: one uniform per row
  against the CDF, in two levels (blocks of the vocabulary, then tokens in the chosen block).
  Avoids Gumbel-max, which draws one random number per vocabulary entry, and a 150k-long cumsum,
  each ~10x slower on CPU."""
  rows, vocab = weights.shape
  nb = -(-vocab // block)
  w = jnp.pad(weights, ((0, 0), (0, nb * block - vocab))).reshape(rows, nb, block)
  mass = w.sum(-1)  # [rows, nb]
  cdf = jnp.cumsum(mass, axis=-1)
  u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
  target = u * cdf[:, -1]
  b = jnp.minimum(jnp.sum(cdf < target[:, None], axis=-1), nb - 1)
  before = (
    jnp.take_along_axis(cdf, b[:, None], 1)[:, 0] - jnp.take_along_axis(mass, b[:, None], 1)[:, 0]
  )
  inner = jnp.take_along_axis(w, b[:, None, None], 1)[:, 0]  # [rows, block]
  j = jnp.sum(jnp.cumsum(inner, axis=-1) < (target - before)[:, None], axis=-1)
  last_valid = jnp.max(jnp.where(inner > 0, jnp.arange(block)[None], 0), axis=-1)
  j = jnp.minimum(j, last_valid)
  return jnp.minimum(b * block + j, vocab - 1).astype(jnp.int32)


SamplingMode = Literal["greedy", "sample", "truncate"]


def mode_for(settings: Iterable[SamplingParams]) -> SamplingMode:
  """The cheapest compiled path that serves every slot: all greedy; plain temperature sampling;
  or top-p/top-k truncation (a sort over the vocabulary) when any slot asks for it."""
  settings = list(settings)
  if all(s.greedy for s in settings):
    return "greedy"
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
  others are faster when `mode_for` allows them. Returns (tokens [S] int32, logprobs [S]).
  """
  greedy = temperature <= 0.0
  temp = jnp.where(greedy, 1.0, temperature)[:, None]
  logits = logits.astype(jnp.float32)
  best, top = argmax_with_max(logits)
  if mode == "greedy":
    # The chosen logit is the row maximum, so token_logprobs(logits, best, temp)
    # = (top - top) / temp - log sum exp((logits - top) / temp): the same arithmetic in one pass
    # over [S, V] (the exp-sum) instead of three (max, exp-sum, gather).
    return best, -jnp.log(jnp.sum(jnp.exp((logits - top[:, None]) / temp), axis=-1))
  step_keys = jax.vmap(jax.random.fold_in)(keys, positions)
  if mode == "sample":
    # exp((logits - max) / temp) is both the draw's weights and token_logprobs' exp-sum terms:
    # computed once, it serves both (one exp pass over [S, V] instead of two, and no second max).
    m = top[:, None]
    weights = jnp.exp((logits - m) / temp)
    drawn = _inverse_cdf(step_keys, weights)
    tokens = jnp.where(greedy, best, drawn).astype(jnp.int32)
    picked = jnp.take_along_axis(logits, tokens[:, None], axis=-1)
    return tokens, ((picked - m) / temp)[:, 0] - jnp.log(jnp.sum(weights, axis=-1))
  scaled = _truncate(logits / temp, top_p, top_k)
  drawn = _inverse_cdf(step_keys, jax.nn.softmax(scaled, axis=-1))
  tokens = jnp.where(greedy, best, drawn).astype(jnp.int32)
  return tokens, token_logprobs(logits, tokens, temp)
