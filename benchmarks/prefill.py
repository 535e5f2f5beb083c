"""Prefill that batches and prefill in pieces: new engine settings against the old, in one run.

Runs with no arguments (a few minutes on 2 CPU cores), on random qwen2-tiny weights (real Qwen
vocabulary), every figure measured REPS times with the contenders interleaved, reported as median
[min, max]; a ratio is taken per repetition (both sides back to back):
  (i)   suffix prefills of 8 parked slots that arrive together (agents' next turns after their
        tools return): one call over the 8 (`EngineConfig.suffix_batch`) vs one call per slot;
  (ii)  a weight update with 16 in-flight slots under kv_on_update="recompute": re-prefills grouped
        by bucket 8/4/2/1 per call (`DriverConfig.batch_reprefill`) vs one call per slot;
  (iii) a 2,000-token prompt admitted while 8 requests decode: the longest pause between two
        decode calls (what every live request waits) and the long prompt's time to its first
        token, prefilled in pieces of 256 tokens (`DriverConfig.prefill_chunk`) vs whole.
Prints one JSON object as its last line.
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

import jax
import jax.numpy as jnp
from flax import nnx

from asearcher_jax.model import presets, transformer
from asearcher_jax.serving.driver import Driver, DriverConfig
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.serving.types import SamplingParams
from asearcher_jax.tokenizer import Tokenizer

REPS = 3
SAMPLE = SamplingParams(temperature=1.0)
VOCAB = 20000
ENGINE = EngineConfig(
  max_slots=16, max_seq_len=2048, prefill_buckets=(256, 512, 1024, 2048), suffix_buckets=(64, 256)
)
CHUNK = 256  # prefill piece (iii)
LONG_PROMPT = 2000


def spread(values) -> dict:
  v = [float(x) for x in values]
  return {"median": round(float(np.median(v)), 3), "min": round(min(v), 3), "max": round(max(v), 3)}


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(100, VOCAB, length).tolist() for _ in range(n)]


def suffix_prefill_ms(engine: Engine, batched: bool) -> float:
  """8 slots parked with 400-token contexts, then a 48-token suffix into each: ms for the 8."""
  params, state = engine.load_params(), engine.init_decode_state()
  ctx, suffixes = prompts(8, 400, 1), prompts(8, 48, 2)
  pf = engine.prefill_many(params=params, prompts=ctx, samplings=[SAMPLE] * 8, seeds=range(8))
  state = engine.insert_many(pf, state, list(range(8)))
  t = time.perf_counter()
  if batched:
    state, tok, *_ = engine.extend_slots(
      params, state, list(range(8)), suffixes, [400] * 8, samplings=[SAMPLE] * 8,
      seeds=list(range(8)), bucket=64, window=512,
    )  # fmt: skip
    np.asarray(tok)
  else:
    for slot in range(8):
      state, tok, *_ = engine.extend_slot(params, state, slot, suffixes[slot], 400,
                                          sampling=SAMPLE, seed=slot, bucket=64, window=512)  # fmt: skip
      int(tok)  # the driver reads each first token back
  return (time.perf_counter() - t) * 1e3


def update_ms(engine: Engine, new_params, batched: bool) -> float:
  """A weight update with 16 in-flight requests (300-token prompts, 40 tokens in)."""
  driver = Driver(engine, DriverConfig(batch_reprefill=batched))

  async def go() -> float:
    tasks = [
      asyncio.create_task(driver.generate(p, SAMPLE, 1500, stop_token_ids=()))
      for p in prompts(16, 300, 3)
    ]
    while min((len(r.tokens) for r in driver._slots if r is not None), default=0) < 40:
      await asyncio.sleep(0.01)
    ms = await asyncio.to_thread(driver.update_params, new_params, 1)
    for t in tasks:
      t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return ms

  try:
    return asyncio.run(go())
  finally:
    driver.close()


def long_prompt_admission(engine: Engine, chunk: int) -> tuple[float, float]:
  """(longest pause between two decode calls in ms, the long prompt's time to first token in ms)
  while 8 requests decode and a 2,000-token prompt arrives."""
  driver = Driver(engine, DriverConfig(prefill_chunk=chunk, prefix_reuse=False))
  calls: list[float] = []
  generate = engine.generate

  def timed(*a, **kw):
    calls.append(time.perf_counter())
    return generate(*a, **kw)

  engine.generate = timed

  async def go() -> tuple[float, float]:
    live = [
      asyncio.create_task(driver.generate(p, SAMPLE, 1000, stop_token_ids=()))
      for p in prompts(8, 32, 4)
    ]
    while driver.stats()["tokens_generated"] < 80:
      await asyncio.sleep(0.005)
    t0 = time.perf_counter()
    await driver.generate(prompts(1, LONG_PROMPT, 5)[0], SAMPLE, 1, stop_token_ids=())
    ttft = time.perf_counter() - t0
    await asyncio.sleep(0.05)
    for t in live:
      t.cancel()
    await asyncio.gather(*live, return_exceptions=True)
    window = [c for c in calls if c >= t0 - 0.05]
    return max(np.diff(window)) * 1e3, ttft * 1e3

  try:
    return asyncio.run(go())
  finally:
    engine.generate = generate
    driver.close()


def main() -> dict:
  global VOCAB
  cfg = presets.model_config(name="qwen2-tiny")
  VOCAB = min(cfg.vocab_size, VOCAB)
  tok = Tokenizer.qwen2()
  engine = Engine.from_model(transformer.Transformer(cfg, rngs=nnx.Rngs(0)), tok, ENGINE)
  new_params = jax.tree.map(jnp.asarray, nnx.state(transformer.Transformer(cfg, rngs=nnx.Rngs(1))))
  print(f"qwen2-tiny ({cfg.num_params() / 1e6:.1f}M params), {jax.devices()[0].device_kind}, "
        f"{ENGINE}", flush=True)  # fmt: skip
  print(f"warm-up {engine.warmup(modes=('sample',)):.1f} s", flush=True)
  for batched in (True, False):  # untimed first passes: the driver, the update's shapes
    suffix_prefill_ms(engine, batched)
    update_ms(engine, new_params, batched)
  long_prompt_admission(engine, CHUNK)
  long_prompt_admission(engine, 0)
  reps = []
  for _ in range(REPS):
    r = {
      "suffix8_batched_ms": suffix_prefill_ms(engine, True),
      "suffix8_single_ms": suffix_prefill_ms(engine, False),
      "update16_batched_ms": update_ms(engine, new_params, True),
      "update16_single_ms": update_ms(engine, new_params, False),
    }
    r["chunked_max_pause_ms"], r["chunked_ttft_ms"] = long_prompt_admission(engine, CHUNK)
    r["whole_max_pause_ms"], r["whole_ttft_ms"] = long_prompt_admission(engine, 0)
    r["suffix8_single_vs_batched"] = r["suffix8_single_ms"] / r["suffix8_batched_ms"]
    r["update16_single_vs_batched"] = r["update16_single_ms"] / r["update16_batched_ms"]
    r["max_pause_whole_vs_chunked"] = r["whole_max_pause_ms"] / r["chunked_max_pause_ms"]
    reps.append(r)
    print({k: round(v, 2) for k, v in r.items()}, flush=True)
  result = {key: spread([r[key] for r in reps]) for key in reps[0]}
  result.update(
    device=jax.devices()[0].device_kind, reps=REPS, engine=dataclasses.asdict(ENGINE),
    prefill_chunk=CHUNK, long_prompt=LONG_PROMPT,
  )  # fmt: skip
  print(json.dumps(result), flush=True)
  return result


if __name__ == "__main__":
  main()
