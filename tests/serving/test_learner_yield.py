"""`Driver.learner_step`: while a colocated learner steps, the engine thread dispatches nothing
(DriverConfig.yield_to_learner), and picks up where it was once the step ends; "auto" is on for
an engine on CPU devices (the default is off), and a pause never outlasts `yield_max_s`."""

from __future__ import annotations

import asyncio
import time

import pytest

from asearcher_jax.serving.driver import DriverConfig
from asearcher_jax.serving.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def test_auto_yields_on_cpu_and_the_settings_are_checked(make_driver):
  assert make_driver(yield_to_learner="auto").yields  # this engine computes on CPU devices
  assert not make_driver().yields  # the default: off
  with pytest.raises(ValueError, match="yield_to_learner"):
    DriverConfig(yield_to_learner="sometimes")


def test_no_token_is_generated_while_the_learner_steps(make_driver):
  driver = make_driver(yield_to_learner="on")

  async def run():
    want = await driver.generate([1, 2, 3], GREEDY, max_new_tokens=6)
    with driver.learner_step():
      task = asyncio.ensure_future(driver.generate([1, 2, 3], GREEDY, max_new_tokens=6))
      await asyncio.sleep(1.0)
      assert not task.done()
      assert driver.stats()["slots_active"] == 0  # not even admitted: the thread is paused
      tokens = driver.stats()["tokens_generated"]
    got = await asyncio.wait_for(task, 60)
    return want, got, tokens

  want, got, tokens_during = asyncio.run(run())
  assert got.tokens == want.tokens and tokens_during == len(want.tokens)
  assert driver.stats()["learner_yield_s"] >= 0.9


def test_without_yielding_the_engine_runs_beside_the_learner(make_driver):
  driver = make_driver(yield_to_learner="off")

  async def run():
    with driver.learner_step():
      return await asyncio.wait_for(driver.generate([1, 2, 3], GREEDY, max_new_tokens=4), 60)

  assert len(asyncio.run(run()).tokens) == 4
  assert driver.stats()["learner_yield_s"] == 0


def test_a_pause_ends_after_yield_max_s(make_driver):
  driver = make_driver(yield_to_learner="on", yield_max_s=0.3)

  async def run():
    with driver.learner_step():  # a learner step that never ends
      t0 = time.perf_counter()
      out = await asyncio.wait_for(driver.generate([1, 2, 3], GREEDY, max_new_tokens=4), 60)
      return out, time.perf_counter() - t0

  out, _ = asyncio.run(run())
  assert len(out.tokens) == 4  # served while the "learner" still held the gate


def test_with_a_share_the_engine_keeps_generating_at_a_duty_cycle(make_driver):
  """yield_share=0.5: while the learner steps the engine still serves, idling after each loop
  iteration as long as it computed; the same tokens as an unheld request."""
  driver = make_driver(yield_to_learner="on", yield_share=0.5)

  async def run():
    want = await driver.generate([1, 2, 3], GREEDY, max_new_tokens=6)
    with driver.learner_step():
      got = await asyncio.wait_for(driver.generate([1, 2, 3], GREEDY, max_new_tokens=6), 60)
    return want, got

  want, got = asyncio.run(run())
  assert got.tokens == want.tokens
  assert driver.stats()["learner_yield_s"] > 0
  with pytest.raises(ValueError, match="yield_share"):
    DriverConfig(yield_share=1.0)
