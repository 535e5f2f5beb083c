"""What the persistent compilation cache (`asearcher_jax/compile_cache.py`) saves a process that
compiles what an earlier one compiled: the quickstart's engine warm-up (the shipped warm start,
`QUICKSTART_ENGINE`: every prefill, suffix and decode shape, sampling mode "sample"), each in a
fresh process, side by side in one run (no arguments; ~6 minutes on 2 CPU cores):
  * off: no cache (every process before the cache, and `ASEARCHER_COMPILE_CACHE=off`);
  * cold / warm: the project's settings (every program written, `min_compile_s` 0), first into
    an empty directory, then a second process reading it back;
  * jax_default_cold / jax_default_warm: the same with JAX's own threshold (only programs that
    took >= 1 s to compile are written), why the project writes every program.
Ratios are off / warm (the saving a re-run sees) and cold / off (what writing costs). The last
line is one JSON object.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def child(cache_dir: str, min_compile_s: float) -> None:
  """One process: enable the cache as `main.py` does, build the engine, warm it up."""
  from asearcher_jax import compile_cache

  cfg = compile_cache.CompileCacheConfig(dir=cache_dir, min_compile_s=min_compile_s)
  compile_cache.enable(cfg, env={})
  from asearcher_jax.apps import wiring
  from asearcher_jax.apps.quickstart import DEFAULT_WARM_START, QUICKSTART_ENGINE
  from asearcher_jax.serving.engine import Engine

  t0 = time.perf_counter()
  policy = wiring.policy(model_dir=str(DEFAULT_WARM_START), tokenizer_dir=str(DEFAULT_WARM_START))
  engine = Engine.from_model(policy.module, policy.tokenizer, QUICKSTART_ENGINE)
  load_s = time.perf_counter() - t0
  warmup_s = engine.warmup(modes=("sample",))
  files = [os.path.join(d, f) for d, _, fs in os.walk(cache_dir) for f in fs] if cache_dir else []
  entries = [f for f in files if f.endswith("-cache")]
  print(
    json.dumps(
      {
        "load_s": round(load_s, 2),
        "warmup_s": round(warmup_s, 2),
        "entries": len(entries),
        "mb": round(sum(os.path.getsize(f) for f in entries) / 1e6, 2),
      }
    )
  )


def run(cache_dir: str, min_compile_s: float) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION", "JAX_PERS"))}
  t0 = time.perf_counter()
  out = subprocess.run(
    [sys.executable, __file__, "--child", cache_dir, str(min_compile_s)],
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
    check=True,
  )
  figures = json.loads(out.stdout.strip().splitlines()[-1])
  figures["process_s"] = round(time.perf_counter() - t0, 2)
  print(json.dumps(figures), flush=True)
  return figures


def main() -> None:
  with tempfile.TemporaryDirectory() as ours, tempfile.TemporaryDirectory() as jaxs:
    print("off ...", flush=True)
    off = run("off", 0.0)
    print("cold / warm, every program written ...", flush=True)
    cold = run(ours, 0.0)
    warm = run(ours, 0.0)
    print("cold / warm, JAX's 1 s threshold ...", flush=True)
    jax_cold = run(jaxs, 1.0)
    jax_warm = run(jaxs, 1.0)
  result = {
    "warmup_s_off": off["warmup_s"],
    "warmup_s_cold": cold["warmup_s"],
    "warmup_s_warm": warm["warmup_s"],
    "warmup_s_jax_default_warm": jax_warm["warmup_s"],
    "process_s_off": off["process_s"],
    "process_s_warm": warm["process_s"],
    "off_vs_warm": round(off["warmup_s"] / warm["warmup_s"], 2),
    "cold_vs_off": round(cold["warmup_s"] / off["warmup_s"], 2),
    "off_vs_jax_default_warm": round(off["warmup_s"] / jax_warm["warmup_s"], 2),
    "entries": warm["entries"],
    "entries_jax_default": jax_warm["entries"],
    "cache_mb": warm["mb"],
    "jax_default_cold_s": jax_cold["warmup_s"],
  }
  print(json.dumps(result))


if __name__ == "__main__":
  if sys.argv[1:2] == ["--child"]:
    child(sys.argv[2], float(sys.argv[3]))
  else:
    main()
