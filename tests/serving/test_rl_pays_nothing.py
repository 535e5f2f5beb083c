"""Top logprobs cost RL nothing: a step in which no request asks compiles without a top-k, and the
engine asks for that variant on every path (prefill, suffix prefill, decode rows, multi-step
decode) unless a request in it wants alternatives. `benchmarks/decode.py` measures the same
claim as throughput (docs/measurements.md, "RL requests after top logprobs were added")."""

from __future__ import annotations

import asyncio
import collections
import re

import pytest

from asearcher_jax.serving import engine_steps
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.serving.types import SamplingParams
from tests.serving.conftest import tiny_model

T = 60  # seconds: bound on every await below
STEPS = ("PREFILL", "PREFILL_MANY", "GENERATE", "GENERATE_ROWS", "DECODE_CHUNK", "EXTEND_ROW")


def _ops(text: str) -> collections.Counter:
  return collections.Counter(re.findall(r"\b(?:stablehlo|chlo|mhlo)\.[a-z_]+", text))


@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_the_rl_variant_of_a_decode_step_has_no_top_k(tokenizer, mode):
  config = EngineConfig(max_slots=4, max_seq_len=64, prefill_buckets=(16, 32))
  engine = Engine.from_model(tiny_model(), tokenizer, config)
  params, state = engine.load_params(), engine.init_decode_state()
  lowered = {
    n: engine_steps.GENERATE.lower(engine._graphdef, 64, mode, params, state, top_n=n)
    for n in (0, engine_steps.TOP_N)
  }
  rl, asking = (_ops(lowered[n].as_text()) for n in (0, engine_steps.TOP_N))
  assert "chlo.top_k" not in rl and asking["chlo.top_k"] == 1
  # The RL step does nothing the asking step does not (it is that program less the alternatives).
  assert all(count <= asking[op] for op, count in rl.items()), rl - asking
  widths = [lowered[n].out_info[1].data.shape[1] for n in (0, engine_steps.TOP_N)]
  assert widths == [engine_steps.COLUMNS, engine_steps.COLUMNS + 2 * engine_steps.TOP_N]


@pytest.mark.parametrize("decode_steps", [1, pytest.param(4, marks=pytest.mark.slow)])
async def test_rl_requests_never_run_the_top_logprob_variant(
  make_driver, monkeypatch, decode_steps
):
  calls: list[tuple[str, int]] = []
  for name in STEPS:
    step = getattr(engine_steps, name)

    def recording(*args, _step=step, _name=name, **kw):
      calls.append((_name, kw.get("top_n", 0)))
      return _step(*args, **kw)

    monkeypatch.setattr(engine_steps, name, recording)
  driver = make_driver(decode_steps=decode_steps)
  prompt = [9, 3, 88, 31, 2, 40, 76, 61]
  rl = SamplingParams(temperature=1.0, seed=1)
  # A batch of RL requests, then an agent's next turn onto its parked prefix (suffix prefill).
  first = await asyncio.wait_for(
    asyncio.gather(*(driver.generate(prompt[i:], rl, 6, stop_token_ids=()) for i in range(3))), T
  )
  await asyncio.wait_for(driver.generate(prompt + first[0].tokens + [5, 7], rl, 6,
                                         stop_token_ids=()), T)  # fmt: skip
  used = {name for name, _ in calls}
  assert used & {"PREFILL", "PREFILL_MANY"} and used & {"GENERATE", "GENERATE_ROWS", "DECODE_CHUNK"}
  assert "EXTEND_ROW" in used  # the next turn took the suffix-prefill path
  assert calls and all(n == 0 for _, n in calls), calls
  # The recorder sees the other variant when a request asks: the check above is not vacuous.
  calls.clear()
  asking = SamplingParams(temperature=1.0, seed=1, top_logprobs=2)
  res = await asyncio.wait_for(driver.generate(prompt, asking, 4, stop_token_ids=()), T)
  assert res.top_logprobs is not None
  assert any(n == engine_steps.TOP_N for _, n in calls), calls
