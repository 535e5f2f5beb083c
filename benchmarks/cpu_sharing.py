"""What a second program on the same CPU cores costs the learner's train step, with XLA:CPU's
Eigen thread pool on and off: why async RL on a small CPU host cannot keep the learner at its
solo speed while the engine computes beside it (issue 59's bar of 1.3x).

Runs with no arguments (~5 minutes on 2 cores). "alone" is the train step with nothing else
running; "beside" is the same step while a second process runs the same step in a loop, which
is what the engine does to the learner in `benchmarks/async_vs_sync.py` (both programs on one
machine's cores). XLA reads --xla_cpu_multi_thread_eigen once, when its CPU backend starts, so
each setting runs in its own child processes, alternating (off, on, off, on) so that a machine's
drift hits both alike; each child reports its best step of `--iters`. The figures, per shape:
`beside_vs_alone` per setting (the stretch a concurrent program costs) and `alone_off_vs_on`,
`beside_off_vs_on` (< 1: single-threaded Eigen is faster). XLA:CPU spreads every computation
over all the cores it has, Eigen pool or not (a chain of [2048, 512] dots or of elementwise ops
runs 1.6-2.0x slower pinned to one of 2 cores, either setting, 2026-12-03), so a program beside it
takes its share of every core. `--shapes all` adds a 2,048-token row and the 30M model (~20 min).
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# (preset, rows, seq_len): the tiny model's short rows (the default), then with `--shapes all`
# the learner's 2,048-token row and the 30M benchmark model.
SHAPES = (("qwen2-tiny", 4, 256), ("qwen2-tiny", 2, 2048), ("bench-30m", 4, 512))
# Longest wait for the concurrent child to compile and take its first steps.
START_TIMEOUT_S = 600


def child(shape_index: int, iters: int, loop: bool) -> None:
  """Times one shape's train step (best of `iters`), or loops on it until killed (`loop`)."""
  from train_step import _train_setup  # this directory is on sys.path

  from asearcher_jax.model import presets

  name, rows, seq_len = SHAPES[shape_index]
  cfg = presets.model_config(name=name, param_dtype="float32", dtype="float32")
  step, _, state, batch = _train_setup(cfg, rows, seq_len)
  for _ in range(2):
    state, m = step(state, batch)
    m["loss"].block_until_ready()
  print("ready", flush=True)
  best = float("inf")
  n = 0
  while loop or n < iters:
    t = time.perf_counter()
    state, m = step(state, batch)
    m["loss"].block_until_ready()
    best = min(best, time.perf_counter() - t)
    n += 1
  print(json.dumps({"step_s": best}), flush=True)


def run_child(flag: str, shape_index: int, iters: int, beside: bool) -> float:
  env = {**os.environ, "XLA_FLAGS": f"--xla_cpu_multi_thread_eigen={flag}", "JAX_PLATFORMS": "cpu"}
  cmd = [sys.executable, __file__, "--child", str(shape_index), "--iters", str(iters)]
  hog = None
  if beside:
    hog = subprocess.Popen(
      [*cmd, "--loop"], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    # Compiled and stepping (at most START_TIMEOUT_S): only then is the step timed beside it.
    ready, _, _ = select.select([hog.stdout], [], [], START_TIMEOUT_S)
    if not ready or hog.stdout.readline().strip() != "ready":
      hog.kill()
      raise RuntimeError(f"the concurrent child (shape {shape_index}) did not start")
  try:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
      tail = proc.stderr.strip().splitlines()[-1:] or ["no stderr"]
      raise RuntimeError(f"the timed child (shape {shape_index}) failed: {tail[0]}")
    out = proc.stdout.strip().splitlines()
  finally:
    if hog is not None:
      hog.kill()
      hog.wait(timeout=30)
  return json.loads(out[-1])["step_s"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--reps", type=int, default=2, help="alternating runs per setting")
  parser.add_argument("--iters", type=int, default=5, help="timed steps per run (best of)")
  parser.add_argument("--shapes", choices=("default", "all"), default="default")
  parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--loop", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child is not None:
    child(args.child, args.iters, args.loop)
    return
  result = {"reps": args.reps, "iters": args.iters, "cpus": os.cpu_count(), "shapes": {}}
  for i, (name, rows, seq_len) in enumerate(SHAPES if args.shapes == "all" else SHAPES[:1]):
    best = {(f, b): float("inf") for f in ("false", "true") for b in (False, True)}
    for _ in range(args.reps):
      for beside in (False, True):
        for flag in ("false", "true"):
          best[flag, beside] = min(best[flag, beside], run_child(flag, i, args.iters, beside))
    r = {
      "alone_s": {"off": round(best["false", False], 4), "on": round(best["true", False], 4)},
      "beside_s": {"off": round(best["false", True], 4), "on": round(best["true", True], 4)},
      "alone_off_vs_on": round(best["false", False] / best["true", False], 3),
      "beside_off_vs_on": round(best["false", True] / best["true", True], 3),
      "beside_vs_alone": {
        "off": round(best["false", True] / best["false", False], 3),
        "on": round(best["true", True] / best["true", False], 3),
      },
    }
    key = f"{name}_{rows}x{seq_len}"
    result["shapes"][key] = r
    print(f"{key}: {r}", flush=True)
  shapes = result["shapes"].values()
  result["alone_off_vs_on_max"] = max(r["alone_off_vs_on"] for r in shapes)
  result["beside_off_vs_on_max"] = max(r["beside_off_vs_on"] for r in shapes)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
