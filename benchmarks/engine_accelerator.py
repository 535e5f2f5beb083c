"""The serving engine's prefill and decode programs at a real model's shapes on one accelerator,
beside the planner's figure for the same step.

The engine a serve-model replica runs (`serving.engine.Engine`, paged KV cache, gather attention:
the GPU path; TPU reads pages with the ragged kernel), random weights of the named preset in
bf16, `--slots` sequences each prefilled with a `--prompt`-token prompt, then decoded one step a
call with every slot live. Measured: prefill tokens/s (one prompt a call, the engine's whole-
prompt prefill) and decode tokens/s (slots / step seconds, median of `--steps` steps), the step
against `plan_memory.decode_step_s` at the same batch and context with the chip's documented
peaks (`--chip`, the planner's default efficiencies).

  python benchmarks/engine_accelerator.py            # CPU: a tiny model, seconds (checks the path)
  python benchmarks/engine_accelerator.py --model qwen2.5-7b --slots 64 --prompt 3968 \
      --window 4096 --chip h200                       # one H200: what docs/measurements.md holds

Prints one JSON object on its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax
from flax import nnx

from asearcher_jax.model import presets, transformer
from asearcher_jax.rl import plan_memory as mem
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.tokenizer import Tokenizer

PAGE = 128  # positions per page (the recipes' page size)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--model", default="qwen2-tiny", help="model preset (random weights)")
  p.add_argument("--dtype", default=None, help="weights and activations (default: bf16 on an "
                 "accelerator, float32 on CPU)")  # fmt: skip
  p.add_argument("--slots", type=int, default=8, help="sequences decoding at once")
  p.add_argument("--window", type=int, default=512, help="context window (max_seq_len)")
  p.add_argument("--prompt", type=int, default=448, help="prompt tokens per sequence")
  p.add_argument("--steps", type=int, default=16, help="timed decode steps")
  p.add_argument("--chip", default=None, help="planner chip (plan_memory.CHIPS) for the figure")
  a = p.parse_args()
  device = jax.devices()[0]
  dtype = a.dtype or ("float32" if device.platform == "cpu" else "bfloat16")
  cfg = presets.model_config(name=a.model, param_dtype=dtype, dtype=dtype)
  t0 = time.perf_counter()
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  jax.block_until_ready(nnx.state(model))
  init_s = time.perf_counter() - t0
  engine_cfg = EngineConfig(
    max_slots=a.slots, max_seq_len=a.window, prefill_buckets=(a.window,), kv_layout="paged",
    page_size=PAGE, decode_rows=(),
  )  # fmt: skip
  engine = Engine.from_model(model, Tokenizer.qwen2(), engine_cfg)
  params = engine.load_params()
  rng = np.random.default_rng(0)
  state = engine.init_decode_state()
  table = np.arange(1, a.slots * engine_cfg.pages_per_seq + 1, dtype=np.int32).reshape(a.slots, -1)
  state = engine.set_page_table(state, table)

  def prefill():
    prompt = rng.integers(1, min(cfg.vocab_size, 150000), a.prompt).tolist()
    padded, n = engine.pad(prompt)
    prefix = engine.prefill(params=params, padded_tokens=padded, true_length=n)
    jax.block_until_ready(prefix)
    return prefix, n

  t0 = time.perf_counter()
  prefix, n = prefill()  # compiles
  compile_prefill_s = time.perf_counter() - t0
  times = []
  for slot in range(a.slots):
    t0 = time.perf_counter()
    if slot:
      prefix, n = prefill()
    times.append(time.perf_counter() - t0)
    state = engine.insert(prefix, state, slot)
  prefill_s = float(np.median(times[1:])) if len(times) > 1 else times[0]
  longest = n

  def step():
    nonlocal state, longest
    longest += 1
    state, res = engine.generate(params, state, max_length=longest, mode="greedy")
    np.asarray(res.data)  # the host copy a server needs every step

  t0 = time.perf_counter()
  step()  # compiles
  compile_decode_s = time.perf_counter() - t0
  steps = []
  for _ in range(min(a.steps, a.window - longest - 1)):
    t0 = time.perf_counter()
    step()
    steps.append(time.perf_counter() - t0)
  step_s = float(np.median(steps))
  context = n + len(steps) / 2
  out = {
    "benchmark": "engine_accelerator", "device": device.device_kind, "platform": device.platform,
    "jax": jax.__version__, "model": a.model, "params_b": round(cfg.num_params() / 1e9, 3),
    "dtype": dtype, "kv_layout": "paged", "attention": getattr(state.cache, "attention", None),
    "slots": a.slots, "window": a.window, "prompt": n, "init_s": round(init_s, 1),
    "compile_prefill_s": round(compile_prefill_s, 1), "compile_decode_s": round(compile_decode_s, 1),
    "prefill_s": round(prefill_s, 4), "prefill_tokens_s": round(n / prefill_s, 1),
    "decode_step_ms": round(step_s * 1e3, 3), "decode_tokens_s": round(a.slots / step_s, 1),
    "decode_step_ms_min_max": [round(min(steps) * 1e3, 3), round(max(steps) * 1e3, 3)],
  }  # fmt: skip
  if a.chip is not None:
    rates = mem.chip_rates(mem.ServingShape(), mem.chip_name(a.chip))
    planned = mem.decode_step_s(cfg, batch=a.slots, context=context, rates=rates)
    out.update({
      "chip": a.chip, "planned_decode_step_ms": round(planned * 1e3, 3),
      "planned_decode_tokens_s": round(a.slots / planned, 1),
      "measured_over_planned_step": round(step_s / planned, 3),
      "planned_prefill_tokens_s": round(n / mem.prefill_s(cfg, n, rates), 1),
    })  # fmt: skip
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
