"""Engine cost of long-horizon episodes on the SynthWiki policy size (no arguments; ~3-5 minutes
on 2 CPU cores): what `asearcher long-horizon`'s RL stage can generate in its time budget.

The shipped SynthWiki warm start (synthwiki-2m, the long-horizon warm start's preset) serves
episodes shaped like the long-horizon agent's: per tool call an act turn (16 new tokens), a tool
result appended to the context (40 tokens) and a read turn (16 new tokens), ~72 context tokens per
tool call, as measured on the scripted expert with compacted results (~62), through the real
driver (prefix reuse, continuous batching) with 16 episodes at once. Reported per episode length
(4, 12, 30 tool calls; a first untimed round compiles): seconds, episodes/s, generated tokens/s,
final context length, engine prefill and decode seconds; then a projection of episodes and RL
steps (B = 2 groups of n = 8) per 25 minutes at each length. The last line is one JSON object.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from asearcher_jax.apps.long_horizon import LONG_ENGINE
from asearcher_jax.apps.quickstart import DEFAULT_WARM_START
from asearcher_jax.model.loading import load_policy
from asearcher_jax.serving.driver import Driver, DriverConfig
from asearcher_jax.serving.engine import Engine
from asearcher_jax.serving.types import SamplingParams

EPISODES = 16
PROMPT = 200  # the synthwiki prompt and a long question, in tokens
ACT, RESULT, READ = 16, 40, 16
LENGTHS = (4, 12, 30)
RL_SECONDS = 1500.0


async def episode(driver: Driver, rng: np.random.Generator, tool_calls: int, seed: int) -> int:
  """One episode of `tool_calls` tool calls; returns its final context length."""
  ctx = [int(x) for x in rng.integers(10, 1500, PROMPT)]  # ordinary pieces of the 2k vocabulary
  sp = SamplingParams(temperature=1.0, seed=seed)
  for _ in range(tool_calls):
    for n_new, extra in ((ACT, RESULT), (READ, 0)):
      r = await driver.generate(ctx, sp, max_new_tokens=n_new, stop_token_ids=[], timeout=600)
      ctx += list(r.tokens) + [int(x) for x in rng.integers(10, 1500, extra)]
  r = await driver.generate(ctx, sp, max_new_tokens=8, stop_token_ids=[], timeout=600)
  return len(ctx) + len(r.tokens)


async def round_(driver: Driver, tool_calls: int, seed: int) -> dict[str, float]:
  before = driver.stats()
  t0 = time.perf_counter()
  rngs = [np.random.default_rng(seed * 1000 + i) for i in range(EPISODES)]
  ctx = await asyncio.gather(*(episode(driver, rngs[i], tool_calls, seed + i)
                               for i in range(EPISODES)))  # fmt: skip
  dt = time.perf_counter() - t0
  after = driver.stats()
  gen = after["tokens_generated"] - before["tokens_generated"]
  return {
    "tool_calls": tool_calls, "seconds": round(dt, 2),
    "episodes_per_s": round(EPISODES / dt, 3), "generated_tokens_per_s": round(gen / dt, 1),
    "context_tokens": int(max(ctx)),
    "prefill_s": round(after["prefill_s"] - before["prefill_s"], 2),
    "decode_s": round(after["decode_s"] - before["decode_s"], 2),
    "prefill_tokens": int(after["prefill_tokens"] - before["prefill_tokens"]),
  }  # fmt: skip


def main() -> dict:
  model = str(DEFAULT_WARM_START)
  policy, tokenizer, _ = load_policy(model, None, model, 0)
  engine_cfg = dataclasses.replace(LONG_ENGINE, max_slots=EPISODES)
  driver = Driver(Engine.from_model(policy, tokenizer, engine_cfg), DriverConfig())
  try:
    t0 = time.perf_counter()
    asyncio.run(round_(driver, 30, seed=99))  # compiles every shape the timed rounds use
    compile_s = time.perf_counter() - t0
    rows = [asyncio.run(round_(driver, n, seed=n)) for n in LENGTHS]
  finally:
    driver.close()
  for r in rows:
    eps = r["episodes_per_s"] * RL_SECONDS
    r["projected_episodes_25min"] = int(eps)
    r["projected_rl_steps_25min_B2n8"] = int(eps / 16)
    print(json.dumps(r))
  return {"untimed_first_round_s": round(compile_s, 1), "episodes": EPISODES, "rounds": rows}


if __name__ == "__main__":
  print(json.dumps(main()))
