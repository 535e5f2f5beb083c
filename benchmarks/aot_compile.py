"""Do the real-model recipes' learners fit their trainer slices? Compiled by libtpu on this host.

For each real-model recipe in gin/experiments, the learner's optimizer step (PPO objective,
micro-batches of the recipe's micro_rows per shard, two of them per step) is compiled ahead of
time (rl/aot.py, `asearcher compile`) for the recipe's own trainer slice (its plan's chip and
TrainerShape.chips) over the recipe's mesh (fsdp over every chip), from abstract shapes. Per
recipe: XLA's per-chip memory (arguments + temporaries + outputs not aliased), the chip's HBM,
whether it fits, FLOPs per chip, compile time; beside it the dense-attention path's figure (or
its compile failure) and `asearcher plan`'s formula for the same rows (planner vs compiled).

Sequence length: 32,768 tokens a row for every recipe. The 7B and 14B recipes (and Search-R1's
7B) bind ROW_LEN = 8192 today; they are compiled at 32,768 here, the length ASearcher's
trajectories reach; QwQ-32B's recipe binds 32,768 itself.

A program the TPU compiler refuses (RESOURCE_EXHAUSTED) is reported as not fitting, with the
temporaries it named plus the arguments as a lower bound. Compiles take tens of seconds to
minutes each on a shared host. The last line is one JSON object.
"""

from __future__ import annotations

import json
import os
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
SEQ_LEN = 32768


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


def run_recipe(name: str, seq_len: int = SEQ_LEN, *, topology: str | None = None) -> dict:
  """The recipe's learner at `seq_len` on its trainer slice, in its model's attention and in
  dense attention (one compile when they are the same)."""
  try:
    main.configure("compile", [f"gin/experiments/{name}.gin"], [])
    recipe = compiling.recipe_from_gin()
  finally:
    gin.clear_config()
  t0 = time.perf_counter()
  r = compiling.report(recipe, topology=topology, row_len=seq_len, score=False)
  out = {
    "topology": r["topology"],
    "chips": r["chips"],
    "seq_len": seq_len,
    "recipe_row_len": recipe.ppo.row_len,
    "rows": r["rows"],
    "micro_batch_rows": r["micro_batch_rows"],
    "attention": r["attention"],
    "chip_hbm_gib": r["hbm_gib_per_chip"],
    **_summary(r),
    "planner_gib_per_chip": r["planner_gib_per_chip"],
    "planner_live_blocks": r["planner_live_blocks"],
  }
  if r["attention"] == "dense":
    out["dense"] = {"same_as_above": True, **_summary(r)}
  else:
    try:
      d = compiling.report(recipe, topology=topology, row_len=seq_len, attention="dense",
                           score=False)  # fmt: skip
      out["dense"] = _summary(d)
    except Exception as e:  # the dense path's failure is a figure here, not an abort
      out["dense"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
  out["wall_s"] = round(time.perf_counter() - t0, 1)
  return out


def main_() -> None:
  os.chdir(os.path.join(os.path.dirname(__file__), ".."))
  aot.require_libtpu()
  results = {}
  for name in RECIPES:
    r = run_recipe(name)
    results[name] = r
    d = r["dense"]
    bound = ">=" if r["total_is_lower_bound"] else ""
    print(f"{name}: {r['topology']} ({r['chips']} chips), {r['seq_len']} tokens/row "
          f"(recipe {r['recipe_row_len']}), attention {r['attention']}: train "
          f"{bound}{r['train_hbm_gib_per_chip']} GiB/chip of {r['chip_hbm_gib']} "
          f"fits={r['train_fits']} in {r['compile_s']} s; dense "
          f"{d.get('train_hbm_gib_per_chip', d.get('error'))}; planner "
          f"{r['planner_gib_per_chip']} GiB/chip", flush=True)  # fmt: skip
  print(json.dumps({
    "benchmark": "aot_compile",
    "seq_len": SEQ_LEN,
    "note": "7B/14B recipes bind ROW_LEN 8192; compiled at 32768 here",
    "recipes": results,
  }))  # fmt: skip


if __name__ == "__main__":
  main_()
