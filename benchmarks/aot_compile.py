"""Do the real-model recipes' learners fit their trainer slices? Compiled by libtpu on this host.

For each real-model recipe in gin/experiments, the learner's optimizer step (PPO objective,
micro-batches of the recipe's micro_rows per shard, two of them per step) is compiled ahead of
time (rl/aot.py, `asearcher compile`) for the recipe's own trainer slice (its plan's chip and
TrainerShape.chips) over the recipe's mesh (fsdp over every chip), from abstract shapes. Per
recipe: XLA's per-chip memory (arguments + temporaries + outputs not aliased), the chip's HBM,
whether it fits, FLOPs per chip, compile time; beside it the dense path's figure (or its compile
failure) and `asearcher plan`'s formula for the same rows (planner vs compiled). The dense path is
compiled with the whole score matrix of a layer at once (`attention_block=0`): the same memory
as query blocks whose scores the backward pass keeps, in one op instead of 256.

Sequence length: 32,768 tokens a row for every recipe. The 7B and 14B recipes (and Search-R1's
7B) bind ROW_LEN = 8192 today; they are compiled at 32,768 here, the length ASearcher's
trajectories reach; QwQ-32B's recipe binds 32,768 itself.

Serving: for the 7B and QwQ-32B recipes also one serving replica (the plan's ServingShape: its
chips' slice, slots, pages) -- the paged engine's decode step (one token for every slot) and a
prefill step (a chunk of PREFILL_TOKENS tokens), ragged paged attention on TPU, KV heads
duplicated to the chips where they outnumber them -- under "serving": HBM per chip of each, fits,
the KV cache's share, and the live sequences the pages hold (the planner's figure).

A program the TPU compiler refuses (RESOURCE_EXHAUSTED) is reported as not fitting, with the
temporaries it named plus the arguments as a lower bound. Each recipe compiles in a child process
given COMPILE_TIMEOUT_S (a dense program with many query blocks per layer can take minutes); a
compile that does not finish is reported as such (fits unknown), not waited for. The last line
is one JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from asearcher_jax import tpu_env

tpu_env.for_ahead_of_time()  # before jax is imported: JAX on the CPU, libtpu quiet

import gin  # noqa: E402

from asearcher_jax import main  # noqa: E402
from asearcher_jax.apps import compile as compiling  # noqa: E402
from asearcher_jax.rl import aot  # noqa: E402

RECIPES = (
  "asearcher_local_qwen2_5_7b",
  "asearcher_local_qwen2_5_14b",
  "asearcher_web_qwq_32b",
  "search_r1_qwen2_5_7b",
)
# A subset, comma-separated (a run split in parts on a busy host); unset: all of them.
ONLY = [r for r in os.environ.get("AOT_RECIPES", "").split(",") if r]
# Recipes whose serving replica is compiled too (variant "serving"), and the prefill chunk.
SERVING_RECIPES = ("asearcher_local_qwen2_5_7b", "asearcher_web_qwq_32b")
PREFILL_TOKENS = 2048
# Which compiles (VARIANTS, and "serving"), comma-separated; unset: all of them.
ONLY_VARIANTS = [v for v in os.environ.get("AOT_VARIANTS", "").split(",") if v]
SEQ_LEN = 32768
# Seconds each compile (a child process) may take; AOT_COMPILE_TIMEOUT_S sets it.
COMPILE_TIMEOUT_S = float(os.environ.get("AOT_COMPILE_TIMEOUT_S", "300"))


def _summary(r: dict) -> dict:
  t = r["train"]
  return {
    "train_hbm_gib_per_chip": t["total_gib"],
    "train_fits": t["fits"],
    "total_is_lower_bound": bool(t.get("total_is_lower_bound", False)),
    "compile_s": t["compile_s"],
    "argument_gib": round(t["argument_bytes"] / aot.GIB, 3),
    "temp_gib": round(t["temp_bytes"] / aot.GIB, 3),
    "flops_per_chip": t["flops_per_chip"],
    **({"error": t["error"]} if "error" in t else {}),
  }


VARIANTS = {
  # the recipe's model as configured (its attention resolved for TPU)
  "model": "the recipe's model",
  # the dense reference in one block: the full [rows, heads, T, T] fp32 scores of a layer
  # (attention_block=0), which compiles in seconds where today's 256 query blocks a layer do not
  "dense": "dense, full score matrix (attention_block=0)",
}


def run_serving(name: str) -> dict:
  """One serving replica of the recipe on its slice: the paged engine's decode and prefill
  steps with ragged paged attention (apps/compile.py serving_report)."""
  t0 = time.perf_counter()
  r = compiling.serving_report(_recipe(name), prefill_tokens=PREFILL_TOKENS)
  return {
    "topology": r["topology"], "chips": r["chips"], "slots": r["slots"], "pages": r["pages"],
    "page_size": r["page_size"], "kv_heads_per_chip": r["kv_heads_per_chip"],
    "kv_cache_gib_per_chip": r["kv_cache_gib_per_chip"], "chip_hbm_gib": r["hbm_gib_per_chip"],
    "live_sequences_per_replica": r["live_sequences_per_replica"],
    "live_context_tokens": r["live_context_tokens"], "prefill_tokens": r["prefill_tokens"],
    **{f"{k}_hbm_gib_per_chip": r[k]["total_gib"] for k in ("decode", "prefill")},
    **{f"{k}_fits": r[k]["fits"] for k in ("decode", "prefill")},
    **{f"{k}_temp_gib": round(r[k]["temp_bytes"] / aot.GIB, 3) for k in ("decode", "prefill")},
    **{f"{k}_compile_s": r[k]["compile_s"] for k in ("decode", "prefill")},
    "planner_gib_per_chip": r["planner_gib_per_chip"],
    **{f"{k}_error": r[k]["error"] for k in ("decode", "prefill") if "error" in r[k]},
    "wall_s": round(time.perf_counter() - t0, 1),
  }  # fmt: skip


def run_recipe(name: str, variant: str, seq_len: int = SEQ_LEN) -> dict:
  """The recipe's learner at `seq_len` on its trainer slice, as `variant` (VARIANTS)."""
  if variant == "serving":
    return run_serving(name)
  recipe = _recipe(name)
  attention = None
  if variant == "dense":
    recipe = dataclasses.replace(recipe, model=recipe.model.replace(attention_block=0))
    attention = "dense"
  t0 = time.perf_counter()
  r = compiling.report(recipe, row_len=seq_len, attention=attention, score=False)
  return {
    "topology": r["topology"],
    "chips": r["chips"],
    "seq_len": seq_len,
    "recipe_row_len": recipe.ppo.row_len,
    "rows": r["rows"],
    "micro_batch_rows": r["micro_batch_rows"],
    "attention": r["attention"],
    "variant": VARIANTS[variant],
    "chip_hbm_gib": r["hbm_gib_per_chip"],
    **_summary(r),
    "planner_gib_per_chip": r["planner_gib_per_chip"],
    "planner_live_blocks": r["planner_live_blocks"],
    "wall_s": round(time.perf_counter() - t0, 1),
  }


def _recipe(name: str) -> compiling.Recipe:
  try:
    main.configure("compile", [f"gin/experiments/{name}.gin"], [])
    return compiling.recipe_from_gin()
  finally:
    gin.clear_config()


def _not_compiled(name: str, variant: str) -> dict:
  """The fields of a compile that gave no figure (timed out, failed or skipped)."""
  s = aot.tpu_slice(compiling.recipe_slice(_recipe(name)))
  return {"topology": s.name, "chips": s.chips, "seq_len": SEQ_LEN, "chip_hbm_gib": s.hbm_gib,
          "variant": VARIANTS[variant], "train_hbm_gib_per_chip": None, "train_fits": None}  # fmt: skip


def run_in_child(name: str, variant: str) -> dict:
  """`run_recipe` in a child process bounded by COMPILE_TIMEOUT_S."""
  t0 = time.perf_counter()
  failed = {"decode_fits": None} if variant == "serving" else _not_compiled(name, variant)
  try:
    out = subprocess.run([sys.executable, __file__, "--recipe", name, variant],
                         capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)  # fmt: skip
  except subprocess.TimeoutExpired:
    return {**failed, "error": f"compile did not finish within {COMPILE_TIMEOUT_S:.0f} s"}
  lines = out.stdout.strip().splitlines()
  if out.returncode or not lines:
    tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
    return {**failed, "error": f"child failed: {tail[:300]}"}
  r = json.loads(lines[-1])
  r["child_wall_s"] = round(time.perf_counter() - t0, 1)
  return r


def _line(r: dict) -> str:
  if r.get("skipped"):
    return "skipped (AOT_VARIANTS)"
  if "error" in r and r.get("train_hbm_gib_per_chip") is None:
    return r["error"]
  if "error" in r:  # the compiler refused it: what it named, and the arguments
    return (f">= {r['train_hbm_gib_per_chip']} GiB/chip of {r['chip_hbm_gib']} fits=False "
            f"({r['compile_s']} s; {r['error'].split(':')[0]})")  # fmt: skip
  bound = ">= " if r["total_is_lower_bound"] else ""
  return (f"{bound}{r['train_hbm_gib_per_chip']} GiB/chip of {r['chip_hbm_gib']} "
          f"fits={r['train_fits']} ({r['compile_s']} s)")  # fmt: skip


def main_() -> None:
  os.chdir(os.path.join(os.path.dirname(__file__), ".."))
  if sys.argv[1:2] == ["--recipe"]:  # the child of run_in_child
    print(json.dumps(run_recipe(sys.argv[2], sys.argv[3])))
    return
  aot.require_libtpu()
  results = {}
  for name in ONLY or RECIPES:
    variants = ONLY_VARIANTS or list(VARIANTS)
    skipped = {"skipped": True}
    r = (
      run_in_child(name, "model")
      if "model" in variants
      else {**_not_compiled(name, "model"), **skipped}
    )
    r["dense"] = run_in_child(name, "dense") if "dense" in variants else skipped
    if name in SERVING_RECIPES:
      want = not ONLY_VARIANTS or "serving" in ONLY_VARIANTS
      r["serving"] = run_in_child(name, "serving") if want else skipped
      v = r["serving"]
      if "decode_fits" in v:
        print(f"{name} serving: {v['topology']} x {v['slots']} slots, {v['pages']} pages "
              f"({v['live_sequences_per_replica']} live): decode {v['decode_hbm_gib_per_chip']} "
              f"GiB/chip, prefill {v['prefill_hbm_gib_per_chip']} GiB/chip of "
              f"{v['chip_hbm_gib']}", flush=True)  # fmt: skip
    results[name] = r
    planner = r.get("planner_gib_per_chip", r["dense"].get("planner_gib_per_chip"))
    print(f"{name}: {r['topology']} ({r['chips']} chips), {r['seq_len']} tokens/row: "
          f"{_line(r)}; dense {_line(r['dense'])}; planner {planner} GiB/chip", flush=True)  # fmt: skip
  print(json.dumps({
    "benchmark": "aot_compile",
    "seq_len": SEQ_LEN,
    "compile_timeout_s": COMPILE_TIMEOUT_S,
    "note": "7B/14B recipes bind ROW_LEN 8192; compiled at 32768 here",
    "recipes": results,
  }))  # fmt: skip


if __name__ == "__main__":
  main_()
