"""Decode throughput of the engine on one device vs tensor-parallel over 4, side by side.

Runs with no arguments. Without an accelerator it forces 8 fake CPU devices: they share the host's
cores, so the ratio says what the split costs or gains on CPU (four device threads against one
device's intra-op threads), not what a slice gains; what it does show is that the sharded engine
decodes the same greedy tokens and logprobs. On a slice with >= 4 chips the same script measures
the real speed-up. The model is bench-30m (8 heads, 4 KV
heads, so attention, the MLP, the vocabulary and the KV cache all split four ways), float32.
Prints one JSON object as its last line.
"""

from __future__ import annotations

import os
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import json

import jax
import numpy as np
from flax import nnx

from asearcher_jax.model import presets, transformer
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.serving.engine_steps import result_logprobs
from asearcher_jax.serving.mesh import ServingMeshConfig
from asearcher_jax.tokenizer import Tokenizer

SLOTS, PROMPT_LEN, NEW_TOKENS, MAX_SEQ, TENSOR = 8, 32, 64, 256, 4


def decode(engine: Engine, prompts: list[list[int]]) -> tuple[float, np.ndarray, np.ndarray]:
  """Prefills every slot, then times NEW_TOKENS greedy decode steps over all slots (each step's
  result copied to the host, as a server does). Returns (seconds, tokens, logprobs)."""
  params, state = engine.load_params(), engine.init_decode_state()
  for slot, p in enumerate(prompts):
    padded, n = engine.pad(p)
    state = engine.insert(engine.prefill(params=params, padded_tokens=padded, true_length=n),
                          state, slot)  # fmt: skip
  toks, lps = [], []
  t0 = time.perf_counter()
  for _ in range(NEW_TOKENS):
    state, res = engine.generate(params, state, max_length=PROMPT_LEN + NEW_TOKENS, mode="greedy")
    data = np.asarray(res.data)
    toks.append(data[:, 0])
    lps.append(result_logprobs(res))
  return time.perf_counter() - t0, np.stack(toks), np.stack(lps)


def main() -> None:
  cfg = presets.model_config(name="bench-30m")
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(100, cfg.vocab_size, PROMPT_LEN).tolist() for _ in range(SLOTS)]
  out = {"devices": f"{jax.device_count()} x {jax.devices()[0].platform}", "model": "bench-30m",
         "slots": SLOTS, "new_tokens": NEW_TOKENS}  # fmt: skip
  runs = {}
  for tensor in (1, TENSOR):
    ecfg = EngineConfig(max_slots=SLOTS, max_seq_len=MAX_SEQ, prefill_buckets=(32, 128),
                        mesh=ServingMeshConfig(tensor=tensor))  # fmt: skip
    engine = Engine.from_model(model, Tokenizer.qwen2(), ecfg)
    decode(engine, prompts)  # compile
    runs[tensor] = min((decode(engine, prompts) for _ in range(3)), key=lambda r: r[0])
    out[f"tensor{tensor}_tokens_per_s"] = round(SLOTS * NEW_TOKENS / runs[tensor][0], 1)
    print(f"tensor={tensor}: {out[f'tensor{tensor}_tokens_per_s']} tokens/s", flush=True)
  out["tensor4_over_tensor1"] = round(out["tensor4_tokens_per_s"] / out["tensor1_tokens_per_s"], 3)
  out["same_greedy_tokens"] = bool((runs[1][1] == runs[TENSOR][1]).all())
  out["max_logprob_diff"] = float(np.abs(runs[1][2] - runs[TENSOR][2]).max())
  print(json.dumps(out))


if __name__ == "__main__":
  main()
