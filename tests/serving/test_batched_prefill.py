"""Prefills that batch: suffix prefills of several parked slots in one call
(`EngineConfig.suffix_batch`) and weight-update re-prefills by bucket
(`DriverConfig.batch_reprefill`) must give exactly what one call per slot gives."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
from flax import nnx

from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.serving.types import SamplingParams
from tests.serving.conftest import tiny_model
from tests.serving.test_driver_correctness import PROMPTS, assert_same_results, learner_logprobs
from tests.serving.test_prefix_cache import TOOL, gen

SAMPLE = SamplingParams(temperature=1.0)
GREEDY = SamplingParams(temperature=0.0)


def _parked(engine: Engine, prompts: list[list[int]]):
  """A decode state with each prompt prefilled into slot i (as the driver parks them)."""
  params, state = engine.load_params(), engine.init_decode_state()
  for slot, prompt in enumerate(prompts):
    padded, n = engine.pad(prompt)
    state = engine.insert(engine.prefill(params=params, padded_tokens=padded, true_length=n), state,
                          slot)  # fmt: skip
    state = engine.release(state, slot)
  return params, state


def _host(state):
  return [np.asarray(x) for x in (*state.cache.k, *state.cache.v, state.lengths,
                                  state.next_tokens, state.keys, state.active)]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLE], ids=["greedy", "sample"])
def test_a_batched_suffix_prefill_is_the_single_ones(tokenizer, sampling):
  engine = Engine.from_model(
    tiny_model(seed=3), tokenizer,
    EngineConfig(max_slots=4, max_seq_len=64, prefill_buckets=(16, 32), suffix_buckets=(8,)),
  )  # fmt: skip
  prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[0]]
  suffixes = [TOOL, TOOL[:2], [33, 4, 8, 15, 16, 23, 42]]
  starts = [len(p) for p in prompts]
  params, one = _parked(engine, prompts)
  singles = []
  for slot, (suffix, start) in enumerate(zip(suffixes, starts, strict=True)):
    one, tok, lp, version, _ = engine.extend_slot(params, one, slot, suffix, start,
                                                  sampling=sampling, seed=10 + slot, bucket=8,
                                                  window=32)  # fmt: skip
    singles.append((int(tok), float(lp), int(version)))
  _, many = _parked(engine, prompts)
  many, tok, lp, version, _ = engine.extend_slots(
    params, many, [0, 1, 2], suffixes, starts, samplings=[sampling] * 3, seeds=[10, 11, 12],
    bucket=8, window=32,
  )  # fmt: skip
  assert [int(t) for t in np.asarray(tok)] == [s[0] for s in singles]
  np.testing.assert_allclose(np.asarray(lp), [s[1] for s in singles], atol=1e-5)
  assert int(version) == 0
  for a, b in zip(_host(one), _host(many), strict=True):
    np.testing.assert_allclose(a, b, atol=1e-5)
  assert np.asarray(many.active)[:3].all() and np.asarray(many.lengths)[:3].tolist() == [
    s + len(x) for s, x in zip(starts, suffixes, strict=True)
  ]


def test_a_batched_suffix_prefill_rejects_bad_input(tokenizer):
  engine = Engine.from_model(tiny_model(), tokenizer, EngineConfig(max_slots=4, max_seq_len=64))
  params, state = engine.load_params(), engine.init_decode_state()
  with pytest.raises(ValueError, match="batched suffix prefill"):
    engine.extend_slots(params, state, [0, 0], [[1], [2]], [0, 0], samplings=[GREEDY] * 2,
                        seeds=[0, 1], bucket=8, window=16)  # fmt: skip
  with pytest.raises(ValueError, match="suffix_batch"):
    EngineConfig(suffix_batch=(2, 4))


async def _two_turns(driver, sp, n=5):
  """Four agents' first turns, then their next turns submitted together (one admission)."""
  seeded = [dataclasses.replace(sp, seed=i) for i in range(len(PROMPTS))]
  firsts = await asyncio.gather(*(gen(driver, p, n, s) for p, s in zip(PROMPTS, seeded)))
  nexts = [p + r.tokens + TOOL for p, r in zip(PROMPTS, firsts, strict=True)]
  seconds = await asyncio.gather(*(gen(driver, p, n, s) for p, s in zip(nexts, seeded)))
  return nexts, firsts + seconds


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLE], ids=["greedy", "sample"])
async def test_driver_batches_turns_that_arrive_together(make_driver, sampling):
  model = tiny_model(seed=6)
  batched = make_driver(model, slots=4)
  single = make_driver(model, slots=4, suffix_batch=(1,))
  nexts, a = await _two_turns(batched, sampling)
  _, b = await _two_turns(single, sampling)
  assert_same_results(a, b, model, nexts, a[4:], sampling.temperature or 1.0)
  sa, sb = batched.stats(), single.stats()
  assert sa["prefix_hits"] == sb["prefix_hits"] == 4
  assert sa["prefill_tokens"] == sb["prefill_tokens"]
  # The four next turns arrived together: fewer suffix prefill calls than turns.
  assert sa["prefill_calls"] < sb["prefill_calls"]


@pytest.mark.slow
@pytest.mark.parametrize("batch_reprefill", [True, False])
async def test_batched_reprefill_equals_one_call_per_slot(make_driver, batch_reprefill):
  old, new = tiny_model(seed=4), tiny_model(seed=5)
  driver = make_driver(old, slots=4, batch_reprefill=batch_reprefill)
  tasks = [asyncio.create_task(driver.generate(p, GREEDY, 30, stop_token_ids=())) for p in PROMPTS]
  while sum(r is not None and len(r.tokens) >= 4 for r in driver._slots) < len(PROMPTS):
    await asyncio.sleep(0)
  await asyncio.wait_for(asyncio.wrap_future(driver.submit_update(nnx.state(new), 1)), 60)
  results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
  total = 0
  for prompt, res in zip(PROMPTS, results, strict=True):
    k = res.versions.index(1)
    total += len(prompt) + k - 1
    np.testing.assert_allclose(
      res.logprobs[k:], learner_logprobs(new, prompt + res.tokens[:k], res.tokens[k:], 1.0),
      atol=1e-4,
    )  # fmt: skip
  assert driver.stats()["reprefill_tokens"] == total
