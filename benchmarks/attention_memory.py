"""Compiled temporary memory of the learner's train step: dense attention against flash.

Runs with no arguments, on XLA:CPU, compiling only (nothing executes: dense at 32k tokens would
need tens of GB). A tiny decoder (2 layers, hidden 64, 4 query / 2 key heads) and the train step
the learner compiles (`steps.compile_train_step` with `nll_loss`, AdamW) over one packed row of
2k, 8k and 32k tokens (four segments each); for each length and attention kind it reports XLA's
`memory_analysis().temp_size_in_bytes` and the compile time. Dense keeps a [T, T] mask and each
query block's fp32 scores for the backward pass (quadratic in T); flash keeps the output and a
logsumexp per row and recomputes scores block by block (linear). The ratios 32k / 2k are the
figures of merit: ~256 for quadratic growth, ~16 for linear. The last line is one JSON object.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from asearcher_jax.model import steps, transformer
from asearcher_jax.model.config import ModelConfig

LENGTHS = {"2k": 2048, "8k": 8192, "32k": 32768}
KINDS = ("dense", "flash")


def tiny_config(attention: str) -> ModelConfig:
  # A small vocabulary, so the [T, V] logits do not hide attention's share of the memory.
  return ModelConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, rope_theta=10000.0, attention=attention,
  )  # fmt: skip


def compiled_temp_bytes(attention: str, seq_len: int) -> dict:
  """Lowers and compiles the train step for one row of `seq_len` tokens (abstract inputs)."""
  cfg = tiny_config(attention)
  graphdef, params = nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(0)))
  opt = steps.make_optimizer(steps.OptimizerConfig(learning_rate=1e-4))
  state = steps.init_train_state(params, opt)  # tiny: concrete is simplest
  row = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
  batch = {"tokens": row, "positions": row, "segment_ids": row,
           "loss_mask": jax.ShapeDtypeStruct((1, seq_len), jnp.float32)}  # fmt: skip
  step = steps.compile_train_step(graphdef, opt, steps.nll_loss, state)
  t0 = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  secs = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  return {"temp_bytes": int(mem.temp_size_in_bytes), "compile_s": round(secs, 2)}


def main() -> None:
  results: dict = {"device": jax.devices()[0].device_kind, "model": "2 layers, d=64, 4q/2kv heads"}
  for kind in KINDS:
    for name, seq_len in LENGTHS.items():
      r = compiled_temp_bytes(kind, seq_len)
      print(f"{kind:>6} {name:>4}: {r}", flush=True)
      results[f"{kind}_temp_gb_{name}"] = round(r["temp_bytes"] / 1e9, 4)
      results[f"{kind}_compile_s_{name}"] = r["compile_s"]
  for kind in KINDS:
    ratio = results[f"{kind}_temp_gb_32k"] / results[f"{kind}_temp_gb_2k"]
    results[f"{kind}_ratio_32k_over_2k"] = round(ratio, 1)
  results["flash_target_met"] = results["flash_ratio_32k_over_2k"] <= 20
  print(json.dumps(results))


if __name__ == "__main__":
  main()
