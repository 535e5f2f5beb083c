"""The sampler: exact truncation sets, the right distribution, and consistent compiled paths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asearcher_jax.model.transformer import token_logprobs
from asearcher_jax.serving import sampling
from asearcher_jax.serving.types import SamplingParams


def test_truncation_matches_a_sort_based_reference():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((6, 1000)) * 3, jnp.float32)
  top_p = jnp.array([1.0, 0.9, 0.5, 1.0, 0.3, 1e-4])
  top_k = jnp.array([0, 0, 0, 5, 10, 0])
  keep = np.asarray(sampling._truncate(x, top_p, top_k)) > -1e29
  for i in range(6):
    xs = np.asarray(x[i])
    order = np.argsort(-xs)
    p = np.exp(xs - xs.max())
    p /= p.sum()
    n_p = int(np.searchsorted(np.cumsum(p[order]), float(top_p[i])) + 1) if top_p[i] < 1 else 1000
    n_k = int(top_k[i]) if top_k[i] > 0 else 1000
    assert set(np.flatnonzero(keep[i])) == set(order[: min(n_p, n_k)].tolist())


def test_argmax_matches_numpy_including_ties():
  rng = np.random.default_rng(1)
  x = rng.standard_normal((4, 1000)).astype(np.float32)
  x[2, [10, 700]] = 50.0  # tie: the first index wins, as np.argmax
  assert np.asarray(sampling.argmax(jnp.asarray(x))).tolist() == np.argmax(x, -1).tolist()
  best, top = sampling.argmax_with_max(jnp.asarray(x[:, :999]))  # 999: a ragged last block
  assert np.asarray(best).tolist() == np.argmax(x[:, :999], -1).tolist()
  assert np.asarray(top).tolist() == x[:, :999].max(-1).tolist()


def test_draw_samples_the_softmax_distribution():
  probs = np.array([0.05, 0.15, 0.3, 0.5] + [0.0] * 300, np.float32)  # spans two blocks
  probs = np.roll(probs, 126)  # put the mass across a block boundary (block = 128)
  n = 40_000
  keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(n))
  logits = jnp.tile(jnp.log(jnp.asarray(probs)) - 2.0, (n, 1))  # zero mass: -inf logits
  top, one = jnp.max(logits, -1), jnp.ones((n,))

  @jax.jit
  def draw(keys, logits):
    xb = sampling._blocks(logits, sampling._BLOCK)
    mass = sampling._block_mass(xb, top, one)
    return sampling._draw(keys, xb, mass, jnp.cumsum(mass, -1), top, one)

  draws = np.asarray(draw(keys, logits))
  freq = np.bincount(draws, minlength=probs.size) / n
  np.testing.assert_allclose(freq, probs, atol=0.01)
  assert set(np.flatnonzero(freq)) <= set(np.flatnonzero(probs))


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_compiled_paths_agree(temperature):
  rng = np.random.default_rng(2)
  logits = jnp.asarray(rng.standard_normal((8, 2000)) * 2, jnp.float32)
  keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(8))
  pos = jnp.arange(8)
  temp = jnp.full((8,), temperature)
  ones, zeros = jnp.ones((8,)), jnp.zeros((8,), jnp.int32)
  general = sampling.sample(logits, keys, pos, temp, ones, zeros, "truncate")
  fast = sampling.sample(
    logits, keys, pos, temp, ones, zeros, "greedy" if temperature == 0 else "sample"
  )
  assert np.asarray(general[0]).tolist() == np.asarray(fast[0]).tolist()
  t = 1.0 if temperature == 0 else temperature
  want = token_logprobs(logits, fast[0], t)
  np.testing.assert_allclose(np.asarray(fast[1]), np.asarray(want), atol=1e-6)


def test_mode_for():
  g, s, p = (
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.0),
    SamplingParams(top_p=0.9),
  )
  assert sampling.mode_for([g, g]) == "greedy"
  assert sampling.mode_for([g, s]) == "sample"
  assert sampling.mode_for([s, p]) == "truncate"
  assert sampling.mode_for([g, SamplingParams(temperature=0, top_k=3)]) == "greedy"
  quiet = SamplingParams(temperature=0, logprobs=False)
  assert sampling.mode_for([quiet, quiet]) == "argmax"
  assert sampling.mode_for([quiet, g]) == "greedy"  # one slot wants logprobs: all get them
  assert sampling.mode_for([quiet, s]) == "sample"


def test_argmax_mode_skips_logprobs_only():
  rng = np.random.default_rng(3)
  logits = jnp.asarray(rng.standard_normal((4, 3000)) * 2, jnp.float32)
  keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(4))
  args = (logits, keys, jnp.arange(4), jnp.zeros((4,)), jnp.ones((4,)), jnp.zeros((4,), jnp.int32))
  tok_g, lp_g = sampling.sample(*args, "greedy")
  tok_a, lp_a = sampling.sample(*args, "argmax")
  assert np.asarray(tok_a).tolist() == np.asarray(tok_g).tolist() == np.argmax(logits, -1).tolist()
  assert np.isnan(np.asarray(lp_a)).all() and np.isfinite(np.asarray(lp_g)).all()
