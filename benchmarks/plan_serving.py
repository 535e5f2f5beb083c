"""Is the planner's decode step right? `plan_memory.decode_step_s` against the engine, on this CPU.

The planner says a decode step costs max(bytes read / bandwidth, FLOPs / FLOP rate) + a call's
overhead, the bytes being the weights plus every live key and value (rl/plan_memory.py). Here
the same formula is given this CPU's own rates, measured by a calibration in the same run:
  weights    a jitted [1, 1024] x [1024, 4096] fp32 matmul: the rate a skinny matmul streams
             weights at (XLA:CPU's reaches ~1/3 of a plain sum's stream, so a sum would not do);
  KV reads   the engine's own attention (`attention.attend`) of one query a row over 16 x 4,096
             cached positions (134 MB): XLA:CPU transposes the keys and values before its matmuls, ~6x
             the bytes a paged kernel streams, so the KV rate is its own (on TPU both are the
             HBM bandwidth: `Rates.kv_bytes_s` None);
  FLOP rate  a jitted [256, 1024] x [1024, 1024] fp32 matmul;
  overhead   the same engine's step on a model of the same depth and negligible size (hidden
             32, vocabulary 512; batch 1, a few hundred positions): dispatch, the per-op cost of every
             layer's small ops, sampling and the host copy, with nothing to read;
and compared with the fixed-slot engine's measured step (benchmarks/decode.py's model family, a
small fp32 Qwen2 of ~5 M parameters, `Engine.generate` one step a call, every slot live, the
tokens copied to the host each step) at three (batch, context) points: one where the weights
dominate, one where the keys and values do, one between. The fixed engine attends over the
window bucket that holds its longest slot, so the planned context is that window. Target: the
planned step within 25 % of the measured one at every point. The last line is one JSON object.
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

from asearcher_jax.model import attention, transformer
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
STEPS = 10  # timed decode steps per repetition
REPS = 5
TARGET = 0.25
TINY: transformer.Transformer | None = None  # the overhead calibration's model (main builds it)
TOKENIZER: Tokenizer | None = None
OVERHEAD: Point | None = None  # the overhead calibration's engine


def _median_s(fn, reps: int) -> float:
  fn()  # compile / warm
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def calibrate() -> mem.Rates:
  """This CPU's rates as jitted JAX reaches them: weights streamed by a skinny matmul, cached
  keys and values read by the engine's attention (`attention.attend`, one query a row), the
  matmul FLOP rate, and the per-call overhead. Shapes differ from the checked points."""
  w = jnp.ones((1024, 4096), jnp.float32)  # 16 MB of weights
  x = jnp.ones((1, 1024), jnp.float32)
  gemv = jax.jit(jnp.dot)
  read_s = _median_s(lambda: gemv(x, w).block_until_ready(), 9)
  b, s, k, hd = 16, 4096, MODEL.num_kv_heads, MODEL.resolved_head_dim
  q = jnp.ones((b, 1, MODEL.num_heads, hd), jnp.float32)
  keys = jnp.ones((b, s, k, hd), jnp.float32)
  values = jnp.full((b, s, k, hd), 0.5, jnp.float32)
  mask = jnp.ones((b, 1, s), bool)
  attend = jax.jit(attention.attend)
  kv_s = _median_s(lambda: attend(q, keys, values, mask).block_until_ready(), 9)
  a = jnp.ones((256, 1024), jnp.float32)
  b = jnp.ones((1024, 1024), jnp.float32)
  mm = jax.jit(jnp.dot)
  mm_s = _median_s(lambda: mm(a, b).block_until_ready(), 7)
  call_s = OVERHEAD.time()
  return mem.Rates(bytes_s=w.nbytes / read_s, flops_s=2 * 256 * 1024 * 1024 / mm_s,
                   call_overhead_s=call_s, kv_bytes_s=2 * keys.nbytes / kv_s)  # fmt: skip


class Point:
  """One (batch, window) engine, prefilled once: every slot holds window - 2 x STEPS x REPS
  positions, so all repetitions' steps stay inside the window; `time()` runs STEPS steps."""

  def __init__(self, model: transformer.Transformer, batch: int, window: int):
    # One bucket: the prefill pads to the window and every step attends over all of it.
    cfg = EngineConfig(max_slots=batch, max_seq_len=window, prefill_buckets=(window,))
    self.engine = Engine.from_model(model, TOKENIZER, cfg)
    self.window = window
    self.params = self.engine.load_params()
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, model.cfg.vocab_size, window - 2 * STEPS * (REPS + 1))
    padded, n = self.engine.pad(prompt.tolist())
    prefix = self.engine.prefill(params=self.params, padded_tokens=padded, true_length=n)
    self.state = self.engine.init_decode_state()
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


def main() -> None:
  global TINY, TOKENIZER, OVERHEAD
  TOKENIZER = Tokenizer.qwen2()
  TINY = transformer.Transformer(
    MODEL.replace(vocab_size=512, hidden_size=32, intermediate_size=64, head_dim=8),
    rngs=nnx.Rngs(1),
  )
  model = transformer.Transformer(MODEL, rngs=nnx.Rngs(0))
  OVERHEAD = Point(TINY, 1, 2 * STEPS * (REPS + 1) + 64)
  engines = {(b, w): Point(model, b, w) for b, w in POINTS}
  measured = {p: [] for p in POINTS}
  rates = []
  for _ in range(REPS):  # interleaved: calibration and every point once per repetition
    rates.append(calibrate())
    for point, engine in engines.items():
      measured[point].append(engine.time())
  r = mem.Rates(
    bytes_s=float(np.median([x.bytes_s for x in rates])),
    flops_s=float(np.median([x.flops_s for x in rates])),
    call_overhead_s=float(np.median([x.call_overhead_s for x in rates])),
    kv_bytes_s=float(np.median([x.kv_bytes_s for x in rates])),
  )
  points = []
  for batch, window in POINTS:
    planned = mem.decode_step_s(MODEL, batch=batch, context=window, rates=r, chips=1)
    got = float(np.median(measured[(batch, window)]))
    points.append({
      "batch": batch, "context": window,
      "planned_ms": round(planned * 1e3, 3), "measured_ms": round(got * 1e3, 3),
      "ratio": round(planned / got, 3),
      "kv_mb_read": round(batch * window * mem.kv_bytes_per_token(MODEL, 1, "float32") / 1e6, 1),
    })  # fmt: skip
    print(f"batch {batch}, context {window}: planned {planned * 1e3:.2f} ms, measured "
          f"{got * 1e3:.2f} ms (ratio {planned / got:.2f})", flush=True)  # fmt: skip
  print(json.dumps({
    "benchmark": "plan_serving",
    "model_params_m": round(MODEL.num_params() / 1e6, 2),
    "cpu_weights_gb_s": round(r.bytes_s / 1e9, 2),
    "cpu_kv_gb_s": round(r.kv_bytes_s / 1e9, 2),
    "cpu_gflops": round(r.flops_s / 1e9, 1),
    "cpu_call_overhead_ms": round(r.call_overhead_s * 1e3, 3),
    "points": points,
    "within_25pct": all(abs(p["ratio"] - 1) <= TARGET for p in points),
    "machine": "2 CPU cores shared with other jobs",
  }))  # fmt: skip


if __name__ == "__main__":
  main()
