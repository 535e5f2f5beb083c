"""The paged KV cache against the fixed-slot one (EngineConfig.kv_layout), one run, one JSON line.

  live_sequences_ratio: at equal KV memory, sequences decoding at once, paged over fixed, with
    the recipes' 32k maximum and a long-horizon trajectory-length distribution (a log-normal,
    LENGTHS below says where from): arithmetic on the allocator (pages.SlotPages fills a pool of
    the fixed layout's memory with sequences drawn from the distribution), confirmed by a real
    engine run at a small scale (max_seq_len 1,024, the distribution scaled by 1/32, a pool of
    4 fixed slots' memory; peak live sequences of each layout while 64 requests run);
  group_prompt_pages: pages held by a group of 16 sharing a 1,024-token prompt over 16 separate
    1,024-token prompts (real engine runs; the prompt held once is 1/16);
  decode_ratio_b32: decode tokens/s at batch 32, paged over fixed, the workload and model of
    benchmarks/decode.py's batch-32 row (qwen2-tiny, prompt 32, 64 new tokens, greedy with
    logprobs), REPS interleaved repetitions, median;
  longtail_ratio: continuous batching over static batching on decode.py's long-tail workload
    (its `longtail_workload`, the first LONGTAIL of its requests so the run fits ~12 minutes on
    2 cores), paged, beside the same figure for fixed (longtail_fixed_ratio), REPS interleaved
    repetitions, median.
Runs with no arguments; prints one JSON object as its last line.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))  # decode.py's workload code, beside this file

import decode as bench
import jax
from flax import nnx

from asearcher_jax.model import presets, transformer
from asearcher_jax.serving.driver import Driver
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.serving.pages import SlotPages
from asearcher_jax.tokenizer import Tokenizer

REPS = 3
LONGTAIL = 256  # requests of decode.py's long-tail workload run here (its first; it has 512)
MAX_LEN = 32768  # the recipes' maximum sequence
PAGE = 16
# Long-horizon trajectory lengths (prompt + every turn, tokens): a log-normal with median 1,024
# and p99 3,072. Where from: the long-horizon runs of docs/measurements.md ("Chains of 4 to 12
# hops") hit no token limit at 3,072 tokens over ~4,100 training trajectories (so p99 is put at
# it), and issue 57 reads "most trajectories end well below 4k"; the run directories keep no
# per-trajectory token counts, so the median is an assumption (a third of the maximum seen).
MEDIAN, P99 = 1024.0, 3072.0
SIGMA = float(np.log(P99 / MEDIAN) / 2.326)


def lengths(n: int, scale: float = 1.0, seed: int = 0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  x = np.exp(rng.normal(np.log(MEDIAN * scale), SIGMA, n))
  return np.clip(np.round(x), 1, MAX_LEN * scale).astype(int)


def live_by_arithmetic(fixed_slots: int = 64) -> dict:
  """Sequences a pool of `fixed_slots` x 32k tokens holds at once: fixed, one per slot; paged,
  drawn lengths mapped page by page until the pool is full (mean over 20 draws)."""
  pool = fixed_slots * MAX_LEN // PAGE + 1
  counts = []
  for seed in range(20):
    sp = SlotPages(
      slots=4096, num_pages=pool, page_size=PAGE, pages_per_seq=MAX_LEN // PAGE, reuse=False
    )
    n = 0
    for length in lengths(4096, seed=seed):
      if not sp.grow(n, int(length)):
        break
      n += 1
    counts.append(n)
  return {
    "fixed": fixed_slots,
    "paged": float(np.mean(counts)),
    "ratio": float(np.mean(counts)) / fixed_slots,
  }


def peak_live(engine: Engine, prompts, n_new) -> int:
  """Most requests decoding at once while `prompts` run through a driver on `engine`."""
  driver = Driver(engine)
  peak, done = [0], threading.Event()

  def watch():
    while not done.is_set():
      peak[0] = max(peak[0], sum(r is not None for r in driver._slots))
      time.sleep(0.002)

  async def go():
    return await asyncio.gather(
      *[
        driver.generate(p, bench.GREEDY, int(n), stop_token_ids=())
        for p, n in zip(prompts, n_new, strict=True)
      ]
    )

  t = threading.Thread(target=watch, daemon=True)
  t.start()
  asyncio.run(go())
  done.set()
  t.join()
  preempted = driver.stats()["preemptions"]
  driver.close()
  return peak[0], preempted


def live_by_engine(model, tok) -> dict:
  scale, max_len, fixed_slots = 1 / 32, 1024, 4
  total = lengths(64, scale=scale, seed=3)
  prompt_len = 16
  prompts = bench.make_prompts(64, seed=3)
  prompts = [p[:prompt_len] for p in prompts]
  n_new = np.maximum(total - prompt_len, 4)
  common = dict(max_seq_len=max_len, prefill_buckets=(16, 32), decode_rows=())
  fixed = Engine.from_model(model, tok, EngineConfig(max_slots=fixed_slots, **common))
  paged = Engine.from_model(
    model, tok,
    EngineConfig(max_slots=64, kv_layout="paged", page_size=PAGE,
                 num_pages=fixed_slots * max_len // PAGE + 1, **common),
  )  # fmt: skip
  f, _ = peak_live(fixed, prompts, n_new)
  p, preempted = peak_live(paged, prompts, n_new)
  return {"fixed": f, "paged": p, "ratio": p / f, "preemptions": preempted}


def group_pages(model, tok) -> dict:
  """Pages the prompt(s) hold after 16 requests of one shared 1,024-token prompt, and after 16
  of different ones (each request ends on its first token: what stays is the cached prompt)."""
  prompt_len, group = 1024, 16
  cfg = EngineConfig(
    max_slots=group, max_seq_len=2048, prefill_buckets=(1024,), kv_layout="paged",
    page_size=PAGE, num_pages=group * prompt_len // PAGE + 64, decode_rows=(),
  )  # fmt: skip
  out = {}
  rng = np.random.default_rng(5)
  for name, prompts in (
    ("shared", [rng.integers(100, bench.VOCAB, prompt_len).tolist()] * group),
    ("separate", [rng.integers(100, bench.VOCAB, prompt_len).tolist() for _ in range(group)]),
  ):
    driver = Driver(Engine.from_model(model, tok, cfg))

    async def go(d=driver, ps=prompts):
      return await asyncio.gather(*[d.generate(p, bench.GREEDY, 1, stop_token_ids=()) for p in ps])

    asyncio.run(go())
    out[name] = driver.stats()["pages_used"]
    driver.close()
  out["ratio"] = out["shared"] / out["separate"]
  return out


def build(model, tok, slots: int, layout: str) -> Engine:
  cfg = EngineConfig(
    max_slots=slots, max_seq_len=bench.MAX_SEQ, prefill_buckets=(32, 64, 128, 256),
    kv_layout=layout, page_size=PAGE,
  )  # fmt: skip
  engine = Engine.from_model(model, tok, cfg)  # compiled by an untimed pass (no full warm-up)
  if layout == "paged":  # static batching inserts straight into slots: give each its pages
    table = np.arange(1, slots * cfg.pages_per_seq + 1, dtype=np.int32).reshape(slots, -1)
    empty = engine.init_decode_state
    engine.init_decode_state = lambda: engine.set_page_table(empty(), table)
  return engine


def decode_b32(model, tok) -> dict:
  prompts = bench.make_prompts(32, seed=32)
  n = [bench.NEW_TOKENS] * 32
  engines = {layout: build(model, tok, 32, layout) for layout in ("fixed", "paged")}
  for e in engines.values():
    bench.tok_s(e, prompts, n, bench.GREEDY)  # one untimed pass each
  reps = []
  for _ in range(REPS):
    r = {k: bench.tok_s(e, prompts, n, bench.GREEDY) for k, e in engines.items()}
    r["ratio"] = r["paged"] / r["fixed"]
    reps.append(r)
  return {k: bench.spread([r[k] for r in reps]) for k in reps[0]}


def longtail(model, tok) -> dict:
  """Continuous batching (the driver) over static batching on decode.py's long-tail workload
  (its first LONGTAIL requests), 16 slots, fixed and paged; REPS repetitions interleaved (each
  repetition runs both schedules on both layouts back to back), each ratio per repetition."""
  prompts, n_new = bench.longtail_workload(LONGTAIL)
  engines = {layout: build(model, tok, 16, layout) for layout in ("fixed", "paged")}
  for engine in engines.values():  # untimed: compiles what both schedules use
    engine.warmup(extend=False, modes=("greedy",))  # every window and row count the driver hits
    bench.run_static(engine, prompts[:32], n_new[:32])
    bench.tok_s(engine, prompts[:32], n_new[:32], bench.GREEDY)
  reps = []
  for _ in range(REPS):
    r = {}
    for layout, engine in engines.items():
      d_s, d_tok, driver = bench.run_driver(engine, prompts, n_new)
      driver.close()
      s_s, s_tok = bench.run_static(engine, prompts, n_new)
      r[f"{layout}_driver_tok_s"] = d_tok / d_s
      r[f"{layout}_static_tok_s"] = s_tok / s_s
      r[f"{layout}_vs_static"] = (d_tok / d_s) / (s_tok / s_s)
    reps.append(r)
  out = {k: bench.spread([r[k] for r in reps]) for k in reps[0]}
  out.update(requests=len(prompts), length_min_max=[int(n_new.min()), int(n_new.max())])
  return out


def main() -> None:
  tok = Tokenizer.qwen2()
  cfg = presets.model_config(name="qwen2-tiny")
  bench.VOCAB = min(cfg.vocab_size, 20000)
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  arith = live_by_arithmetic()
  print(f"live sequences (arithmetic, 64 x 32k pool): {arith}", flush=True)
  real = live_by_engine(model, tok)
  print(f"live sequences (engine, 4 x 1k pool): {real}", flush=True)
  group = group_pages(model, tok)
  print(f"group of 16, 1,024-token prompt: {group}", flush=True)
  b32 = decode_b32(model, tok)
  print(f"decode batch 32: {b32}", flush=True)
  tail = longtail(model, tok)
  print(f"long tail: {tail}", flush=True)
  print(json.dumps({
    "device": jax.devices()[0].device_kind,
    "page_size": PAGE,
    "lengths": {"median": MEDIAN, "p99": P99, "sigma": round(SIGMA, 3), "max": MAX_LEN},
    "live_sequences_ratio": round(arith["ratio"], 2),
    "live_sequences": {"arithmetic": arith, "engine": real},
    "group_prompt_pages": round(group["ratio"], 4),
    "group_pages": group,
    "decode_ratio_b32": b32["ratio"]["median"],
    "decode_b32": b32,
    "longtail_ratio": tail["paged_vs_static"]["median"],
    "longtail_fixed_ratio": tail["fixed_vs_static"]["median"],
    "longtail_paged_at_least_fixed": tail["paged_vs_static"]["median"]
    >= tail["fixed_vs_static"]["median"],
    "longtail": tail,
  }))  # fmt: skip


if __name__ == "__main__":
  main()
