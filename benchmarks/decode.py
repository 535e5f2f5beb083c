"""Decode throughput: our continuous-batching driver vs transformers `generate` vs static batching.

Runs with no arguments, on the same random qwen2-tiny weights (real Qwen vocabulary) and prompts:
  (i)   our RL driver (continuous batching; batch = concurrent requests = slots), with the new
        engine settings (`NEW`: several decode steps per call) and, at batch 32 and in the long
        tail, the old ones (`OLD`: one step per call) side by side,
  (ii)  Hugging Face transformers `generate` (PyTorch, greedy, same weights via hf_io.save, same
        dtype; on the GPU when JAX runs on one and torch sees it, else on the CPU: like for like),
  (iii) our engine with static batching (a batch is admitted together and runs until its longest
        member finishes; same engine settings as the driver),
at batch 1, 8 and 32 with fixed output lengths, plus a long-tail workload (output lengths from a
log-normal clipped to a 100x spread) where continuous batching refills slots as requests finish.
Also the cost of a weight update (swap + re-prefill of every in-flight slot). Every figure is
measured REPS times, the repetitions interleaved (rep 1 of every contender, then rep 2, ...), and
reported as median with min and max; a ratio is taken per repetition (both sides run back to
back) and summarised the same way. Prints one JSON object as its last line.

Logprobs, like for like: plain `generate` computes none, so the batch rows compare it with our
driver asked for none (`SamplingParams(logprobs=False)`: `vs_transformers`), and `generate` with a
logits processor that records each greedy token's log-softmax with our driver computing logprobs
(`vs_transformers_logprobs`). Static batching runs without logprobs; the long-tail workload and
the weight update run with them, as RL does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax
import jax.numpy as jnp
from flax import nnx

from asearcher_jax import compile_cache
from asearcher_jax.model import hf_io, presets, transformer
from asearcher_jax.serving.driver import Driver
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.serving.types import SamplingParams
from asearcher_jax.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0.0)
GREEDY_NO_LOGPROBS = SamplingParams(temperature=0.0, logprobs=False)
PROMPT_LEN = 32
NEW_TOKENS = 64
MAX_SEQ = 512
REPS = 3
# Engine settings compared: decode steps per generate call (EngineConfig.decode_steps_per_call).
NEW, OLD = 8, 1


VOCAB = 8192
LONGTAIL_REQUESTS = 512  # the long-tail workload's requests


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(100, VOCAB, PROMPT_LEN).tolist() for _ in range(n)]


def longtail_workload(n: int = LONGTAIL_REQUESTS) -> tuple[list[list[int]], np.ndarray]:
  """The long-tail workload's first `n` requests: prompts, and output lengths from a log-normal
  (median 20) clipped to [4, 400], a 100x spread (benchmarks/paged_kv.py runs a prefix of it)."""
  rng = np.random.default_rng(1)
  lengths = np.clip(np.round(np.exp(rng.normal(np.log(20), 1.2, LONGTAIL_REQUESTS))), 4, 400)
  return make_prompts(LONGTAIL_REQUESTS, seed=7)[:n], lengths.astype(int)[:n]


LOOP = "while"  # the new settings' EngineConfig.decode_loop (--decode-loop)
# The new settings' EngineConfig.decode_rows (--decode-rows); None: the engine's default.
ROWS: tuple[int, ...] | None = None


def build_engine(model, tok, slots: int, steps: int = NEW) -> Engine:
  rows = {"decode_rows": ROWS} if steps == NEW and ROWS is not None else {}
  cfg = EngineConfig(max_slots=slots, max_seq_len=MAX_SEQ, prefill_buckets=(32, 64, 128, 256),
                     decode_steps_per_call=steps, decode_loop=LOOP, **rows)  # fmt: skip
  return Engine.from_model(model, tok, cfg)


def warm(engine: Engine) -> None:
  engine.warmup(extend=False)  # random prompts: no prefix ever matches, no suffix prefill runs


def spread(values) -> dict:
  """Median, min and max of a figure's repetitions."""
  v = [float(x) for x in values]
  return {"median": round(float(np.median(v)), 2), "min": round(min(v), 2), "max": round(max(v), 2)}


def run_driver(
  engine: Engine, prompts, lengths, sampling: SamplingParams = GREEDY
) -> tuple[float, int, Driver]:
  driver = Driver(engine)

  async def go():
    return await asyncio.gather(
      *[
        driver.generate(p, sampling, int(n), stop_token_ids=())
        for p, n in zip(prompts, lengths, strict=True)
      ]
    )

  t = time.perf_counter()
  results = asyncio.run(go())
  secs = time.perf_counter() - t
  return secs, sum(len(r.tokens) for r in results), driver


def tok_s(engine: Engine, prompts, lengths, sampling: SamplingParams) -> float:
  secs, n, driver = run_driver(engine, prompts, lengths, sampling)
  driver.close()
  return n / secs


def run_static(engine: Engine, prompts, lengths, mode: str = "greedy") -> tuple[float, int]:
  """Static batching on the same engine: admit `slots` requests, decode until the longest ends
  (in calls of the engine's decode_steps_per_call steps, as the driver does). mode: "greedy"
  computes logprobs, "argmax" does not."""
  params = engine.load_params()
  slots = engine.max_concurrent_decodes
  k = engine.cfg.decode_steps_per_call
  total = 0
  t = time.perf_counter()
  for i in range(0, len(prompts), slots):
    batch, want = prompts[i : i + slots], lengths[i : i + slots]
    state = engine.init_decode_state()
    for slot, p in enumerate(batch):
      padded, n = engine.pad(p)
      state = engine.insert(
        engine.prefill(params=params, padded_tokens=padded, true_length=n), state, slot
      )
    done = 1  # the prefill produced each request's first token
    while done < max(want):
      # The same fast paths the driver uses: greedy sampler, attention window of the longest row.
      longest = max(len(p) for p in batch) + done
      if k > 1:
        n = min(k, max(want) - done)
        state, res, _ = engine.generate_chunk(
          params, state, range(len(batch)), [n] * len(batch), [()] * len(batch),
          max_length=longest + n - 1, mode=mode,
        )  # fmt: skip
        np.asarray(res)  # the host copy a server needs every call
      else:
        n = 1
        state, res = engine.generate(params, state, max_length=longest, mode=mode)
        np.asarray(res.data)
      done += n
    total += sum(int(w) for w in want)
  return time.perf_counter() - t, total


def torch_device() -> str:
  """Where transformers runs: the accelerator JAX uses, if torch sees one too (like for like)."""
  import torch

  return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def run_transformers(
  hf_dir: str, prompts, n_new: int, batch: int, logprobs: bool = False, dtype: str = "float32"
) -> tuple[float, int]:
  import torch
  import transformers

  class RecordLogprobs(transformers.LogitsProcessor):
    """Each step's greedy-token logprob, log_softmax(scores).max() = max - logsumexp: what our
    engine reports per token. Returns the scores untouched."""

    def __init__(self):
      self.steps = []

    def __call__(self, input_ids, scores):
      self.steps.append(scores.max(-1).values - torch.logsumexp(scores, -1))
      return scores

  torch.set_num_threads(os.cpu_count() or 1)
  device = torch_device()
  model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype))
  model = model.to(device).eval()
  total = 0
  t = None
  for i in range(0, len(prompts), batch):
    ids = torch.tensor(prompts[i : i + batch], device=device)
    extra = {"logits_processor": [RecordLogprobs()]} if logprobs else {}
    if t is None:  # warm-up on the first batch
      with torch.no_grad():
        model.generate(
          ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, **extra
        )
      t = time.perf_counter()
    with torch.no_grad():
      out = model.generate(
        ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, pad_token_id=0,
        attention_mask=torch.ones_like(ids), **extra,
      )  # fmt: skip
    out.cpu()  # the tokens on the host, as our driver returns them
    total += (out.shape[1] - ids.shape[1]) * ids.shape[0]
  return time.perf_counter() - t, total


def main() -> None:
  compile_cache.enable_if_asked()  # $ASEARCHER_COMPILE_CACHE: reuse an earlier run's compiles
  tok = Tokenizer.qwen2()
  global VOCAB, LOOP, ROWS, NEW_TOKENS
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("model", nargs="?", default="qwen2-tiny", help="model preset")
  parser.add_argument(
    "--dtype", choices=("float32", "bfloat16"), default="float32",
    help="engine weights and activations (bfloat16: what an accelerator serves)",
  )  # fmt: skip
  parser.add_argument(
    "--batches", default="1,8,32",
    help="batch sizes of the fixed-length rows, comma-separated (the issue's bars need 32)",
  )  # fmt: skip
  parser.add_argument(
    "--decode-loop", choices=("while", "fixed", "unrolled"), default=LOOP,
    help="the new settings' device loop (EngineConfig.decode_loop; the old ones run one step)",
  )  # fmt: skip
  parser.add_argument(
    "--decode-rows", default=None,
    help="the new settings' decode-step sizes below the slot count, comma-separated "
    "(EngineConfig.decode_rows; default: the engine's)",
  )  # fmt: skip
  parser.add_argument(
    "--new-tokens", type=int, default=NEW_TOKENS,
    help=f"output length of the fixed-length rows (default {NEW_TOKENS}; a reasoning agent's "
    f"turns are often hundreds of tokens, where several steps per call pay more; "
    f"at most {MAX_SEQ - PROMPT_LEN})",
  )  # fmt: skip
  args = parser.parse_args()
  if not 1 <= args.new_tokens <= MAX_SEQ - PROMPT_LEN:
    parser.error(f"--new-tokens must be in [1, {MAX_SEQ - PROMPT_LEN}], got {args.new_tokens}")
  NEW_TOKENS = args.new_tokens
  LOOP = args.decode_loop
  if args.decode_rows is not None:
    try:
      ROWS = tuple(int(r) for r in args.decode_rows.split(",") if r.strip())
    except ValueError:
      parser.error(f"--decode-rows must be integers separated by commas, got {args.decode_rows!r}")
  batches = tuple(int(b) for b in args.batches.split(",") if b.strip())
  if 32 not in batches:
    parser.error("--batches must include 32 (the summary figures are batch 32's)")
  name = args.model
  cfg = presets.model_config(name=name, param_dtype=args.dtype, dtype=args.dtype)
  VOCAB = min(cfg.vocab_size, 20000)
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  hf_dir = tempfile.mkdtemp(prefix="decode_bench_")
  hf_io.save(model, hf_dir)
  print(f"model: {name} ({cfg.num_params() / 1e6:.1f}M params), prompt {PROMPT_LEN}, "
        f"new tokens {NEW_TOKENS}, {args.dtype}, jax on {jax.devices()[0].device_kind}, "
        f"decode steps per call new {NEW} / old {OLD}, {REPS} interleaved repetitions, "
        f"transformers on {torch_device()}", flush=True)  # fmt: skip
  out: dict = {}
  for batch in batches:
    prompts = make_prompts(max(batch, 8) if batch > 1 else 4, seed=batch)
    prompts = prompts[: (len(prompts) // batch) * batch]
    lengths = [NEW_TOKENS] * len(prompts)
    engine = build_engine(model, tok, batch)
    warm(engine)
    old = None
    if batch == 32:
      old = build_engine(model, tok, batch, OLD)
      warm(old)
    # One untimed pass of each of our paths first, as transformers gets one (its first batch):
    # the first pass through a fresh driver runs slower (2,080 vs 2,280 tok/s at batch 32 here).
    for e in (engine, old) if old else (engine,):
      for sampling in (GREEDY_NO_LOGPROBS, GREEDY):
        tok_s(e, prompts, lengths, sampling)
    run_static(engine, prompts, lengths, "argmax")
    reps = []
    for _ in range(REPS):
      r = {
        "driver_tok_s": tok_s(engine, prompts, lengths, GREEDY_NO_LOGPROBS),
        "driver_logprobs_tok_s": tok_s(engine, prompts, lengths, GREEDY),
      }
      if old is not None:
        r["old_driver_tok_s"] = tok_s(old, prompts, lengths, GREEDY_NO_LOGPROBS)
        r["old_driver_logprobs_tok_s"] = tok_s(old, prompts, lengths, GREEDY)
        r["new_vs_old"] = r["driver_tok_s"] / r["old_driver_tok_s"]
        r["new_vs_old_logprobs"] = r["driver_logprobs_tok_s"] / r["old_driver_logprobs_tok_s"]
      s_s, s_tok = run_static(engine, prompts, lengths, "argmax")
      h_s, h_tok = run_transformers(hf_dir, prompts, NEW_TOKENS, batch, dtype=args.dtype)
      hl_s, hl_tok = run_transformers(
        hf_dir, prompts, NEW_TOKENS, batch, logprobs=True, dtype=args.dtype
      )
      r["static_tok_s"] = s_tok / s_s
      r["transformers_tok_s"] = h_tok / h_s
      r["transformers_logprobs_tok_s"] = hl_tok / hl_s
      r["vs_transformers"] = r["driver_tok_s"] / r["transformers_tok_s"]
      r["vs_transformers_logprobs"] = r["driver_logprobs_tok_s"] / r["transformers_logprobs_tok_s"]
      reps.append(r)
    row = {key: spread([r[key] for r in reps]) for key in reps[0]}
    out[f"b{batch}"] = row
    print(f"batch {batch:>2}: " + ", ".join(f"{k} {v['median']} [{v['min']}, {v['max']}]"
                                           for k, v in row.items()), flush=True)  # fmt: skip

  # Long tail: 512 requests (an RL batch is many times the slot count), lengths log-normal,
  # clipped to [4, 400] (a 100x spread), 16 slots. With few requests per slot the single longest
  # request bounds both schedules (128 requests gave 1.94x).
  prompts, lengths = longtail_workload()
  engine, old = build_engine(model, tok, 16), build_engine(model, tok, 16, OLD)
  warm(engine)
  warm(old)
  reps = []
  for _ in range(REPS):
    d_s, d_tok, driver = run_driver(engine, prompts, lengths)
    driver.close()
    o_s, o_tok, old_driver = run_driver(old, prompts, lengths)
    old_driver.close()
    s_s, s_tok = run_static(engine, prompts, lengths)
    r = {"driver_tok_s": d_tok / d_s, "old_driver_tok_s": o_tok / o_s, "static_tok_s": s_tok / s_s}
    r["vs_static"] = r["driver_tok_s"] / r["static_tok_s"]
    r["new_vs_old"] = r["driver_tok_s"] / r["old_driver_tok_s"]
    reps.append(r)
  longtail = {key: spread([r[key] for r in reps]) for key in reps[0]}
  longtail.update(length_min_max=[int(lengths.min()), int(lengths.max())], requests=len(lengths))
  print(f"long tail: {longtail}", flush=True)

  # Weight update cost with every slot in flight (new engine settings).
  driver = Driver(engine)

  async def update_under_load():
    tasks = [
      asyncio.create_task(driver.generate(p, GREEDY, 300, stop_token_ids=()))
      for p in make_prompts(16, seed=9)
    ]
    while driver.stats()["slots_active"] < 16:
      await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    new = nnx.state(transformer.Transformer(cfg, rngs=nnx.Rngs(1)))
    new = jax.tree.map(jnp.asarray, new)
    ms = [await asyncio.to_thread(driver.update_params, new, v) for v in range(1, REPS + 1)]
    for t in tasks:
      t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return ms

  update_ms = asyncio.run(update_under_load())
  driver.close()
  print(f"weight update with 16 in-flight slots: {[round(m, 1) for m in update_ms]} ms", flush=True)
  b32 = out["b32"]
  result = {
    "device": jax.devices()[0].device_kind,
    "dtype": args.dtype,
    "transformers_device": torch_device(),
    "decode_steps_per_call": {"new": NEW, "old": OLD},
    "decode_loop": LOOP,
    "decode_rows_new": list(ROWS) if ROWS is not None else list(EngineConfig().decode_rows),
    "reps": REPS,
    "new_tokens": NEW_TOKENS,
    "vs_transformers_b32": b32["vs_transformers"]["median"],
    "vs_transformers_b32_logprobs": b32["vs_transformers_logprobs"]["median"],
    "vs_static_longtail": longtail["vs_static"]["median"],
    "new_vs_old_b32": b32["new_vs_old"]["median"],
    "new_vs_old_b32_logprobs": b32["new_vs_old_logprobs"]["median"],
    # The engine's own default (EngineConfig.decode_steps_per_call) and whether it is the faster
    # of the two settings at batch 32 here: the CPU default is one step per call because the
    # multi-step call does not pay on a CPU (new_vs_old_b32 < 1).
    "default_decode_steps": EngineConfig().decode_steps_per_call,
    "default_is_faster_b32": (b32["new_vs_old"]["median"] >= 1.0)
    == (EngineConfig().decode_steps_per_call == NEW),
    "update_ms": spread(update_ms),
    "batches": out,
    "longtail": longtail,
  }
  print(json.dumps(result))


if __name__ == "__main__":
  main()
