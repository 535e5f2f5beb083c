"""In-flight weight updates that keep the old keys/values (DriverConfig.kv_on_update="keep").

"recompute" (the default, AReaL) is pinned down in test_driver_correctness / test_prefix_cache:
after a swap every token equals a fresh forward pass of the new weights. "keep" must instead
continue from the cache the old weights built -- no re-prefill, parked prefixes survive -- with
every reported logprob exactly that of the distribution that drew the token.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from flax import nnx

from asearcher_jax.serving.driver import DriverConfig
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.serving.engine_steps import TOKEN
from tests.serving.conftest import BOTH_LAYOUTS, BOTH_STEPS, tiny_model
from tests.serving.test_driver_correctness import (
  GREEDY,
  PROMPTS,
  greedy_reference,
  learner_logprobs,
  swap_after,
)
from tests.serving.test_prefix_cache import TOOL, gen

PROMPT = PROMPTS[1]


def stale_cache_reference(tokenizer, old, new, prompt, tokens, k, n_total):
  """Greedy tokens k.. when the cache of prompt + tokens[:k-1] was built by `old` and every
  later step (feeding tokens[k-1] onwards) runs `new`: what "keep" promises."""
  engine = Engine.from_model(
    old, tokenizer, EngineConfig(max_slots=1, max_seq_len=64, prefill_buckets=(64,))
  )
  padded, n = engine.pad(prompt + tokens[: k - 1])
  prefix = engine.prefill(
    params=engine.load_params(), padded_tokens=padded, true_length=n, sampling=GREEDY
  )
  state = engine.insert(prefix.replace(next_token=np.int32(tokens[k - 1])),
                        engine.init_decode_state(), 0)  # fmt: skip
  params = engine.versioned(nnx.state(new), 1)
  out, length = [], len(prompt) + k
  for _ in range(n_total - k):
    state, result = engine.generate(params, state, max_length=length, mode="greedy")
    out.append(int(np.asarray(result.data)[0, TOKEN]))
    length += 1
  return out


@BOTH_STEPS
@BOTH_LAYOUTS
async def test_keep_continues_from_the_old_cache_without_reprefill(make_driver, tokenizer):
  old, new = tiny_model(seed=4), tiny_model(seed=5)
  driver = make_driver(old, slots=2, kv_on_update="keep")
  n_before, n_total = 6, 40
  task = asyncio.create_task(driver.generate(PROMPT, GREEDY, n_total, stop_token_ids=()))
  await asyncio.wait_for(swap_after(driver, new, n_before), 60)
  res = await asyncio.wait_for(task, 60)
  k = res.versions.index(1)
  assert k >= n_before and res.versions == [0] * k + [1] * (n_total - k)
  assert res.tokens[:k] == greedy_reference(old, PROMPT, k)
  assert res.tokens[k:] == stale_cache_reference(tokenizer, old, new, PROMPT, res.tokens, k,
                                                 n_total)  # fmt: skip
  # Not what a fresh forward of the new weights gives: the old keys/values are really kept ...
  fresh = learner_logprobs(new, PROMPT + res.tokens[:k], res.tokens[k:], 1.0)
  assert np.abs(np.asarray(res.logprobs[k:]) - fresh).max() > 1e-3
  s = driver.stats()
  assert s["updates"] == 1 and s["reprefill_tokens"] == 0


@BOTH_STEPS
@BOTH_LAYOUTS
async def test_recompute_reprefills_in_flight_slots(make_driver, kv_layout):
  old, new = tiny_model(seed=4), tiny_model(seed=5)
  driver = make_driver(old, slots=2)  # kv_on_update="recompute"
  task = asyncio.create_task(driver.generate(PROMPT, GREEDY, 40, stop_token_ids=()))
  await asyncio.wait_for(swap_after(driver, new, 6), 60)
  res = await asyncio.wait_for(task, 60)
  k = res.versions.index(1)
  # ... whereas recompute rebuilt them: the new weights' own logprobs from the swap on.
  np.testing.assert_allclose(
    res.logprobs[k:], learner_logprobs(new, PROMPT + res.tokens[:k], res.tokens[k:], 1.0),
    atol=1e-4,
  )  # fmt: skip
  # The paged layout re-prefills the pending token too (a fixed slot feeds it in the next step).
  assert driver.stats()["reprefill_tokens"] == len(PROMPT) + k - (kv_layout == "fixed")


@BOTH_STEPS
@BOTH_LAYOUTS
async def test_keep_with_unchanged_weights_changes_nothing(make_driver):
  """A version bump with the same weights: the kept cache is exactly a fresh one, so the
  output equals an uninterrupted run, token for token (any misplaced cache row would show)."""
  model = tiny_model(seed=7)
  driver = make_driver(model, slots=2, kv_on_update="keep")
  task = asyncio.create_task(driver.generate(PROMPT, GREEDY, 40, stop_token_ids=()))
  await asyncio.wait_for(swap_after(driver, model, 6), 60)
  res = await asyncio.wait_for(task, 60)
  assert 1 in res.versions and res.tokens == greedy_reference(model, PROMPT, 40)
  np.testing.assert_allclose(res.logprobs, learner_logprobs(model, PROMPT, res.tokens, 1.0),
                             atol=1e-4)  # fmt: skip


@pytest.mark.parametrize("same_weights", [True, False])
@BOTH_STEPS
async def test_keep_reuses_parked_prefixes_across_an_update(make_driver, same_weights):
  old = tiny_model(seed=1)
  new = old if same_weights else tiny_model(seed=5)
  driver = make_driver(old, slots=2, kv_on_update="keep")
  first = await gen(driver, PROMPT, 6)
  driver.update_params(nnx.state(new), version=1)
  assert driver.stats()["slots_parked"] == 1
  prompt2 = PROMPT + first.tokens + TOOL
  res = await gen(driver, prompt2, 6)
  s = driver.stats()
  assert s["prefix_hits"] == 1 and s["prefix_tokens_reused"] == len(PROMPT) + 5
  assert res.versions == [1] * 6
  fresh = learner_logprobs(new, prompt2, res.tokens, 1.0)
  if same_weights:  # the parked rows are intact and exactly a fresh prefill's
    assert res.tokens == greedy_reference(new, prompt2, 6)
    np.testing.assert_allclose(res.logprobs, fresh, atol=1e-4)
  else:  # the first turn's keys/values are the old weights'
    assert np.abs(np.asarray(res.logprobs) - fresh).max() > 1e-3


async def test_a_forced_recompute_update_forgets_parked_prefixes_under_keep(make_driver):
  """A reset to unrelated weights (update_params(recompute=True)) must not continue over the
  old keys/values, even with kv_on_update="keep"."""
  old, new = tiny_model(seed=1), tiny_model(seed=5)
  driver = make_driver(old, slots=2, kv_on_update="keep")
  first = await gen(driver, PROMPT, 6)
  driver.update_params(nnx.state(new), version=0, recompute=True)
  assert driver.stats()["slots_parked"] == 0
  prompt2 = PROMPT + first.tokens + TOOL
  res = await gen(driver, prompt2, 6)
  assert driver.stats()["prefix_hits"] == 0
  assert res.tokens == greedy_reference(new, prompt2, 6)


async def test_an_update_that_replaces_a_pending_forced_recompute_still_recomputes(make_driver):
  old, new = tiny_model(seed=1), tiny_model(seed=5)
  driver = make_driver(old, slots=2, kv_on_update="keep")
  first = await gen(driver, PROMPT, 6)
  assert driver.stats()["slots_parked"] == 1
  driver._apply_update = lambda: None  # the engine thread takes no update until both are queued
  forced = driver.submit_update(nnx.state(new), 0, recompute=True)
  later = driver.submit_update(nnx.state(new), 1)  # kv_on_update="keep" on its own
  del driver._apply_update
  await asyncio.wait_for(asyncio.wrap_future(later), 60)
  assert forced.cancelled() and driver.stats()["slots_parked"] == 0
  prompt2 = PROMPT + first.tokens + TOOL
  res = await gen(driver, prompt2, 6)
  assert driver.stats()["prefix_hits"] == 0
  assert res.tokens == greedy_reference(new, prompt2, 6)


def test_kv_on_update_is_validated():
  with pytest.raises(ValueError, match="kv_on_update"):
    DriverConfig(kv_on_update="discard")
