"""Prefix reuse: an agent's next turn continues in its previous turn's parked slot, exactly."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from flax import nnx

from asearcher_jax.serving.prefix_cache import PrefixCache
from asearcher_jax.serving.types import SamplingParams
from tests.serving.conftest import BOTH_STEPS, tiny_model
from tests.serving.test_driver_correctness import greedy_reference, learner_logprobs

GREEDY = SamplingParams(temperature=0.0)
NO_STOP: tuple[int, ...] = ()
PROMPT = [9, 3, 88, 31, 2, 40, 76, 61, 14, 3, 90, 11]
TOOL = [17, 42, 5, 66, 23]


async def gen(driver, prompt, n, sp=GREEDY, **kw):
  return await asyncio.wait_for(driver.generate(prompt, sp, n, stop_token_ids=NO_STOP, **kw), 120)


async def turns(driver, n_turns=3, sp=GREEDY, n=6):
  """Agent-like calls: each prompt = previous prompt + its output + a tool result."""
  prompt, out = list(PROMPT), []
  for _ in range(n_turns):
    res = await gen(driver, prompt, n, sp)
    out.append((list(prompt), res))
    prompt = prompt + res.tokens + TOOL
  return out


@BOTH_STEPS
async def test_multi_turn_equals_full_prefill(make_driver):
  model = tiny_model(seed=1)
  reuse = make_driver(model, slots=2)
  plain = make_driver(model, slots=2, prefix_reuse=False)
  a, b = await turns(reuse), await turns(plain)
  for (prompt, ra), (_, rb) in zip(a, b, strict=True):
    assert ra.tokens == rb.tokens == greedy_reference(model, prompt, 6)
    np.testing.assert_allclose(ra.logprobs, rb.logprobs, atol=1e-4)
    np.testing.assert_allclose(
      ra.logprobs, learner_logprobs(model, prompt, ra.tokens, 1.0), atol=1e-4
    )
  s = reuse.stats()
  assert s["prefix_hits"] == 2
  # Turn k+1 reuses turn k's prompt + tokens but the last (never fed to the model).
  reused = sum(len(p) + len(r.tokens) - 1 for p, r in a[:-1])
  assert s["prefix_tokens_reused"] == reused
  assert s["prefill_tokens"] == sum(len(p) for p, _ in a) - reused
  assert s["slots_parked"] == 1 and s["slots_active"] == 0
  assert plain.stats()["prefix_hits"] == 0 and plain.stats()["slots_parked"] == 0


@pytest.mark.slow
@BOTH_STEPS
async def test_sampled_continuation_equals_full_prefill(make_driver):
  model = tiny_model(seed=2)
  sp = SamplingParams(temperature=0.8, seed=7)
  a = await turns(make_driver(model, slots=2), sp=sp, n=8)
  b = await turns(make_driver(model, slots=2, prefix_reuse=False), sp=sp, n=8)
  for (prompt, ra), (_, rb) in zip(a, b, strict=True):
    assert ra.tokens == rb.tokens
    np.testing.assert_allclose(ra.logprobs, rb.logprobs, atol=1e-4)
    np.testing.assert_allclose(
      ra.logprobs, learner_logprobs(model, prompt, ra.tokens, 0.8), atol=1e-4
    )


@BOTH_STEPS
async def test_parked_slot_kept_while_others_decode(make_driver):
  """A long parked prefix stays intact while other slots decode over a smaller window (the
  parked 33 tokens exceed their 32-token window) and the step ahead of its stop is discarded."""
  model = tiny_model(seed=3)
  driver = make_driver(model, slots=3)
  long_prompt = PROMPT * 2 + [4, 8]
  first = await gen(driver, long_prompt, 8)
  await asyncio.gather(gen(driver, [7], 20), gen(driver, [5, 6], 20))
  prompt2 = long_prompt + first.tokens + [3, 1]
  res = await gen(driver, prompt2, 6)
  assert driver.stats()["prefix_hits"] == 1
  assert res.tokens == greedy_reference(model, prompt2, 6)
  np.testing.assert_allclose(res.logprobs, learner_logprobs(model, prompt2, res.tokens, 1.0),
                             atol=1e-4)  # fmt: skip


async def test_weight_update_invalidates(make_driver):
  model = tiny_model(seed=1)
  driver = make_driver(model, slots=2)
  first = await gen(driver, PROMPT, 6)
  assert driver.stats()["slots_parked"] == 1
  new_model = tiny_model(seed=5)
  driver.update_params(nnx.state(new_model), version=1)
  assert driver.stats()["slots_parked"] == 0
  prompt2 = PROMPT + first.tokens + TOOL
  res = await gen(driver, prompt2, 6)
  assert driver.stats()["prefix_hits"] == 0
  assert res.versions == [1] * 6
  assert res.tokens == greedy_reference(new_model, prompt2, 6)


async def test_lru_reclaim_when_slots_full(make_driver):
  model = tiny_model(seed=1)
  driver = make_driver(model, slots=2)
  pa, pb = [5, 17, 42], [1, 2, 3, 4, 5]
  ra = await gen(driver, pa, 4)
  rb = await gen(driver, pb, 4)  # A parked first: least recently used
  assert driver.stats()["slots_parked"] == 2
  await gen(driver, [60, 61], 4)  # no free slot: reclaims A's
  s = driver.stats()
  assert s["prefix_evictions"] == 1 and s["prefix_hits"] == 0
  nb = pb + rb.tokens + TOOL
  res_b = await gen(driver, nb, 5)
  assert driver.stats()["prefix_hits"] == 1
  na = pa + ra.tokens + TOOL
  res_a = await gen(driver, na, 5)
  assert driver.stats()["prefix_hits"] == 1  # A's prefix was forgotten
  assert res_b.tokens == greedy_reference(model, nb, 5)
  assert res_a.tokens == greedy_reference(model, na, 5)


@pytest.mark.slow
@BOTH_STEPS
async def test_abort_of_reused_request(make_driver):
  model = tiny_model(seed=4)
  # A budget far beyond the 3 tokens awaited: on a loaded machine the polling loop may see the
  # progress late (with several decode steps per call, a few calls late is many tokens).
  driver = make_driver(model, slots=2, max_seq_len=128)
  first = await gen(driver, PROMPT, 4)
  prompt2 = PROMPT + first.tokens + TOOL
  task = asyncio.ensure_future(gen(driver, prompt2, 80, request_id="r2"))
  for _ in range(2000):
    p = driver.progress("r2")
    if p is not None and len(p[0]) >= 3:
      break
    await asyncio.sleep(0.005)
  assert driver.abort("r2")
  partial = await task
  assert partial.stop_reason == "abort" and driver.stats()["prefix_hits"] == 1
  # The aborted request's slot is parked too: continue from what it produced.
  prompt3 = prompt2 + partial.tokens + [2, 2]
  res = await gen(driver, prompt3, 5)
  assert driver.stats()["prefix_hits"] == 2
  assert partial.tokens == greedy_reference(model, prompt2, len(partial.tokens), width=128)
  assert res.tokens == greedy_reference(model, prompt3, 5, width=128)
  np.testing.assert_allclose(res.logprobs, learner_logprobs(model, prompt3, res.tokens, 1.0),
                             atol=1e-4)  # fmt: skip


async def test_cancelled_reused_request(make_driver):
  model = tiny_model(seed=4)
  driver = make_driver(model, slots=1)
  first = await gen(driver, PROMPT, 4)
  prompt2 = PROMPT + first.tokens + TOOL
  task = asyncio.ensure_future(gen(driver, prompt2, 30))
  await asyncio.sleep(0.05)
  task.cancel()
  with pytest.raises(asyncio.CancelledError):
    await task
  res = await gen(driver, [8, 9, 10], 5)  # the only slot comes back
  assert res.tokens == greedy_reference(model, [8, 9, 10], 5)


async def test_diverging_prompt_does_not_reuse(make_driver):
  model = tiny_model(seed=1)
  driver = make_driver(model, slots=2)
  first = await gen(driver, PROMPT, 6)
  # Same start, but a token inside the parked sequence differs.
  diverged = [*PROMPT[:-1], 55, *first.tokens, *TOOL]
  res = await gen(driver, diverged, 6)
  assert driver.stats()["prefix_hits"] == 0
  assert res.tokens == greedy_reference(model, diverged, 6)
  # A prompt shorter than the parked sequence (a prefix of it) does not match either.
  short = PROMPT[:5]
  res = await gen(driver, short, 6)
  assert driver.stats()["prefix_hits"] == 0
  assert res.tokens == greedy_reference(model, short, 6)


async def test_prompt_equal_to_parked_sequence(make_driver):
  """The whole prompt is cached: its last token is fed again for the first token's logits."""
  model = tiny_model(seed=1)
  driver = make_driver(model, slots=2)
  first = await gen(driver, PROMPT, 6)
  same = PROMPT + first.tokens[:-1]
  res = await gen(driver, same, 6)
  s = driver.stats()
  assert s["prefix_hits"] == 1 and s["prefix_tokens_reused"] == len(same) - 1
  assert res.tokens == greedy_reference(model, same, 6)
  assert res.tokens[0] == first.tokens[-1]


# --- PrefixCache on its own: bookkeeping, no engine ---------------------------------------------


def test_cache_takes_the_longest_parked_prefix_and_forgets_it():
  cache = PrefixCache()
  cache.park(0, [1, 2])
  cache.park(1, [1, 2, 3])
  cache.park(2, [1, 2, 3, 4, 5, 6])  # longer than the prompt: never a match
  cache.park(3, [1, 9])
  assert cache.take([1, 2, 3, 4]) == (1, [1, 2, 3])
  assert 1 not in cache and len(cache) == 3
  assert cache.take([1, 2, 3, 4]) == (0, [1, 2])
  assert cache.take([1, 2, 3, 4]) is None
  assert cache.take([7]) is None


def test_cache_equal_lengths_take_the_least_recently_parked():
  cache = PrefixCache()
  cache.park(5, [1, 2])
  cache.park(6, [1, 2])
  assert cache.take([1, 2, 3]) == (5, [1, 2])


def test_cache_evicts_least_recently_parked_first():
  cache = PrefixCache()
  for slot in (0, 1, 2):
    cache.park(slot, [slot])
  cache.park(0, [0, 7])  # parked again: now the most recent
  assert [cache.evict(), cache.evict(), cache.evict()] == [1, 2, 0]
  with pytest.raises(KeyError):
    cache.evict()


def test_cache_clear_and_disabled():
  cache = PrefixCache()
  cache.park(0, [1])
  cache.clear()
  assert len(cache) == 0 and cache.take([1, 2]) is None
  off = PrefixCache(enabled=False)
  off.park(0, [1])
  assert len(off) == 0 and 0 not in off
