"""Is the planner's decode step right? `plan_memory.decode_step_s` against the engine, on this CPU.

The planner says a decode step costs max(bytes read / bandwidth, FLOPs / FLOP rate) + a call's
overhead, the bytes being the weights plus every live key and value (rl/plan_memory.py). Here
the same formula is given this CPU's own rates, calibrated in the same run on measurements that
are NOT the checked points, then asked to predict them:
  overhead   the same engine's step on a model of the same depth and negligible size (hidden
             32, vocabulary 512; batch 1, a few hundred positions): dispatch, the per-op cost of
             every layer's small ops, sampling and the host copy, with nothing to read;
  weights,   the engine's own step on the checked model at two calibration points, CALIB: one
  KV reads   weights-bound (batch 4, 256 positions: 4 MB of keys and values against 21 MB of
             weights), one KV-bound (batch 12, 6,144 positions: 302 MB); less the overhead, the
             two steps give the two unknowns of weights / bytes_s + KV bytes / kv_bytes_s. A
             standalone `attention.attend` read the keys and values ~1.75x slower than the same
             function inside the engine (docs/measurements.md), so the engine calibrates itself;
             on TPU both rates are the HBM bandwidth (`Rates.kv_bytes_s` None);
  FLOP rate  a jitted [256, 1024] x [1024, 1024] fp32 matmul (no point here is compute-bound).
Measured: the engine (benchmarks/decode.py's model family, a small fp32 Qwen2 of ~5 M
parameters, `Engine.generate` one step a call, every slot live, the tokens copied to the host
each step) at three (batch, context) points: one where the weights dominate, one where the keys
and values do, one between. Both KV layouts run, each calibrated on its own steps: "paged" (the
engine the planner models; its figures are the headline) and "fixed" beside it. Each attends
over the window bucket that holds its longest slot, so the planned context is that window.
Target: the planned step within 25 % of the measured one at every point. The last line is one
JSON object.
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

from asearcher_jax.model import transformer
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.rl import plan_memory as mem
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.tokenizer import Tokenizer

MODEL = ModelConfig(
  vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
  num_kv_heads=2, head_dim=64, tie_word_embeddings=True,
)  # fmt: skip
# (batch, context window): weights-bound, between, KV-bound; every working set past the CPU's
# caches (XLA:CPU reads a cache-resident KV several times faster: a linear model cannot span both).
POINTS = ((1, 128), (16, 2048), (32, 4096))
# The calibration's engine steps, none of them a checked point: weights-bound, KV-bound.
CALIB = ((4, 256), (12, 6144))
LAYOUTS = ("paged", "fixed")  # paged first: the engine the planner models
PAGE = 16  # positions per page of the paged engine
STEPS = 12  # timed decode steps per repetition
REPS = 7
TARGET = 0.25
HEADROOM = STEPS * (REPS + 1) + 8  # positions left free after the prompt: every step fits
KV_DTYPE = "float32"  # the engine's cache here (the model's dtype)
TOKENIZER: Tokenizer | None = None


def _median_s(fn, reps: int) -> float:
  fn()  # compile / warm
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def matmul_flops_s() -> float:
  """The FLOP rate of a jitted [256, 1024] x [1024, 1024] fp32 matmul."""
  a = jnp.ones((256, 1024), jnp.float32)
  b = jnp.ones((1024, 1024), jnp.float32)
  mm = jax.jit(jnp.dot)
  return 2 * 256 * 1024 * 1024 / _median_s(lambda: mm(a, b).block_until_ready(), 7)


def kv_bytes(batch: int, context: int) -> float:
  return batch * context * mem.kv_bytes_per_token(MODEL, 1, KV_DTYPE)


def fit_rates(overhead_s: float, calib_s: dict, flops_s: float) -> mem.Rates:
  """The weights and KV rates from the two calibration steps (less the call overhead):
  t - overhead = weights / bytes_s + kv / kv_bytes_s at each, two equations, two unknowns."""
  (lo, t_lo), (hi, t_hi) = sorted(calib_s.items(), key=lambda kv: kv_bytes(*kv[0]))
  per_kv = (t_hi - t_lo) / (kv_bytes(*hi) - kv_bytes(*lo))  # seconds per KV byte
  weights = MODEL.num_params() * 4
  per_weight = (t_lo - overhead_s - kv_bytes(*lo) * per_kv) / weights
  # A noisy run can leave nothing for the weights: floor them at 200 GB/s (not a fit, flagged).
  return mem.Rates(
    bytes_s=1 / max(per_weight, 1 / 200e9), flops_s=flops_s, call_overhead_s=overhead_s,
    kv_bytes_s=1 / max(per_kv, 1e-12),
  )  # fmt: skip


class Point:
  """One (batch, window) engine of `layout`, prefilled once: every slot holds window - HEADROOM
  positions, so all repetitions' steps stay inside the window; `time()`
  runs STEPS steps. The paged engine's slots each get their own pages (no sharing: every slot
  reads its own keys and values, as the fixed one does)."""

  def __init__(self, model: transformer.Transformer, batch: int, window: int, layout: str):
    # One bucket: the prefill pads to the window and every step attends over all of it.
    cfg = EngineConfig(
      max_slots=batch, max_seq_len=window, prefill_buckets=(window,), kv_layout=layout,
      page_size=PAGE, decode_rows=(),
    )  # fmt: skip
    self.engine = Engine.from_model(model, TOKENIZER, cfg)
    self.window = window
    self.params = self.engine.load_params()
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, model.cfg.vocab_size, window - HEADROOM)
    padded, n = self.engine.pad(prompt.tolist())
    prefix = self.engine.prefill(params=self.params, padded_tokens=padded, true_length=n)
    self.state = self.engine.init_decode_state()
    if layout == "paged":
      table = np.arange(1, batch * cfg.pages_per_seq + 1, dtype=np.int32).reshape(batch, -1)
      self.state = self.engine.set_page_table(self.state, table)
    for slot in range(batch):
      self.state = self.engine.insert(prefix, self.state, slot)
    self.longest = n
    self._step()  # compile

  def _step(self) -> None:
    self.longest += 1
    assert self.engine.bucket_for(self.longest) == self.window, (self.longest, self.window)
    self.state, res = self.engine.generate(
      self.params, self.state, max_length=self.longest, mode="greedy"
    )
    np.asarray(res.data)  # the host copy a server needs every step

  def time(self) -> float:
    """Median seconds of one step over STEPS steps."""
    times = []
    for _ in range(STEPS):
      t = time.perf_counter()
      self._step()
      times.append(time.perf_counter() - t)
    return float(np.median(times))


def check(layout: str, times: dict, flops_s: float) -> dict:
  """One layout's calibration (its own overhead and calibration steps) and its three points."""
  med = {k: float(np.median(v)) for k, v in times.items()}
  r = fit_rates(med["overhead"], {c: med[c] for c in CALIB}, flops_s)
  points = []
  for batch, window in POINTS:
    planned = mem.decode_step_s(
      MODEL, batch=batch, context=window, rates=r, chips=1, kv_dtype=KV_DTYPE
    )
    got = med[(batch, window)]
    points.append({
      "batch": batch, "context": window,
      "planned_ms": round(planned * 1e3, 3), "measured_ms": round(got * 1e3, 3),
      "ratio": round(planned / got, 3), "kv_mb_read": round(kv_bytes(batch, window) / 1e6, 1),
    })  # fmt: skip
    print(f"{layout}: batch {batch}, context {window}: planned {planned * 1e3:.2f} ms, measured "
          f"{got * 1e3:.2f} ms (ratio {planned / got:.2f})", flush=True)  # fmt: skip
  return {
    "cpu_weights_gb_s": round(r.bytes_s / 1e9, 2),
    "cpu_kv_gb_s": round(r.kv_bytes_s / 1e9, 2),
    "cpu_gflops": round(r.flops_s / 1e9, 1),
    "cpu_call_overhead_ms": round(r.call_overhead_s * 1e3, 3),
    "calibration_ms": {f"{b}x{c}": round(med[(b, c)] * 1e3, 3) for b, c in CALIB},
    "points": points,
    "all_within_25pct": all(abs(p["ratio"] - 1) <= TARGET for p in points),
  }


def main() -> None:
  global TOKENIZER
  t0 = time.perf_counter()
  TOKENIZER = Tokenizer.qwen2()
  tiny = transformer.Transformer(
    MODEL.replace(vocab_size=512, hidden_size=32, intermediate_size=64, head_dim=8),
    rngs=nnx.Rngs(1),
  )
  model = transformer.Transformer(MODEL, rngs=nnx.Rngs(0))
  engines = {}
  for layout in LAYOUTS:
    tiny_window = -(-(HEADROOM + 64) // PAGE) * PAGE  # a multiple of PAGE
    engines[(layout, "overhead")] = Point(tiny, 1, tiny_window, layout)
    for b, w in CALIB + POINTS:
      engines[(layout, (b, w))] = Point(model, b, w, layout)
  times = {k: [] for k in engines}
  flops = []
  for _ in range(REPS):  # interleaved: every calibration and every point once per repetition
    flops.append(matmul_flops_s())
    for key, engine in engines.items():
      times[key].append(engine.time())
  flops_s = float(np.median(flops))
  out = {
    layout: check(layout, {k[1]: v for k, v in times.items() if k[0] == layout}, flops_s)
    for layout in LAYOUTS
  }
  paged = out["paged"]
  print(json.dumps({
    "benchmark": "plan_serving",
    "model_params_m": round(MODEL.num_params() / 1e6, 2),
    "measured_layout": "paged",
    "calibration_points": [list(c) for c in CALIB],
    **paged,
    "fixed": out["fixed"],
    "reps": REPS, "steps": STEPS,
    "wall_s": round(time.perf_counter() - t0, 1),
    "machine": "2 CPU cores shared with other jobs",
  }))  # fmt: skip


if __name__ == "__main__":
  main()
