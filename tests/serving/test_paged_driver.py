"""The paged KV cache in the driver: shared prompt pages, preemption under page pressure, and
an episode's turns mapping their earlier pages, each giving exactly the fixed-slot results."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from asearcher_jax.serving.engine import EngineConfig
from asearcher_jax.serving.types import SamplingParams
from tests.serving.conftest import TEST_PAGE_SIZE, hold_driver, tiny_model
from tests.serving.test_driver_correctness import learner_logprobs

NO_STOP: tuple[int, ...] = ()


async def run(driver, prompts, samplings, lengths):
  return await asyncio.wait_for(
    asyncio.gather(
      *[
        driver.generate(p, s, n, stop_token_ids=NO_STOP)
        for p, s, n in zip(prompts, samplings, lengths, strict=True)
      ]
    ),
    240,
  )


def assert_same(got, want) -> None:
  for g, w in zip(got, want, strict=True):
    assert g.tokens == w.tokens and g.versions == w.versions and g.stop_reason == w.stop_reason
    np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)


def assert_no_leak(driver) -> None:
  """Once every request is done, only the block cache holds pages."""
  s = driver.stats()
  assert s["slots_active"] == 0 and s["pages_used"] == s["pages_cached"]


@pytest.mark.slow
async def test_a_group_holds_its_prompt_once_and_samples_what_fixed_slots_sample(make_driver):
  model = tiny_model(seed=3)
  prompt = list(range(10, 10 + 4 * TEST_PAGE_SIZE))  # 4 full pages
  group = 16
  samplings = [SamplingParams(temperature=0.9, seed=s) for s in range(group)]
  fixed = make_driver(model, slots=group, layout="fixed", decode_rows=())
  paged = make_driver(model, slots=group, layout="paged", decode_rows=())
  want = await run(fixed, [prompt] * group, samplings, [12] * group)

  def all_live(*_) -> bool:
    return all(r is not None for r in paged._slots)

  with hold_driver(paged, "_step", all_live) as hold:
    task = asyncio.ensure_future(run(paged, [prompt] * group, samplings, [12] * group))
    await hold.wait_reached()
    pages = paged._table.pages
    prompt_pages = {tuple(p[:4]) for p in pages.pages}
    assert len(prompt_pages) == 1  # every sample maps the same four pages
    for page in next(iter(prompt_pages)):
      assert pages.allocator.refs(page) == group + 1  # 16 tables and the block cache
    # Unshared, 16 prompts take 64 pages; shared, 4 (plus each sample's own decode pages).
    assert pages.allocator.used <= 4 + group * 2
    hold.release()
    got = await task
  assert_same(got, want)
  np.testing.assert_allclose(
    got[0].logprobs, learner_logprobs(model, prompt, got[0].tokens, 0.9), atol=1e-4
  )
  s = paged.stats()
  # One prefill of the prompt; the other samples only feed its last token (nothing written).
  assert s["prefix_hits"] == group - 1 and s["prefill_tokens"] == len(prompt) + group - 1
  assert_no_leak(paged)


@pytest.mark.slow
@pytest.mark.parametrize("decode_steps", [1, 4])
async def test_preemption_under_page_pressure_gives_the_unpressured_tokens(
  make_driver, decode_steps
):
  """Six sequences of up to 50 positions (13 pages each) share a pool of 18 pages: the youngest
  are preempted and re-prefilled again and again; every request completes, as without pressure."""
  model = tiny_model(seed=5)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 100, n).tolist() for n in (9, 3, 12, 6, 10, 5)]
  samplings = [SamplingParams(temperature=0.0)] * 3 + [
    SamplingParams(temperature=0.8, seed=s) for s in range(3)
  ]
  lengths = [40, 30, 38, 25, 35, 40]
  roomy = make_driver(model, slots=6, layout="fixed", decode_steps=decode_steps)
  tight = make_driver(
    model, slots=6, layout="paged", num_pages=64 // TEST_PAGE_SIZE + 2, decode_steps=decode_steps
  )
  want = await run(roomy, prompts, samplings, lengths)
  got = await run(tight, prompts, samplings, lengths)
  assert_same(got, want)
  s = tight.stats()
  assert s["preemptions"] > 0 and s["requests_done"] == 6
  assert_no_leak(tight)


@pytest.mark.slow
async def test_an_episodes_turns_map_their_earlier_pages(make_driver):
  model = tiny_model(seed=1)
  fixed = make_driver(model, slots=2, layout="fixed")
  paged = make_driver(model, slots=2, layout="paged")
  greedy = SamplingParams(temperature=0.0)
  tool = [17, 42, 5, 66, 23]

  async def turns(driver):
    prompt, out = [9, 3, 88, 31, 2, 40, 76, 61, 14, 3, 90, 11], []
    for _ in range(3):
      (res,) = await run(driver, [prompt], [greedy], [6])
      out.append(res)
      prompt = prompt + res.tokens + tool
    return out

  assert_same(await turns(paged), await turns(fixed))
  s = paged.stats()
  assert s["prefix_hits"] == 2
  # Each turn maps the full pages of the one before (prompt + tokens but the last).
  assert s["prefix_tokens_reused"] == (12 + 5) // 4 * 4 + (12 + 6 + 5 + 5) // 4 * 4
  assert_no_leak(paged)


async def test_aborts_free_their_pages(make_driver):
  driver = make_driver(tiny_model(seed=2), slots=2, layout="paged", prefix_reuse=False)
  task = asyncio.ensure_future(
    driver.generate([5, 6, 7], SamplingParams(temperature=0.0), 50, stop_token_ids=NO_STOP)
  )
  while driver.stats()["tokens_generated"] < 3:
    await asyncio.sleep(0.01)
  driver.abort(next(r.id for r in driver._slots if r is not None))
  res = await asyncio.wait_for(task, 60)
  assert res.stop_reason == "abort"
  assert driver.stats()["pages_used"] == 0


def test_paged_config_errors_name_the_field():
  with pytest.raises(ValueError, match="page_size"):
    EngineConfig(max_seq_len=100, page_size=16, kv_layout="paged")
  with pytest.raises(ValueError, match="num_pages"):
    EngineConfig(max_seq_len=64, page_size=4, num_pages=10, kv_layout="paged")
  with pytest.raises(ValueError, match="kv_layout"):
    EngineConfig(kv_layout="ragged")
  assert EngineConfig(max_slots=2, max_seq_len=64, page_size=4).pool_pages == 33
