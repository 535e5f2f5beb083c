"""Several decode steps per generate call (EngineConfig.decode_steps_per_call > 1) change nothing
a caller sees: the same tokens, logprobs, versions and stop reasons as one step per call, with stop
ids and budgets applied on the device, and weight updates landing at the next call boundary."""

from __future__ import annotations

import asyncio

import jax
import numpy as np
import pytest
from flax import nnx

from asearcher_jax.serving import engine_steps as steps
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.serving.types import SamplingParams
from tests.serving.conftest import tiny_model
from tests.serving.test_driver_correctness import (
  GREEDY,
  PROMPTS,
  greedy_reference,
  learner_logprobs,
)
from tests.serving.test_kv_on_update import stale_cache_reference

K = 4


def _engine(tokenizer, model, k: int, slots: int = 4, loop: str = "while") -> Engine:
  cfg = EngineConfig(max_slots=slots, max_seq_len=64, prefill_buckets=(16, 32), decode_rows=(2,),
                     decode_steps_per_call=k, decode_loop=loop)  # fmt: skip
  return Engine.from_model(model, tokenizer, cfg)


def _filled(engine: Engine, samplings):
  """A decode state with PROMPTS[i] prefilled into slot i under samplings[i]."""
  params, state = engine.load_params(), engine.init_decode_state()
  for slot, sp in enumerate(samplings):
    padded, n = engine.pad(PROMPTS[slot])
    prefix = engine.prefill(params=params, padded_tokens=padded, true_length=n, sampling=sp,
                            seed=slot)  # fmt: skip
    state = engine.insert(prefix, state, slot)
  return params, state


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["while", "fixed"])
def test_a_chunk_is_the_single_steps_with_stops_and_budgets_inside(tokenizer, loop):
  """Whatever the device loop (EngineConfig.decode_loop: an early exit, or a known trip count
  whose spare steps are masked), a call emits exactly the single steps' tokens. ("unrolled" is
  "fixed" with `fori_loop(unroll=k)`, the same program; it compiles 2x longer, so it is left to
  benchmarks/decode_loop.py.)"""
  model = tiny_model(seed=21)
  samplings = [GREEDY, SamplingParams(temperature=0.8), SamplingParams(temperature=1.3), GREEDY]
  one = _engine(tokenizer, model, 1)
  params, state = _filled(one, samplings)
  want = []  # 8 single steps over every slot: [step, slot] tokens and logprobs
  for _ in range(8):
    state, res = one.generate(params, state, max_length=32, mode="truncate")
    want.append(np.asarray(res.data))
  want = np.stack(want)
  tokens = want[..., steps.TOKEN]
  lps = want[..., steps.LOGPROB].astype(np.int32).view(np.float32)

  many = _engine(tokenizer, model, 8, loop=loop)
  params, state = _filled(many, samplings)
  before = jax.tree.map(np.asarray, state)
  stop = int(tokens[2, 1])  # slot 1 stops at its third token (or earlier, on a repeat)
  stop_at = list(tokens[:, 1]).index(stop) + 1
  # Slot 3 sits out (a parked slot, say): neither its cache nor its length may change.
  state, out, rows = many.generate_chunk(
    params, state, [0, 1, 2], [8, 8, 5], [(), (stop,), ()], max_length=32, mode="truncate"
  )
  out, after = np.asarray(out), jax.tree.map(np.asarray, state)
  assert list(rows) == [0, 1, 2, 3] and out.shape[:2] == (8, 4)
  emitted = out[..., steps.VALID].sum(axis=0)
  assert list(emitted) == [8, stop_at, 5, 0]
  for row, n in enumerate(emitted):
    assert list(out[:n, row, steps.TOKEN]) == list(tokens[:n, row])
    got_lp = out[:n, row, steps.LOGPROB].astype(np.int32).view(np.float32)
    np.testing.assert_allclose(got_lp, lps[:n, row], atol=1e-5)
    assert list(out[:n, row, steps.LENGTH]) == list(before.lengths[row] + 1 + np.arange(n))
  assert list(after.lengths) == list(before.lengths + emitted)
  # The stop id ends slot 1's request on the device: a later call does not advance it.
  assert list(after.active) == [True, False, True, True]
  for k1, k2 in zip(before.cache.k, after.cache.k, strict=True):  # (the last position is scratch)
    np.testing.assert_array_equal(k2[3, :-1], k1[3, :-1])
  state, out, _ = many.generate_chunk(params, state, [1], [4], [()], max_length=32, mode="greedy")
  assert not np.asarray(out)[..., steps.VALID].any()
  with pytest.raises(ValueError, match="bad decode chunk"):
    many.generate_chunk(params, state, [0], [0], [()], max_length=32)
  # Budgets below k (5 steps of 8): the spare iterations of a fixed loop emit and advance nothing.
  state, out, rows = many.generate_chunk(params, state, [0, 2], [3, 5], [(), ()], max_length=40,
                                         mode="truncate")  # fmt: skip
  assert list(rows) == [0, 2] and list(np.asarray(out)[..., steps.VALID].sum(axis=0)) == [3, 5]
  assert list(np.asarray(state.lengths)) == list(after.lengths + np.array([3, 0, 5, 0]))
  with pytest.raises(ValueError, match="decode_steps_per_call"):
    EngineConfig(decode_steps_per_call=0)
  with pytest.raises(ValueError, match="decode_loop"):
    EngineConfig(decode_loop="scan")


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["while", "fixed"])
async def test_driver_results_equal_one_step_per_call(make_driver, tokenizer, loop):
  """A mixed workload (greedy, seeded samples, top-p, stop ids that fire, a stop string, top
  logprobs, more requests than slots, gathered rows): identical through both settings."""
  model = tiny_model(seed=22)
  free, other = greedy_reference(model, PROMPTS[0], 14), greedy_reference(model, PROMPTS[3], 20)
  stop_text = tokenizer.decode(free[5:6])
  hit = next(i for i in range(14) if stop_text in tokenizer.decode(free[: i + 1])) + 1
  calls = [
    (PROMPTS[0], GREEDY, 12, {"stop_token_ids": ()}),
    (PROMPTS[1], SamplingParams(temperature=0.9, seed=3), 17, {"stop_token_ids": ()}),
    (PROMPTS[2], SamplingParams(temperature=1.2, top_p=0.8, seed=4), 9, {"stop_token_ids": ()}),
    (PROMPTS[3], GREEDY, 20, {"stop_token_ids": [other[8], 7]}),
    (PROMPTS[0], GREEDY, 12, {"stop": [stop_text], "stop_token_ids": ()}),
    (PROMPTS[1], SamplingParams(temperature=0.0, top_logprobs=3), 6, {"stop_token_ids": ()}),
    (PROMPTS[2], SamplingParams(temperature=0.7, seed=5), 2, {"stop_token_ids": ()}),
    (PROMPTS[0], GREEDY, 14, {"stop_token_ids": [free[2]]}),
  ]

  async def run(driver):
    jobs = [driver.generate(p, sp, n, **kw) for p, sp, n, kw in calls]
    return await asyncio.wait_for(asyncio.gather(*jobs), 300)

  one = make_driver(model, slots=3, decode_rows=(2,), decode_steps=1)
  many = make_driver(model, slots=3, decode_rows=(2,), decode_steps=K, decode_loop=loop)
  want, got = await run(one), await run(many)
  for w, g in zip(want, got, strict=True):
    assert g.tokens == w.tokens and g.stop_reason == w.stop_reason and g.versions == w.versions
    np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
    assert (g.top_logprobs is None) == (w.top_logprobs is None)
    for gt, wt in zip(g.top_logprobs or [], w.top_logprobs or [], strict=True):
      assert [i for i, _ in gt] == [i for i, _ in wt]
      np.testing.assert_allclose([lp for _, lp in gt], [lp for _, lp in wt], atol=1e-5)
  reasons = [r.stop_reason for r in got]
  assert reasons.count("stop") >= 3 and reasons.count("length") >= 3  # both kinds exercised
  assert got[0].tokens == free[:12] and got[4].tokens == free[:hit]
  a, b = one.stats(), many.stats()
  assert a["tokens_generated"] == b["tokens_generated"] == sum(len(r.tokens) for r in got)
  assert b["slots_active"] == 0 and b["slots_parked"] == a["slots_parked"]


async def _update_mid_request(driver, new, n_total: int) -> tuple:
  """One greedy request; weights of `new` as version 1 once it has 6 tokens. Returns (result,
  tokens the request had once the update was submitted)."""
  task = asyncio.create_task(driver.generate(PROMPTS[1], GREEDY, n_total, stop_token_ids=()))
  while True:
    req = next((r for r in driver._slots if r is not None), None)
    if req is not None and len(req.tokens) >= 6:
      break
    await asyncio.sleep(0)
  done = driver.submit_update(nnx.state(new), 1)
  submitted = len(req.tokens)
  await asyncio.wait_for(asyncio.wrap_future(done), 60)
  return await asyncio.wait_for(task, 60), submitted


@pytest.mark.slow
@pytest.mark.parametrize("kv_on_update", ["recompute", "keep"])
async def test_a_weight_update_lands_at_the_next_call_boundary(make_driver, tokenizer,
                                                               kv_on_update):  # fmt: skip
  old, new = tiny_model(seed=4), tiny_model(seed=5)
  driver = make_driver(old, slots=2, decode_steps=K, kv_on_update=kv_on_update)
  n_total = 40
  res, submitted = await _update_mid_request(driver, new, n_total)
  j = res.versions.index(1)  # the first token of the new weights
  assert res.versions == [0] * j + [1] * (n_total - j)
  # The prefill gives token 0, then every call K tokens: versions change only between calls, at
  # most the call being read back and the one in flight (2K tokens) after the update was asked.
  assert (j - 1) % K == 0 and j <= submitted + 2 * K
  assert res.tokens[:j] == greedy_reference(old, PROMPTS[1], j)
  if kv_on_update == "recompute":  # re-prefilled: exactly the new policy from token j on
    assert res.tokens[j:] == greedy_reference(new, PROMPTS[1] + res.tokens[:j], n_total - j)
    np.testing.assert_allclose(
      res.logprobs[j:], learner_logprobs(new, PROMPTS[1] + res.tokens[:j], res.tokens[j:], 1.0),
      atol=1e-4,
    )  # fmt: skip
    assert driver.stats()["reprefill_tokens"] == len(PROMPTS[1]) + j - 1
  else:  # the old keys/values kept: new weights over the old cache, no re-prefill
    want = stale_cache_reference(tokenizer, old, new, PROMPTS[1], res.tokens, j, n_total)
    assert res.tokens[j:] == want and driver.stats()["reprefill_tokens"] == 0
