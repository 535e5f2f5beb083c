"""Throughput and peak memory of the jitted train step (AdamW) against the machine's matmul peak.

Runs with no arguments. For each model config it reports tokens/s of a full train step (forward,
backward, AdamW update) on packed [rows, seq_len] batches, peak device memory of the step, and the
ratio of the achieved matmul FLOP/s (6 x forward FLOPs per token, attention counted causally) to
the peak FLOP/s of a large matmul in the compute dtype measured in the same process, so the ratio
is comparable across machines. On a chip whose datasheet bf16 peak is known (`CHIP_PEAK_TFLOPS`)
it also reports MFU against that peak.

`--dtype bfloat16` is mixed precision: float32 parameters and Adam moments, bfloat16 activations
and matmul inputs. On an accelerator the default configs add the real Qwen2.5-0.5B architecture
(random init, remat, 4 rows of 2,048 tokens); on CPU that config is opt-in
(`--configs qwen2.5-0.5b`: ~8 GB of host memory). It also measures the cost of a checkpoint
after every step (params + Adam state through Orbax), async as the trainer writes them and
blocking, side by side. The last line is one JSON object.

Each config runs the default model path (layers under a scan, log-probs over chunks of
`logits_chunk` positions) and the old one (`OLD_PATH`: a Python loop over layers, whole
[rows, T, V] logits, dense attention) side by side, timed interleaved in the same process:
`new_vs_old_tokens_per_s` is their ratio. `compile` reports the train step's compile time of a
2-layer and a 28-layer tiny model under the scan (and the loop), since depth should cost the scan
nothing (the AdamW update, one fusion chain per parameter leaf, still grows with depth: reported
beside it as `train_step_compile_*`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from asearcher_jax.model import presets, steps, transformer
from asearcher_jax.model.config import ModelConfig

# The model path before layer scan and chunked log-probs; `attention` where the field exists.
OLD_PATH = {"scan_layers": False, "logits_chunk": 0, "attention": "dense"}


def old_path(cfg: ModelConfig) -> ModelConfig:
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  return cfg.replace(**{k: v for k, v in OLD_PATH.items() if k in fields})


def _time(fn, *, warmup: int, iters: int) -> float:
  """Best-of-iters wall time of fn() (which must block)."""
  for _ in range(warmup):
    fn()
  best = float("inf")
  for _ in range(iters):
    t = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t)
  return best


# Dense bf16 datasheet peaks (TFLOP/s) by `jax.Device.device_kind`, for MFU.
CHIP_PEAK_TFLOPS = {
  "NVIDIA H100 80GB HBM3": 989.0,  # H100 SXM
  "NVIDIA H100 PCIe": 756.0,
  "NVIDIA H200": 989.0,
  "TPU v4": 275.0,
  "TPU v5 lite": 197.0,  # v5e
  "TPU v5": 459.0,  # v5p
  "TPU v6 lite": 918.0,  # v6e
}
# On an accelerator, Qwen2.5-0.5B (the real architecture) joins the default configs.
CONFIGS = {
  "qwen2-tiny": dict(rows=4, seq_len=256),
  "bench-30m": dict(rows=8, seq_len=512),
  "qwen2.5-0.5b": dict(rows=4, seq_len=2048, remat_policy="full"),
}


def peak_matmul_flops(n: int = 2048, dtype=jnp.float32) -> float:
  """Best-of-10 [n, n] @ [n, n] throughput in `dtype`, on random data."""
  a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), dtype)
  b = jnp.asarray(np.random.default_rng(1).standard_normal((n, n)), dtype)
  mm = jax.jit(lambda x, y: x @ y)
  secs = _time(lambda: mm(a, b).block_until_ready(), warmup=2, iters=10)
  return 2 * n**3 / secs


def peak_memory_bytes(compiled) -> tuple[int | None, str]:
  """(bytes, how): the device allocator's peak where it keeps one (GPU/TPU), else XLA's compiled
  memory analysis of the step (arguments + outputs + temporaries, less donated aliases)."""
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return int(stats["peak_bytes_in_use"]), "allocator_peak"
  m = compiled.memory_analysis()
  if m is None:
    return None, "unknown"
  total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
  return int(total - m.alias_size_in_bytes), "compiled_analysis"


def _train_setup(cfg: ModelConfig, rows: int, seq_len: int):
  """(jitted step, compiled step, initial state, batch) of an AdamW nll train step under cfg."""
  graphdef, params = nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(0)))
  opt = steps.make_optimizer(steps.OptimizerConfig(learning_rate=1e-4))
  graphdef, params = steps.train_form(graphdef, params)  # the learner's form (stacked layers)
  state = steps.init_train_state(params, opt)
  rng = np.random.default_rng(0)
  # Full rows, one sequence each: long agent trajectories fill a packed row on their own.
  batch = {
    "tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (rows, seq_len)), jnp.int32),
    "positions": jnp.asarray(np.tile(np.arange(seq_len), (rows, 1)), jnp.int32),
    "segment_ids": jnp.ones((rows, seq_len), jnp.int32),
    "loss_mask": jnp.ones((rows, seq_len), jnp.float32),
  }
  step = steps.compile_train_step(graphdef, opt, steps.nll_loss, state)
  return step, step.lower(state, batch).compile(), state, batch


def bench_config(
  name: str,
  rows: int,
  seq_len: int,
  iters: int,
  dtype: str = "float32",
  remat_policy: str | None = None,
) -> dict:
  """The default path and the old one (OLD_PATH) on the same batch, timed interleaved (best of
  `iters` each), so a shared machine's load hits both alike. remat_policy: both paths' (None:
  the config's default for the new path, no remat for the old one, as before remat policies)."""
  overrides = {} if remat_policy is None else {"remat_policy": remat_policy}
  cfg = presets.model_config(name=name, param_dtype="float32", dtype=dtype, **overrides)
  paths = {"new": cfg, "old": old_path(cfg).replace(remat_policy=remat_policy or "none")}
  setups = {k: _train_setup(c, rows, seq_len) for k, c in paths.items()}
  holders = {k: {"state": s[2]} for k, s in setups.items()}

  def run_one(k):
    step, _, _, batch = setups[k]
    holders[k]["state"], m = step(holders[k]["state"], batch)
    m["loss"].block_until_ready()

  secs = {k: float("inf") for k in setups}
  for k in setups:
    for _ in range(2):  # warmup
      run_one(k)
  for _ in range(iters):
    for k in setups:
      t = time.perf_counter()
      run_one(k)
      secs[k] = min(secs[k], time.perf_counter() - t)
  tokens = rows * seq_len
  # Useful FLOPs only: causal attention counts half the score matrix (the masked half is not
  # work, whatever the kernel does with it); backward = 2x forward.
  flops = 3 * tokens * cfg.matmul_flops_per_token(seq_len)
  peak_bytes, how = peak_memory_bytes(setups["new"][1])
  old_peak, _ = peak_memory_bytes(setups["old"][1])
  out = {
    "params_m": round(cfg.num_params() / 1e6, 2),
    "dtype": dtype,
    "remat_policy": cfg.remat_policy,
    "old_remat_policy": paths["old"].remat_policy,
    "scan_layers": cfg.scan_layers,
    "logits_chunk": cfg.logits_chunk,
    "peak_memory_gb": None if peak_bytes is None else round(peak_bytes / 1e9, 3),
    "old_peak_memory_gb": None if old_peak is None else round(old_peak / 1e9, 3),
    "peak_memory_from": how,
    "rows": rows,
    "seq_len": seq_len,
    "step_s": round(secs["new"], 4),
    "old_step_s": round(secs["old"], 4),
    "tokens_per_s": round(tokens / secs["new"], 1),
    "old_tokens_per_s": round(tokens / secs["old"], 1),
    "new_vs_old_tokens_per_s": round(secs["old"] / secs["new"], 3),
    "flops": flops,
  }
  return out


def bench_compile(layers: tuple[int, ...] = (2, 28), loop: bool = True) -> dict:
  """Compile seconds of a tiny model (hidden 64, 1k vocabulary, 1 x 256 tokens) at each depth:
  `compile_s_*` the loss and its gradient under the scan (what layer depth costs the model),
  `loop_compile_s_*` the same under the Python loop (loop=True), `train_step_compile_s_*` the
  whole AdamW step under the scan over the learner's form of the parameters (`steps.train_form`:
  layers stored stacked, so the optimizer's update is one fusion chain per stacked leaf rather
  than a dozen per layer). The persistent compilation cache is off so every figure is a real
  compile."""
  jax.config.update("jax_enable_compilation_cache", False)
  base = presets.model_config(name="qwen2-tiny", vocab_size=1024)
  batch = {
    "tokens": jnp.zeros((1, 256), jnp.int32),
    "positions": jnp.arange(256, dtype=jnp.int32)[None],
    "segment_ids": jnp.ones((1, 256), jnp.int32),
    "loss_mask": jnp.ones((1, 256), jnp.float32),
  }

  def lowered(n: int, kind: str, scan: bool):
    cfg = base.replace(num_layers=n, scan_layers=scan)
    graphdef, params = nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, params = steps.train_form(graphdef, params)  # stacked under the scan
    if kind == "":
      grad = jax.grad(lambda p, b: steps.nll_loss(graphdef, p, b)[0])
      return jax.jit(grad).lower(params, batch)
    opt = steps.make_optimizer(steps.OptimizerConfig(learning_rate=1e-4))
    state = steps.init_train_state(params, opt)
    return steps.compile_train_step(graphdef, opt, steps.nll_loss, state).lower(state, batch)

  runs = [("", True), ("loop_", False), ("train_step_", True)]
  out: dict = {}
  for kind, scan in runs if loop else [r for r in runs if r[1]]:
    for n in layers:
      program = lowered(n, kind, scan)
      t = time.perf_counter()
      program.compile()
      out[f"{kind}compile_s_{n}_layers"] = round(time.perf_counter() - t, 2)
  lo, hi = min(layers), max(layers)
  for kind, _ in runs:
    if f"{kind}compile_s_{hi}_layers" in out:
      out[f"{kind}compile_ratio_{hi}_over_{lo}"] = round(
        out[f"{kind}compile_s_{hi}_layers"] / out[f"{kind}compile_s_{lo}_layers"], 2
      )
  return out


def bench_checkpoint_overhead(name: str, rows: int, seq_len: int, n_steps: int = 6) -> dict:
  """Step time with a checkpoint after every step, async (the trainer's default: the next step
  runs while Orbax writes) and blocking (the old behaviour), against no checkpoint; one run,
  interleaved. The ratios are (time with checkpoints) / (time without) - 1."""
  import tempfile

  from asearcher_jax.checkpoint import CheckpointConfig, Checkpointer

  cfg = presets.model_config(name=name)
  graphdef, params = nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(0)))
  opt = steps.make_optimizer(steps.OptimizerConfig(learning_rate=1e-4))
  rng = np.random.default_rng(0)
  batch = {
    "tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (rows, seq_len)), jnp.int32),
    "positions": jnp.asarray(np.tile(np.arange(seq_len), (rows, 1)), jnp.int32),
    "segment_ids": jnp.ones((rows, seq_len), jnp.int32),
    "loss_mask": jnp.ones((rows, seq_len), jnp.float32),
  }
  state = steps.init_train_state(params, opt)
  step = steps.compile_train_step(graphdef, opt, steps.nll_loss, state)
  state, m = step(state, batch)  # compile
  m["loss"].block_until_ready()

  def run(mode: str, state):
    with tempfile.TemporaryDirectory() as d:
      ckpt = Checkpointer(CheckpointConfig(directory=d, max_to_keep=2, async_save=True))
      t0 = time.perf_counter()
      for i in range(n_steps):
        state, m = step(state, batch)
        m["loss"].block_until_ready()
        if mode != "none":
          ckpt.save(i + 1, {"train_state": state}, force=True)
          if mode == "blocking":
            ckpt.wait()
      ckpt.close()  # the last async save is part of the cost
      return state, (time.perf_counter() - t0) / n_steps

  secs = {"none": [], "async": [], "blocking": []}
  for _ in range(2):  # interleaved repetitions; the best of each
    for mode in secs:
      state, s = run(mode, state)
      secs[mode].append(s)
  best = {k: min(v) for k, v in secs.items()}
  return {
    "config": name,
    "step_s": round(best["none"], 4),
    "checkpoint_mb": round(sum(x.nbytes for x in jax.tree.leaves(state)) / 1e6, 1),
    "async_overhead": round(best["async"] / best["none"] - 1, 3),
    "blocking_overhead": round(best["blocking"] / best["none"] - 1, 3),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  parser.add_argument("--configs", nargs="*", choices=sorted(CONFIGS), default=None)
  parser.add_argument(
    "--checkpoint-config", default=None,
    help="config of the checkpoint-every-step run (default: qwen2-tiny on CPU, bench-30m else)",
  )  # fmt: skip
  parser.add_argument(
    "--no-loop-compile", action="store_true",
    help="skip the Python loop's compile times (the 28-layer loop compiles slowly)",
  )  # fmt: skip
  args = parser.parse_args()
  device = jax.devices()[0]
  on_cpu = device.platform == "cpu"
  names = args.configs or [n for n in CONFIGS if not (on_cpu and n == "qwen2.5-0.5b")]
  mm_dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
  n = 2048 if on_cpu else 8192
  # The higher of two peak measurements (before and after the configs): a conservative ratio.
  peak = peak_matmul_flops(n, mm_dtype)
  print(f"peak {args.dtype} matmul: {peak / 1e12:.2f} TFLOP/s on {device.device_kind} "
        f"x{jax.device_count()}", flush=True)  # fmt: skip
  runs = {}
  for name in names:
    spec = dict(CONFIGS[name])
    rows = spec.pop("rows") * (1 if on_cpu else jax.device_count())
    runs[name] = bench_config(name, rows=rows, iters=args.iters, dtype=args.dtype, **spec)
  peak = max(peak, peak_matmul_flops(n, mm_dtype))
  chip = CHIP_PEAK_TFLOPS.get(device.device_kind)
  results = {
    "device": device.device_kind,
    "dtype": args.dtype,
    "peak_matmul_tflops": round(peak / 1e12, 3),
    "chip_peak_bf16_tflops": chip,
  }
  for name, r in runs.items():
    r["tflops"] = round(r.pop("flops") / r["step_s"] / 1e12, 4)
    r["flops_ratio"] = round(r["tflops"] * 1e12 / peak, 3)
    if chip is not None and args.dtype == "bfloat16":
      r["mfu"] = round(r["tflops"] / (chip * jax.device_count()), 4)
    results[name] = r
    print(f"{name:>12}: {r}", flush=True)
  # The worst config's ratio: the default path must not be slower than the old one anywhere.
  results["new_vs_old_tokens_per_s"] = min(r["new_vs_old_tokens_per_s"] for r in runs.values())
  comp = bench_compile(loop=not args.no_loop_compile)
  print(f"compile: {comp}", flush=True)
  results["compile"] = comp
  results.update(comp)
  ck_name = args.checkpoint_config or ("qwen2-tiny" if on_cpu else "bench-30m")
  spec = CONFIGS[ck_name]
  ck = bench_checkpoint_overhead(ck_name, spec["rows"], spec["seq_len"])
  print(f"checkpoint every step: {ck}", flush=True)
  results["checkpoint_every_step"] = ck
  print(json.dumps(results))


if __name__ == "__main__":
  main()
