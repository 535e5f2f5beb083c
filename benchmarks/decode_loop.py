"""Multi-step decode loops side by side: one step per call vs k steps per call with each device
loop (`EngineConfig.decode_loop`: "while", "fixed", "unrolled"), through the RL driver.

Runs with no arguments: decode.py's batch-32 workload (qwen2-tiny, random weights, 32 prompts of
32 tokens, 64 new tokens each, greedy, with and without logprobs), all engines in one process and
the repetitions interleaved (rep 1 of every contender, then rep 2, ...); each ratio is taken per
repetition against the one-step engine and reported as median [min, max]. Only the shapes this
workload uses are compiled (one prefill bucket, every slot decoding), so it fits a short
accelerator lease. Why it exists: XLA:GPU reads a data-dependent while loop's condition back to
the host every iteration, so a "while" call launches each step's kernels only after the previous
step finished; a known trip count ("fixed") or straight-line code ("unrolled") lets the host run
ahead. On a CPU the spare steps of a fixed loop are real work. Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax
from flax import nnx

from asearcher_jax.model import presets, transformer
from asearcher_jax.serving.driver import Driver
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.serving.types import SamplingParams
from asearcher_jax.tokenizer import Tokenizer

SAMPLINGS = {
  "plain": SamplingParams(temperature=0.0, logprobs=False),
  "logprobs": SamplingParams(temperature=0.0),
}
# name -> (decode steps per call, device loop)
CONTENDERS = {
  "k1": (1, "while"),
  "while": (8, "while"),
  "fixed": (8, "fixed"),
  "unrolled": (8, "unrolled"),
}


def tok_s(engine: Engine, prompts, n_new: int, sampling: SamplingParams) -> float:
  driver = Driver(engine)

  async def go():
    jobs = [driver.generate(p, sampling, n_new, stop_token_ids=()) for p in prompts]
    return await asyncio.wait_for(asyncio.gather(*jobs), 600)

  t = time.perf_counter()
  results = asyncio.run(go())
  secs = time.perf_counter() - t
  driver.close()
  return sum(len(r.tokens) for r in results) / secs


def spread(values) -> dict:
  v = [float(x) for x in values]
  return {"median": round(float(np.median(v)), 3), "min": round(min(v), 3), "max": round(max(v), 3)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--model", default="qwen2-tiny", help="model preset")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                      help="default: bfloat16 on an accelerator, float32 on the CPU")  # fmt: skip
  parser.add_argument("--batch", type=int, default=32, help="concurrent requests = slots")
  parser.add_argument("--new-tokens", type=int, default=64)
  parser.add_argument("--reps", type=int, default=5)
  args = parser.parse_args()
  dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
  cfg = presets.model_config(name=args.model, param_dtype=dtype, dtype=dtype)
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  tok = Tokenizer.qwen2()
  rng = np.random.default_rng(32)
  prompts = [rng.integers(100, min(cfg.vocab_size, 20000), 32).tolist() for _ in range(args.batch)]
  max_seq = 1 << (32 + args.new_tokens).bit_length()
  device = jax.devices()[0].device_kind
  print(f"{args.model} {dtype} on {device}: batch {args.batch}, {args.new_tokens} new tokens, "
        f"{args.reps} interleaved repetitions", flush=True)  # fmt: skip
  engines, warm_s = {}, {}
  for name, (k, loop) in CONTENDERS.items():
    t = time.perf_counter()
    ecfg = EngineConfig(max_slots=args.batch, max_seq_len=max_seq, prefill_buckets=(32,),
                        decode_rows=(), decode_steps_per_call=k, decode_loop=loop)  # fmt: skip
    engines[name] = Engine.from_model(model, tok, ecfg)
    for sampling in SAMPLINGS.values():  # compiles what the workload uses, untimed
      tok_s(engines[name], prompts, args.new_tokens, sampling)
    warm_s[name] = round(time.perf_counter() - t, 1)
  print(f"warm-up s: {warm_s}", flush=True)
  reps = []
  for _ in range(args.reps):
    r = {}
    for name, engine in engines.items():
      for s_name, sampling in SAMPLINGS.items():
        r[f"{name}_{s_name}_tok_s"] = tok_s(engine, prompts, args.new_tokens, sampling)
    for name in CONTENDERS:
      for s_name in SAMPLINGS:
        if name != "k1":
          r[f"{name}_vs_k1_{s_name}"] = r[f"{name}_{s_name}_tok_s"] / r[f"k1_{s_name}_tok_s"]
    reps.append(r)
  summary = {key: spread([r[key] for r in reps]) for key in reps[0]}
  for key, v in summary.items():
    print(f"{key}: {v['median']} [{v['min']}, {v['max']}]", flush=True)
  result = {
    "device": jax.devices()[0].device_kind,
    "dtype": dtype,
    "batch": args.batch,
    "new_tokens": args.new_tokens,
    "reps": args.reps,
    "warmup_s": warm_s,
    **{f"{n}_vs_k1": summary[f"{n}_vs_k1_plain"]["median"] for n in CONTENDERS if n != "k1"},
    "figures": summary,
  }
  print(json.dumps(result))


if __name__ == "__main__":
  main()
