"""Is `asearcher plan` right? Its memory figures against XLA's, its async/sync prediction against
benchmarks/async_vs_sync.py, side by side in one run.

Memory: for three model sizes (none of them the three the coefficients of rl/plan_memory.py were
read from), the planner's trainer bytes per chip against the compiled memory analysis of the
real train step on CPU (`steps.compile_train_step(...).lower(...).compile().memory_analysis()`:
arguments + temporaries + outputs not aliased to donated arguments), fp32, remat on, AdamW with
clipping, the token-mean NLL loss (the PPO loss adds a few [rows, T] vectors). Target: within
15 % for each size.

Async vs sync: runs benchmarks/async_vs_sync.py (8-15 minutes on 2 busy cores; or reads the last
JSON line of a saved run with --avs-json FILE), takes the rates it measured per mode -- the train
step (train + weight sync), the engine thread's busy time per decode step (prefills and weight
updates stall every episode's next token, so they are spread over the decode steps) -- and runs
the discrete-event model (rl/plan_sim.py) with the benchmark's workload distributions, B, n, eta
and in-flight cap. Target: predicted speedup within 20 % of the measured one. The last line is one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax
import jax.numpy as jnp
from flax import nnx

from asearcher_jax.model import steps, transformer
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.rl import plan_memory, plan_sim

# (name, model shape, rows, row_len): none of these is a size the coefficients were fitted on.
SIZES = (
  ("s", dict(hidden_size=128, intermediate_size=384, num_layers=3, num_heads=4, num_kv_heads=2,
             vocab_size=16384), 2, 256),
  ("m", dict(hidden_size=384, intermediate_size=1024, num_layers=6, num_heads=6, num_kv_heads=2,
             vocab_size=12000), 1, 1024),
  ("l", dict(hidden_size=768, intermediate_size=2048, num_layers=4, num_heads=12, num_kv_heads=4,
             vocab_size=32000), 2, 512),
)  # fmt: skip


def measured_bytes(cfg: ModelConfig, rows: int, row_len: int) -> int:
  """Peak bytes of the compiled train step by XLA's own accounting."""
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  opt = steps.make_optimizer(steps.OptimizerConfig(learning_rate=1e-4))
  state = steps.init_train_state(params, opt)
  fn = steps.compile_train_step(graphdef, opt, steps.nll_loss, state)
  spec = jax.ShapeDtypeStruct((rows, row_len), jnp.int32)
  batch = {k: spec for k in ("tokens", "positions", "segment_ids", "loss_mask")}
  m = fn.lower(state, batch).compile().memory_analysis()
  return int(
    m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
  )


def memory_check() -> list[dict]:
  out = []
  for name, shape, rows, row_len in SIZES:
    cfg = ModelConfig(**shape, remat_policy="full", tie_word_embeddings=False)
    t0 = time.perf_counter()
    measured = measured_bytes(cfg, rows, row_len)
    planned = plan_memory.trainer_memory(
      cfg, plan_memory.TrainerShape(row_len=row_len, micro_rows=rows)
    )["total"]
    out.append({
      "size": name, "params_m": round(cfg.num_params() / 1e6, 2), "tokens": rows * row_len,
      "planned_mb": round(planned / 1e6, 1), "measured_mb": round(measured / 1e6, 1),
      "error": round(planned / measured - 1, 3), "compile_s": round(time.perf_counter() - t0, 1),
    })  # fmt: skip
    print(out[-1], flush=True)
  return out


def run_async_vs_sync() -> dict:
  script = Path(__file__).with_name("async_vs_sync.py")
  r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=3600)
  if r.returncode:
    raise SystemExit(f"async_vs_sync.py failed ({r.returncode}): {r.stderr[-2000:]}")
  return json.loads(r.stdout.strip().splitlines()[-1])


def mode_workload(mode: dict) -> plan_sim.Workload:
  """The DES workload with one mode's measured rates (async_vs_sync.py's distributions are
  plan_sim.Workload's defaults)."""
  e = mode["engine"]
  busy = e["decode_s"] + e["prefill_s"] + e["update_s"]
  return plan_sim.Workload(
    decode_token_s=busy / max(e["decode_steps"], 1),
    train_step_s=mode["train_s_mean"] + mode["sync_s_mean"],
  )


def async_check(avs: dict) -> dict:
  sched = plan_sim.Schedule(batch_groups=4, group_size=4, eta=avs["eta"], max_concurrent=20)
  sync_sched = plan_sim.Schedule(batch_groups=4, group_size=4, eta=0, max_concurrent=4)
  seeds = range(20)
  walls = {}
  for mode, s in (("sync", sync_sched), ("async", sched)):
    w = mode_workload(avs[mode])
    runs = [plan_sim.simulate(w, s, steps=avs["steps"], seed=i) for i in seeds]
    walls[mode] = {k: round(sum(r[k] for r in runs) / len(runs), 3) for k in runs[0]}
    walls[mode]["decode_token_ms"] = round(w.decode_token_s * 1e3, 2)
    walls[mode]["train_step_s"] = round(w.train_step_s, 3)
  predicted = walls["sync"]["wall_s"] / walls["async"]["wall_s"]
  return {
    "predicted_speedup": round(predicted, 3),
    "measured_speedup": avs["speedup"],
    "error": round(predicted / avs["speedup"] - 1, 3),
    "predicted": walls,
    "measured": {
      m: {k: avs[m][k] for k in ("wall_s", "trainer_idle_frac", "group_s_mean")}
      for m in ("sync", "async")
    },
  }


def main(argv: list[str] | None = None) -> dict:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--avs-json", help="a saved async_vs_sync.py output (its last line is used)")
  p.add_argument("--skip-memory", action="store_true")
  a = p.parse_args(argv)
  memory = [] if a.skip_memory else memory_check()
  if a.avs_json:
    avs = json.loads(Path(a.avs_json).read_text().strip().splitlines()[-1])
  else:
    avs = run_async_vs_sync()
  rl = async_check(avs)
  print(f"async/sync: predicted {rl['predicted_speedup']}x, measured {rl['measured_speedup']}x",
        flush=True)  # fmt: skip
  result = {
    "memory": memory,
    "memory_max_abs_error": max((abs(m["error"]) for m in memory), default=None),
    "memory_within_15pct": all(abs(m["error"]) <= 0.15 for m in memory) if memory else None,
    "async_vs_sync": rl,
    "async_within_20pct": abs(rl["error"]) <= 0.20,
    "avs_source": a.avs_json or "benchmarks/async_vs_sync.py (this run)",
    "platform": jax.devices()[0].platform,
  }
  print(json.dumps(result), flush=True)
  return result


if __name__ == "__main__":
  main()
