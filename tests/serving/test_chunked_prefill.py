"""Chunked prefill (`DriverConfig.prefill_chunk`): a long prompt is prefilled piece by piece with
decode calls in between, and gives exactly what one whole prefill gives."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest
from flax import nnx

from asearcher_jax.serving.types import SamplingParams
from tests.serving.conftest import hold_driver, tiny_model
from tests.serving.test_driver_correctness import greedy_reference, learner_logprobs
from tests.serving.test_prefix_cache import gen

GREEDY = SamplingParams(temperature=0.0)
LONG = [(7 * i + 3) % 97 + 2 for i in range(30)]  # 30 tokens: pieces of 8, 8, 8, 6
SHORT = [5, 17, 42]


async def _queued(driver, request_id: str) -> None:
  while request_id not in driver._by_id:
    await asyncio.sleep(0.001)


def _record_pieces(driver, on_piece=None) -> list[tuple[int, int]]:
  """Wraps the engine's extend_slot: records (start, decode steps so far) per call."""
  seen: list[tuple[int, int]] = []
  extend = driver.engine.extend_slot

  def wrapped(params, state, slot, suffix, start, **kw):
    seen.append((start, driver.metrics["decode_steps"]))
    if on_piece is not None:
      on_piece(len(seen))
    return extend(params, state, slot, suffix, start, **kw)

  driver.engine.extend_slot = wrapped
  return seen


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, seed=3)],
                         ids=["greedy", "sample"])  # fmt: skip
async def test_pieces_give_what_one_prefill_gives(make_driver, sampling):
  model = tiny_model(seed=7)
  chunked = make_driver(model, prefill_chunk=8, prefix_reuse=False)
  whole = make_driver(model, prefix_reuse=False)
  seen = _record_pieces(chunked)
  a = await asyncio.gather(gen(chunked, LONG, 10, sampling), gen(chunked, SHORT, 10, sampling))
  b = await asyncio.gather(gen(whole, LONG, 10, sampling), gen(whole, SHORT, 10, sampling))
  for ra, rb in zip(a, b, strict=True):
    assert ra.tokens == rb.tokens and ra.versions == rb.versions
    assert ra.stop_reason == rb.stop_reason
    np.testing.assert_allclose(ra.logprobs, rb.logprobs, atol=1e-5)
  if sampling.temperature == 0:
    assert a[0].tokens == greedy_reference(model, LONG, 10)
  np.testing.assert_allclose(
    a[0].logprobs, learner_logprobs(model, LONG, a[0].tokens, 1.0), atol=1e-4
  )
  assert [start for start, _ in seen] == [0, 8, 16, 24]  # the short prompt is one whole prefill
  s = chunked.stats()
  assert s["prefill_pieces"] == 4 and s["slots_prefilling"] == 0
  assert s["prefill_tokens"] == whole.stats()["prefill_tokens"] == len(LONG) + len(SHORT)


async def test_live_slots_decode_between_pieces(make_driver):
  driver = make_driver(tiny_model(seed=8), prefill_chunk=8, prefix_reuse=False)
  seen = _record_pieces(driver)
  # The driver thread waits once the short request is decoding, until the long prompt is queued:
  # polled from the event loop, the short request's 40 tokens could all be out first.
  with hold_driver(driver, "_step", lambda: driver.metrics["tokens"] >= 2) as hold:
    live = asyncio.create_task(gen(driver, SHORT, 40))
    await hold.wait_reached()
    long = asyncio.create_task(gen(driver, LONG, 4, request_id="long"))
    await asyncio.wait_for(_queued(driver, "long"), 30)
  await asyncio.wait_for(asyncio.gather(long, live), 120)
  steps = [n for _, n in seen]
  assert len(steps) == 4 and all(b > a for a, b in itertools.pairwise(steps))  # a decode call each


@pytest.mark.slow  # ~8 s
async def test_an_update_mid_prompt_prefills_it_again_under_the_new_weights(make_driver):
  old, new = tiny_model(seed=4), tiny_model(seed=5)
  driver = make_driver(old, prefill_chunk=8, prefix_reuse=False)
  update = []

  def on_piece(n):  # on the engine thread, before piece 2 runs: applied before piece 3
    if n == 2:
      update.append(driver.submit_update(nnx.state(new), 1))

  seen = _record_pieces(driver, on_piece)
  res = await gen(driver, LONG, 8)
  await asyncio.wait_for(asyncio.wrap_future(update[0]), 30)
  assert [start for start, _ in seen] == [0, 8, 0, 8, 16, 24]
  assert res.versions == [1] * 8
  assert res.tokens == greedy_reference(new, LONG, 8)
  np.testing.assert_allclose(res.logprobs, learner_logprobs(new, LONG, res.tokens, 1.0), atol=1e-4)


async def test_abort_mid_prompt_frees_the_slot(make_driver):
  driver = make_driver(tiny_model(seed=9), slots=1, prefill_chunk=8, prefix_reuse=False)
  _record_pieces(driver, lambda n: n == 2 and driver.abort("long"))
  res = await gen(driver, LONG, 8, request_id="long")
  assert res.stop_reason == "abort" and res.tokens == []
  assert driver.stats()["slots_prefilling"] == 0
  assert (await gen(driver, SHORT, 3)).stop_reason == "length"  # the one slot serves again


def test_prefill_chunk_must_be_an_extend_bucket(make_driver):
  with pytest.raises(ValueError, match=r"DriverConfig\.prefill_chunk=12"):
    make_driver(tiny_model(), prefill_chunk=12)
