"""The engine + driver produce exactly what the model computes, with logprobs and versions."""

from __future__ import annotations

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asearcher_jax.model import transformer
from asearcher_jax.serving.types import GenerationClient, SamplingParams
from tests.serving.conftest import BOTH_LAYOUTS, BOTH_STEPS, VOCAB, hold_driver, tiny_model

GREEDY = SamplingParams(temperature=0.0)
NO_STOP: tuple[int, ...] = ()


@nnx.jit
def _forward(model, tokens):
  return model(tokens)


@nnx.jit(static_argnums=3)
def _score(model, tokens, segment_ids, temperature):
  positions = jnp.arange(tokens.shape[1])[None]
  return transformer.score(model, tokens, positions, segment_ids, temperature)


def _padded(ids: list[int], width: int) -> tuple[jax.Array, jax.Array]:
  """ids right-padded to a multiple of `width`, and their segment ids (0 on the padding): causal
  attention makes the padding invisible, and a few shapes compile once each instead of every
  length running op by op (seconds per new length on CPU)."""
  n = -(-len(ids) // width) * width
  seg = [1] * len(ids) + [0] * (n - len(ids))
  return jnp.asarray([list(ids) + [0] * (n - len(ids))]), jnp.asarray([seg])


def greedy_reference(model, prompt, n, width=64):
  """Greedy decoding by full forward passes, no cache."""
  seq = list(prompt)
  for _ in range(n):
    padded, _ = _padded(seq, width)
    seq.append(int(jnp.argmax(_forward(model, padded)[0, len(seq) - 1])))
  return seq[len(prompt) :]


def learner_logprobs(model, prompt, tokens, temperature, width=64):
  """The learner's per-token logprobs of `tokens` after `prompt` (`transformer.score`)."""
  ids = list(prompt) + list(tokens)
  padded, seg = _padded(ids, width)
  lp = _score(model, padded, seg, float(temperature))
  return np.asarray(lp[0, len(prompt) : len(ids)])


def assert_same_results(a, b, model, prompts, later, temperature) -> None:
  """Two drivers' results agree (tokens, versions, stop reasons, logprobs within 1e-5), and the
  results `later` (after the first len(a) - len(later)) carry the model's own logprobs of their
  `prompts`."""
  for ra, rb in zip(a, b, strict=True):
    assert ra.tokens == rb.tokens and ra.versions == rb.versions
    assert ra.stop_reason == rb.stop_reason
    np.testing.assert_allclose(ra.logprobs, rb.logprobs, atol=1e-5)
  for prompt, res in zip(prompts, later, strict=True):
    np.testing.assert_allclose(
      res.logprobs, learner_logprobs(model, prompt, res.tokens, temperature), atol=1e-4
    )


PROMPTS = [
  [5, 17, 42],
  [9, 3, 88, 31, 2, 40, 76, 61, 14, 3, 90, 11],
  [7],
  [1, 2, 3, 4, 5, 6, 7, 8, 9],
]


@BOTH_STEPS
@BOTH_LAYOUTS
async def test_greedy_equals_full_forward_in_parallel_slots(make_driver):
  model = tiny_model(seed=1)
  driver = make_driver(model, slots=3)  # 4 prompts through 3 slots: one waits for a free slot
  assert isinstance(driver, GenerationClient)
  results = await asyncio.wait_for(
    asyncio.gather(
      *[driver.generate(p, GREEDY, max_new_tokens=10, stop_token_ids=NO_STOP) for p in PROMPTS]
    ),
    120,
  )
  for prompt, res in zip(PROMPTS, results, strict=True):
    assert res.tokens == greedy_reference(model, prompt, 10)
    assert res.stop_reason == "length"
    assert res.versions == [0] * 10
    np.testing.assert_allclose(
      res.logprobs, learner_logprobs(model, prompt, res.tokens, 1.0), atol=1e-4
    )
  assert driver.stats()["slots_active"] == 0


async def test_greedy_without_logprobs_same_tokens_nan_logprobs(make_driver):
  model = tiny_model(seed=1)
  driver = make_driver(model, slots=2)
  quiet = SamplingParams(temperature=0.0, logprobs=False)
  prompt = PROMPTS[1]
  alone = await asyncio.wait_for(driver.generate(prompt, quiet, 8, stop_token_ids=NO_STOP), 120)
  assert alone.tokens == greedy_reference(model, prompt, 8)
  assert np.isnan(alone.logprobs).all() and len(alone.logprobs) == 8
  # Sharing steps with a request that wants logprobs: both get them (one compiled path per step).
  both = await asyncio.wait_for(
    asyncio.gather(
      driver.generate(prompt, quiet, 8, stop_token_ids=NO_STOP),
      driver.generate(PROMPTS[0], GREEDY, 8, stop_token_ids=NO_STOP),
    ),
    120,
  )
  assert both[0].tokens == alone.tokens
  np.testing.assert_allclose(
    both[1].logprobs, learner_logprobs(model, PROMPTS[0], both[1].tokens, 1.0), atol=1e-4
  )


@pytest.mark.slow
@BOTH_STEPS
async def test_decode_over_live_rows_only_matches_full_steps(make_driver):
  """With decode_rows, a step computes only enough gathered rows for the live slots; tokens,
  logprobs and the untouched slots must be exactly what full steps give."""
  model = tiny_model(seed=4)
  prompts = [*PROMPTS, [3, 1, 4, 1, 5, 9, 2, 6], [60, 61]]
  lengths = [12, 3, 9, 5, 14, 7]  # requests finish at different steps: the live set shrinks
  sp = [SamplingParams(temperature=0.9, seed=s) for s in range(len(prompts))]

  async def run(driver):
    return await asyncio.wait_for(
      asyncio.gather(
        *[
          driver.generate(p, s, n, stop_token_ids=NO_STOP)
          for p, s, n in zip(prompts, sp, lengths, strict=True)
        ]
      ),
      120,
    )

  full = make_driver(model, slots=8, decode_rows=())
  gathered = make_driver(model, slots=8, decode_rows=(2, 4))
  want, got = await run(full), await run(gathered)
  for p, w, g in zip(prompts, want, got, strict=True):
    assert g.tokens == w.tokens and len(g.tokens) > 0
    np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
    np.testing.assert_allclose(g.logprobs, learner_logprobs(model, p, g.tokens, 0.9), atol=1e-4)
  assert full.stats()["decode_rows_per_step"] == 8
  assert gathered.stats()["decode_rows_per_step"] < 8  # the shrinking tail ran on 4 or 2 rows
  # Greedy through gathered steps equals full forward passes too (a second wave of requests
  # lands in slots whose neighbours are parked, with their caches left as they were).
  again = await asyncio.wait_for(
    asyncio.gather(*[gathered.generate(p, GREEDY, 6, stop_token_ids=NO_STOP) for p in prompts[:3]]),
    120,
  )
  for p, r in zip(prompts[:3], again, strict=True):
    assert r.tokens == greedy_reference(model, p, 6)


def test_gathered_step_leaves_other_slots_alone(tokenizer):
  from asearcher_jax.serving.engine import Engine, EngineConfig

  engine = Engine.from_model(
    tiny_model(seed=5), tokenizer,
    EngineConfig(max_slots=6, max_seq_len=32, prefill_buckets=(8,), decode_rows=(2,)),
  )  # fmt: skip
  params, state = engine.load_params(), engine.init_decode_state()
  for slot, prompt in enumerate([[5, 6, 7], [8, 9], [10, 11, 12, 13]]):
    padded, n = engine.pad(prompt)
    state = engine.insert(
      engine.prefill(params=params, padded_tokens=padded, true_length=n), state, slot
    )
  before = jax.tree.map(np.asarray, state)
  state, result = engine.generate(params, state, max_length=8, mode="greedy", live=[2, 0])
  after = jax.tree.map(np.asarray, state)
  data = np.asarray(result.data)
  assert list(data[:, 1]) == [1, 0, 1, 0, 0, 0]  # valid only where computed and live
  assert list(after.lengths) == [4, 2, 5, 0, 0, 0]  # slot 1 is active but was not in `live`
  for k0, k1 in zip(before.cache.k, after.cache.k, strict=True):
    np.testing.assert_array_equal(k1[1], k0[1])  # not read, not written
    np.testing.assert_array_equal(k1[3:], k0[3:])
    assert not np.array_equal(k1[0, 3], k0[0, 3])  # the live slots' new keys landed
  # One live slot, padded to the 2-row step with another slot that rides along inactive: that
  # one keeps its length, and only the cache's last position (never a prefix) is written.
  state, result = engine.generate(params, state, max_length=8, mode="greedy", live=[2])
  padded_after = jax.tree.map(np.asarray, state)
  assert list(np.asarray(result.data)[:, 1]) == [0, 0, 1, 0, 0, 0]
  assert list(padded_after.lengths) == [4, 2, 6, 0, 0, 0]
  for k1, k2 in zip(after.cache.k, padded_after.cache.k, strict=True):
    np.testing.assert_array_equal(k2[0, :-1], k1[0, :-1])
  with pytest.raises(ValueError, match="bad live slots"):
    engine.generate(params, state, max_length=8, mode="greedy", live=[0, 9])


@BOTH_STEPS
@BOTH_LAYOUTS
async def test_sampled_logprobs_equal_learner_and_seeds_reproduce(make_driver):
  model = tiny_model(seed=2)
  driver = make_driver(model, slots=4)
  sp = SamplingParams(temperature=0.7, seed=123)
  a, b = await asyncio.wait_for(
    asyncio.gather(
      driver.generate(PROMPTS[1], sp, 20, stop_token_ids=NO_STOP),
      driver.generate(PROMPTS[1], sp, 20, stop_token_ids=NO_STOP),
    ),
    120,
  )
  assert a.tokens == b.tokens  # same seed, different slots: same sample
  np.testing.assert_allclose(
    a.logprobs, learner_logprobs(model, PROMPTS[1], a.tokens, 0.7), atol=1e-4
  )
  c = await asyncio.wait_for(
    driver.generate(
      PROMPTS[1], SamplingParams(temperature=0.7, seed=7), 20, stop_token_ids=NO_STOP
    ),
    60,
  )
  assert c.tokens != a.tokens


@BOTH_STEPS
@BOTH_LAYOUTS
async def test_top_k_and_top_p_restrict_the_draw(make_driver):
  model = tiny_model(seed=3)
  driver = make_driver(model, slots=4)
  prompt = PROMPTS[0]
  res = await asyncio.wait_for(
    driver.generate(
      prompt, SamplingParams(temperature=1.5, top_k=2, seed=1), 1, stop_token_ids=NO_STOP
    ),
    60,
  )
  padded, _ = _padded(prompt, 64)
  logits = _forward(model, padded)[0, len(prompt) - 1]
  assert res.tokens[0] in set(np.argsort(-np.asarray(logits))[:2].tolist())
  # top_p tiny -> only the argmax survives, whatever the temperature.
  res = await asyncio.wait_for(
    driver.generate(
      prompt, SamplingParams(temperature=5.0, top_p=1e-6, seed=2), 1, stop_token_ids=NO_STOP
    ),
    60,
  )
  assert res.tokens[0] == int(jnp.argmax(logits))
  # The reported logprob is the untruncated temperature-scaled one.
  want = float(jax.nn.log_softmax(logits / 5.0)[res.tokens[0]])
  assert abs(res.logprobs[0] - want) < 1e-4


async def swap_after(driver, new_model, n_before: int) -> None:
  """Swaps in new_model's weights as version 1 once the one live request has produced n_before
  tokens. The driver thread waits after that step until the update is submitted: polled from the
  event loop instead, the update landed after the request had ended on a busy machine (the CI
  run of the suite with k4, 2026-11-26)."""

  def produced_enough() -> bool:
    req = next((r for r in driver._slots if r is not None), None)
    return req is not None and len(req.tokens) >= n_before

  with hold_driver(driver, "_step", produced_enough) as hold:
    await hold.wait_reached()
    update = driver.submit_update(nnx.state(new_model), 1)
  await asyncio.wrap_future(update)


@pytest.mark.slow
@BOTH_STEPS
@BOTH_LAYOUTS
async def test_weight_swap_mid_generation(make_driver):
  old, new = tiny_model(seed=4), tiny_model(seed=5)
  # A long context: on a loaded machine the engine thread can run many decode calls between the
  # poll that sees n_before tokens and the update landing (40 tokens were once all generated
  # before it, with 4 steps per call, under three busy test workers).
  driver = make_driver(old, slots=2, max_seq_len=192)
  prompt = PROMPTS[1]
  n_before, n_total = 6, 160
  # A stop-free long request; the swap lands somewhere after n_before tokens.
  task = asyncio.create_task(driver.generate(prompt, GREEDY, n_total, stop_token_ids=NO_STOP))
  await asyncio.wait_for(swap_after(driver, new, n_before), 60)
  res = await asyncio.wait_for(task, 60)
  assert 1 in res.versions, "the update never landed mid-generation"
  k = res.versions.index(1)  # first token produced by the new weights
  assert k >= n_before and res.versions == [0] * k + [1] * (n_total - k)
  assert res.tokens[:k] == greedy_reference(old, prompt, k, width=192)
  assert res.tokens[k:] == greedy_reference(new, prompt + res.tokens[:k], n_total - k, width=192)
  np.testing.assert_allclose(
    res.logprobs[k:], learner_logprobs(new, prompt + res.tokens[:k], res.tokens[k:], 1.0), atol=1e-4
  )
  assert driver.stats()["last_update_ms"] > 0 and driver.version == 1


@BOTH_STEPS
@BOTH_LAYOUTS
async def test_stop_strings_stay_in_output_and_stop_tokens(make_driver, tokenizer):
  model = tiny_model(seed=6)
  driver = make_driver(model, slots=2)
  free = await asyncio.wait_for(driver.generate(PROMPTS[0], GREEDY, 12, stop_token_ids=NO_STOP), 60)
  # Use the text of the 4th generated token as a stop string: generation must end right there.
  stop_text = tokenizer.decode(free.tokens[3:4])
  res = await asyncio.wait_for(
    driver.generate(PROMPTS[0], GREEDY, 12, stop=[stop_text], stop_token_ids=NO_STOP), 60
  )
  first_hit = next(i for i in range(12) if stop_text in tokenizer.decode(free.tokens[: i + 1]))
  assert res.tokens == free.tokens[: first_hit + 1] and res.stop_reason == "stop"
  assert tokenizer.decode(res.tokens).endswith(stop_text)
  res = await asyncio.wait_for(
    driver.generate(PROMPTS[0], GREEDY, 12, stop_token_ids=[free.tokens[2]]), 60
  )
  assert res.tokens[-1] == free.tokens[2] and res.stop_reason == "stop"


@BOTH_LAYOUTS
async def test_bad_requests_are_clear_errors(make_driver):
  driver = make_driver(slots=2, max_seq_len=32)
  with pytest.raises(ValueError, match="does not fit the context"):
    await driver.generate(list(range(1, 40)), GREEDY, 4)
  with pytest.raises(ValueError, match="empty prompt"):
    await driver.generate([], GREEDY, 4)
  # Near the end of the context the request stops with "length", not a crash.
  res = await asyncio.wait_for(
    driver.generate(list(range(1, 30)), GREEDY, 50, stop_token_ids=NO_STOP), 60
  )
  assert res.stop_reason == "length" and len(res.tokens) == 32 - 29
  assert max(res.tokens) < VOCAB
