"""PPO learner step time on the shipped SynthWiki warm start: row length and the fused proximal
pass, side by side in one run (no arguments; ~1-2 minutes on 2 CPU cores).

Each configuration trains the same 8,192 token cells (random tokens, ~10 % loss tokens, 4-row
micro-batches as in the quickstart): 4 rows of 2,048 tokens with the separate pi_prox scoring
pass (the quickstart before `PPOConfig.short_row_lens` / `fused_prox`), 8 rows of 1,024 tokens
with the separate pass, and 8 rows of 1,024 with pi_prox fused into the step. Reported: median
seconds per learner step (scoring + optimizer step) over 3 timed steps after one compile step,
and the ratios to the first. The last line is one JSON object.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax
import jax.numpy as jnp
from flax import nnx

from asearcher_jax.apps.quickstart import DEFAULT_WARM_START
from asearcher_jax.model import hf_io, steps
from asearcher_jax.rl.learner import Learner, PPOConfig

CELLS = 8192
CONFIGS = {"rows2048_separate": (2048, False), "rows1024_separate": (1024, False),
           "rows1024_fused": (1024, True)}  # fmt: skip


def step_seconds(graphdef, params, row_len: int, fused: bool, repeats: int = 3) -> float:
  rows = CELLS // row_len
  learner = Learner(
    graphdef, jax.tree.map(jnp.copy, params),
    ppo=PPOConfig(row_len=row_len, micro_rows=4, fused_prox=fused),
    optimizer=steps.OptimizerConfig(learning_rate=1e-4),
  )  # fmt: skip
  rng = np.random.default_rng(0)
  shape = (rows, row_len)
  batch = jax.device_put({
    "tokens": rng.integers(1, 1700, shape).astype(np.int32),
    "positions": np.tile(np.arange(row_len, dtype=np.int32), (rows, 1)),
    "segment_ids": np.ones(shape, np.int32),
    "loss_mask": (rng.random(shape) < 0.1).astype(np.float32),
    "logprobs": np.full(shape, -1.0, np.float32),
    "advantages": rng.normal(size=shape).astype(np.float32),
    "fresh_mask": np.ones(shape, np.float32),
  })  # fmt: skip
  times = []
  for _ in range(repeats + 1):  # the first includes compilation
    t0 = time.perf_counter()
    b = dict(batch)
    b["prox_logprobs"] = learner.compute_prox_logprobs(b) if not fused else b["logprobs"]
    learner.state, m = learner._train(learner.state, b)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  return float(np.median(times[1:]))


def main() -> dict:
  model, _ = hf_io.load(str(DEFAULT_WARM_START))
  graphdef, params = nnx.split(model)
  secs = {name: step_seconds(graphdef, params, n, f) for name, (n, f) in CONFIGS.items()}
  base = secs["rows2048_separate"]
  result = {
    "cells": CELLS,
    "seconds": {k: round(v, 3) for k, v in secs.items()},
    "speedup_rows1024": round(base / secs["rows1024_separate"], 3),
    "speedup_rows1024_fused": round(base / secs["rows1024_fused"], 3),
    "platform": jax.devices()[0].platform,
  }
  print(json.dumps(result), flush=True)
  return result


if __name__ == "__main__":
  main()
