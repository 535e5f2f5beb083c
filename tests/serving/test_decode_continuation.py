"""A turn that continues its slot's last call with nothing new (an agent's read turn stops, its act
turn goes on from there) is admitted with no prefill (`DriverConfig.continue_in_decode`): the
next decode step feeds the token the last call sampled. It must give exactly what a 1-token
suffix prefill gives: tokens, logprobs, versions and stop reasons, greedy and sampled, with one
decode step per call and with several."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from asearcher_jax.serving.driver import CUMULATIVE_STATS
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.serving.types import SamplingParams
from tests.serving.conftest import hold_driver, tiny_model
from tests.serving.test_driver_correctness import (
  PROMPTS,
  assert_same_results,
  greedy_reference,
  learner_logprobs,
)
from tests.serving.test_prefix_cache import TOOL, gen

SAMPLE = SamplingParams(temperature=1.0)
GREEDY = SamplingParams(temperature=0.0)


async def _continued(driver, sp, n=5):
  """Four agents' first turns; each continues with nothing new, then once more after a tool."""
  seeded = [dataclasses.replace(sp, seed=i) for i in range(len(PROMPTS))]
  firsts = await asyncio.gather(*(gen(driver, p, n, s) for p, s in zip(PROMPTS, seeded)))
  conts = [p + r.tokens for p, r in zip(PROMPTS, firsts, strict=True)]
  seconds = await asyncio.gather(*(gen(driver, p, n, s) for p, s in zip(conts, seeded)))
  tools = [p + r.tokens + TOOL for p, r in zip(conts, seconds, strict=True)]
  thirds = await asyncio.gather(*(gen(driver, p, n, s) for p, s in zip(tools, seeded)))
  return conts + tools, firsts + seconds + thirds


# Greedy with one decode step per call, sampled with four (each path once keeps the suite short).
@pytest.mark.parametrize(
  ("make_driver", "sampling"),
  [(1, GREEDY), pytest.param(4, SAMPLE, marks=pytest.mark.slow)],
  indirect=["make_driver"],
  ids=["greedy-k1", "sample-k4"],
)  # fmt: skip
async def test_a_continuing_turn_decodes_what_a_one_token_prefill_gives(make_driver, sampling):
  model = tiny_model(seed=8)
  new = make_driver(model, slots=4, suffix_batch=(1,))  # one suffix prefill call per turn
  old = make_driver(model, slots=4, suffix_batch=(1,), continue_in_decode=False)
  prompts, a = await _continued(new, sampling)
  _, b = await _continued(old, sampling)
  assert_same_results(a, b, model, prompts, a[4:], sampling.temperature or 1.0)
  sa, sb = new.stats(), old.stats()
  assert sa["prefix_hits"] == sb["prefix_hits"] == 8
  assert sa["decode_continuations"] == 4 and sb["decode_continuations"] == 0
  # The four continuations cost no prefill call; the turns after a tool still prefill.
  assert sb["suffix_prefill_calls"] - sa["suffix_prefill_calls"] == 4
  assert sb["prefill_tokens"] - sa["prefill_tokens"] == 4


async def test_a_continuation_stops_and_budgets_like_any_turn(make_driver):
  model = tiny_model(seed=9)
  driver = make_driver(model, slots=2)
  first = await gen(driver, PROMPTS[0], 4)
  prompt = PROMPTS[0] + first.tokens
  one = await gen(driver, prompt, 1)  # a budget of one token: the decode step's only token
  assert len(one.tokens) == 1 and one.stop_reason == "length"
  again = await gen(driver, prompt + one.tokens, 3)
  assert len(again.tokens) == 3
  np.testing.assert_allclose(
    again.logprobs, learner_logprobs(model, prompt + one.tokens, again.tokens, 1.0), atol=1e-4
  )
  assert driver.stats()["decode_continuations"] == 2
  assert set(CUMULATIVE_STATS) <= set(driver.stats())  # what a trainer logs is all there


async def test_a_continuation_aborted_before_its_first_token_leaves_its_slot_usable(make_driver):
  # One slot: the aborted continuation's parked tokens are the only ones the next call can reuse.
  model = tiny_model(seed=10)
  driver = make_driver(model, slots=1)
  first = await gen(driver, PROMPTS[1], 4)
  prompt = PROMPTS[1] + first.tokens
  # The driver thread stops right after the continuation goes live, until the abort is in: the
  # call it then dispatches feeds the prompt's last token, and the abort is reaped before that
  # call's token is recorded (the request leaves with no tokens).
  with hold_driver(driver._admission, "_admit_continuation") as hold:
    task = asyncio.ensure_future(gen(driver, prompt, 40, request_id="c"))
    await hold.wait_reached(30)
    assert driver.abort("c")
  partial = await task
  assert partial.stop_reason == "abort" and partial.tokens == []
  s = driver.stats()
  assert s["decode_continuations"] == 1 and s["prefix_hits"] == 1 and s["slots_parked"] == 1
  # The slot is parked (holding the prompt but its last token, which the driver does not count
  # as fed): asked again, the same turn reuses it and decodes what the model says.
  again = await gen(driver, prompt, 5)
  assert driver.stats()["prefix_hits"] == 2
  assert again.tokens == greedy_reference(model, prompt, 5)
  np.testing.assert_allclose(
    again.logprobs, learner_logprobs(model, prompt, again.tokens, 1.0), atol=1e-4
  )


def test_activation_is_checked(tokenizer):
  engine = Engine.from_model(tiny_model(), tokenizer, EngineConfig(max_slots=4, max_seq_len=64))
  state = engine.init_decode_state()
  with pytest.raises(ValueError, match="bad activation"):
    engine.activate_slot(state, 0, 1, 64, sampling=GREEDY)
  with pytest.raises(ValueError, match="bad activation"):
    engine.activate_slot(state, 4, 1, 3, sampling=GREEDY)
