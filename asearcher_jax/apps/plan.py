"""`asearcher plan EXPERIMENT.gin`: will this recipe fit, and how fast will it go, before paying.

Per chip, for the trainer mesh and one serving replica: parameters, fp32 master weights,
optimizer state, gradients and update temporaries, activations with remat, KV cache for the
configured slots and context (rl/plan_memory.py), whether that fits v4 / v5e / v5p / v6e HBM (or
an H100's / H200's: one GPU counts as a chip, docs/gpu.md); and async vs sync RL throughput from
the discrete-event model (rl/plan_sim.py) with the decode and train rates estimated from the
target chip's peak figures. Recipes bind `planning.plan.*` next to their training bindings so
one file states the run and its plan. Prints a table, then one JSON
line (also returned as the exit code 0 / 1: 1 when the target chip does not fit).
"""

from __future__ import annotations

import dataclasses
import json

from asearcher_jax.errors import ConfigValueError
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.rl import plan_checkpoint, plan_sim
from asearcher_jax.rl import plan_memory as mem

DEFAULT_MODEL = ModelConfig(
  vocab_size=151936, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
  num_kv_heads=2, tie_word_embeddings=True,
)  # fmt: skip


DEFAULT_TRAINER = mem.TrainerShape()
DEFAULT_SERVING = mem.ServingShape()
DEFAULT_LENGTHS = mem.LengthDistribution()
DEFAULT_WORKLOAD = plan_sim.Workload()
DEFAULT_SCHEDULE = plan_sim.Schedule()
DEFAULT_CHECKPOINT = plan_checkpoint.CheckpointPlan()


def estimate(
  *,
  model: ModelConfig,
  chip: str,
  trainer: mem.TrainerShape,
  serving: mem.ServingShape,
  workload: plan_sim.Workload,
  schedule: plan_sim.Schedule,
  tokens_per_episode: int,
  checkpoint: plan_checkpoint.CheckpointPlan = DEFAULT_CHECKPOINT,
  compiled_trainer_bytes: float | None = None,
  lengths: mem.LengthDistribution = DEFAULT_LENGTHS,
) -> dict:
  """The plan as a dict (GB per chip by part, fits, step times, async vs sync).
  compiled_trainer_bytes: the trainer's bytes per chip from a compile (`asearcher compile`),
  replacing the formula's total (its parts are kept for reference)."""
  if mem.chip_name(chip) not in mem.CHIPS:
    raise ConfigValueError(f"unknown chip {chip!r} (known: {', '.join(mem.CHIPS)})")
  chip = mem.chip_name(chip)
  t = mem.trainer_memory(model, trainer)
  if compiled_trainer_bytes is not None:
    t = {**t, "formula_total": t["total"], "total": compiled_trainer_bytes}
  s = mem.serving_memory(model, serving)
  tokens = schedule.batch_groups * schedule.group_size * tokens_per_episode
  train_s = mem.train_step_s(model, tokens, trainer.chips, chip)
  # Before the serving model: every episode at single-stream speed (the weights read per step).
  w_old = dataclasses.replace(
    workload, train_step_s=train_s, decode_token_s=mem.decode_token_s(model, serving.chips, chip)
  )
  old = plan_sim.async_vs_sync(w_old, schedule)
  searches = workload.searches.mean()

  def simulate(shape: mem.ServingShape, updates: bool) -> tuple[dict, dict]:
    """(async_vs_sync's result, the async mode's serving rates) of replicas of `shape`; with
    `updates`, async RL's weight updates land mid-episode once a train step (sync RL's land
    between steps, with nothing in flight)."""
    rates = {}
    for mode, groups in (
      ("async", schedule.max_concurrent or (schedule.eta + 1) * schedule.batch_groups),
      ("sync", schedule.batch_groups),
    ):
      rates[mode] = mem.serving_rates(
        model, shape, lengths, mem.chip_rates(shape, chip),
        in_flight=groups * schedule.group_size, calls_per_episode=2 * searches + 1,
        tokens_per_call=workload.output_tokens.mean(), searches_per_episode=searches,
        group_size=schedule.group_size,
        update_interval_s=train_s if updates and mode == "async" else None,
      )  # fmt: skip
    w, w_sync = (
      dataclasses.replace(
        workload,
        train_step_s=train_s,
        decode_token_s=r["decode_token_s"],
        call_overhead_s=workload.call_overhead_s + r["call_overhead_s"],
      )
      for r in (rates["async"], rates["sync"])
    )
    return plan_sim.async_vs_sync(w, schedule, sync_workload=w_sync), rates["async"]

  rl, a = simulate(serving, updates=True)
  w = dataclasses.replace(workload, train_step_s=train_s, decode_token_s=a["decode_token_s"])
  # The planner before 2026-12-04 (no re-prefill, free slots free) and the engine before it
  # (free slots read the whole context each decode step), for comparison.
  before, _ = simulate(dataclasses.replace(serving, reprefill_on_update=False), updates=False)
  idle_engine, _ = simulate(
    dataclasses.replace(serving, idle_slot_context=serving.context), updates=True
  )
  return {
    "model_params_b": round(model.num_params() / 1e9, 3),
    "chip": chip,
    "trainer_gb_per_chip": {k: mem.gb(v) for k, v in t.items()},
    "serving_gb_per_chip": {k: mem.gb(v) for k, v in s.items()},
    "trainer_fits": mem.fits(t["total"]),
    "serving_fits": mem.fits(s["total"]),
    "train_step_s": round(w.train_step_s, 2),
    "decode_token_ms": round(w.decode_token_s * 1e3, 2),
    "serving": {
      "layout": "fixed" if serving.pages is None else "paged",
      "replicas": serving.replicas,
      "live_per_replica": round(a["live_capacity"], 1),
      "decode_batch_per_replica": round(a["decode_batch"], 1),
      "live_context_tokens": round(a["context"]),
      "decode_step_ms": round(a["step_s"] * 1e3, 2),
      "reprefill_s_per_update": round(a["reprefill_s"], 2),
      "reprefill_stall_frac": round(a["reprefill_stall_frac"], 3),
      "call_prefill_ms": round(a["call_overhead_s"] * 1e3, 2),
      "tokens_per_s": round(serving.replicas * a["decode_batch"] / a["step_s"], 1),
    },
    "weights_only": {  # the planner before it modelled the serving engine (KV reads, capacity)
      "decode_token_ms": round(w_old.decode_token_s * 1e3, 2),
      "sync_step_s": round(old["sync"]["wall_s"] / 10, 2),
      "async_step_s": round(old["async"]["wall_s"] / 10, 2),
    },
    "sync_step_s": round(rl["sync"]["wall_s"] / 10, 2),
    "async_step_s": round(rl["async"]["wall_s"] / 10, 2),
    # async step without re-prefill (the planner before 2026-12-04), and with it and free slots
    # reading the whole context (the engine before 2026-12-04)
    "async_step_s_no_reprefill": round(before["async"]["wall_s"] / 10, 2),
    "async_step_s_idle_slots_full_window": round(idle_engine["async"]["wall_s"] / 10, 2),
    "speedup_async_vs_sync": round(rl["speedup"], 2),
    "async_trainer_idle": round(rl["async"]["trainer_idle_frac"], 3),
    "async_capacity_ratio": round(rl["async"]["capacity_ratio"], 2),
    "trained_tokens_per_s_async": round(tokens * 10 / rl["async"]["wall_s"], 1),
    "checkpoint": plan_checkpoint.checkpoint_cost(
      model.num_params(),
      checkpoint,
      trainer_chips=trainer.chips,
      step_s=rl["async"]["wall_s"] / 10,  # the async run's step: what an interval lasts
    ),
  }


def plan(
  *,
  model: ModelConfig = DEFAULT_MODEL,
  chip: str = "v5p",
  trainer: mem.TrainerShape = DEFAULT_TRAINER,
  serving: mem.ServingShape = DEFAULT_SERVING,
  workload: plan_sim.Workload = DEFAULT_WORKLOAD,
  schedule: plan_sim.Schedule = DEFAULT_SCHEDULE,
  tokens_per_episode: int = 4096,
  checkpoint: plan_checkpoint.CheckpointPlan = DEFAULT_CHECKPOINT,
  trainer_from_compile: bool = False,
  lengths: mem.LengthDistribution = DEFAULT_LENGTHS,
) -> int:
  """Prints the plan (table, then one JSON line); 1 when the target chip's HBM is too small.

  Args:
    model: The policy's architecture (`presets.model_config()` in recipes).
    chip: Target chip: one of v4, v5e (or v5litepod), v5p, v6e, h100, h200 (its HBM, bf16 peak
      and HBM bandwidth; a GPU counts as a chip).
    trainer: The trainer's mesh, rows and remat (memory per chip and the train step's rate).
    serving: One serving replica: chips, slots and context, fixed or paged cache, replicas,
      prompt and tool tokens (weights + KV cache per chip; the decode and prefill rates).
    workload: The agent workload (searches, tokens per call, tool latency) of the simulation.
    schedule: B groups of n episodes, eta and the in-flight cap of the async run.
    tokens_per_episode: Trained tokens per episode (sets the train step's FLOPs).
    checkpoint: The recipe's checkpoint policy and write bandwidth (its GB, seconds, storage).
    trainer_from_compile: Take the trainer's memory per chip from libtpu's compile of the
      recipe's learner for the `chip` slice of `trainer.chips` chips at `trainer.row_len`
      (`asearcher compile`; needs libtpu, tens of seconds for a real model) instead of the
      formula; the output's trainer_memory_source says which.
    lengths: Trajectory lengths in the KV cache (the live sequences a page budget holds and
      the positions each one reads per decode step).
  """
  compiled = source = None
  chip = mem.chip_name(chip)
  if trainer_from_compile:
    from asearcher_jax.apps import compile as compiling
    from asearcher_jax.rl import aot

    name = aot.slice_for(chip, trainer.chips).name
    r = compiling.report(compiling.recipe_from_gin(model), topology=name,
                         row_len=trainer.row_len, score=False)  # fmt: skip
    compiled, source = r["train"]["total_bytes"], f"compile ({name}, {r['attention']} attention)"
    if r["train"].get("total_is_lower_bound"):
      source += ": the compiler refused it, a lower bound"
  p = estimate(model=model, chip=chip, trainer=trainer, serving=serving, workload=workload,
               schedule=schedule, tokens_per_episode=tokens_per_episode,
               checkpoint=checkpoint, compiled_trainer_bytes=compiled,
               lengths=lengths)  # fmt: skip
  p["trainer_memory_source"] = source or "formula (rl/plan_memory.py)"
  print(
    f"model: {p['model_params_b']} B parameters; target chip {chip}; trainer memory from "
    f"{p['trainer_memory_source']}"
  )
  for name, parts, shape in (("trainer", p["trainer_gb_per_chip"], trainer),
                             ("serving", p["serving_gb_per_chip"], serving)):  # fmt: skip
    fits = p[f"{name}_fits"]
    print(f"{name} ({shape.chips} chips), GB per chip: "
          + ", ".join(f"{k} {v}" for k, v in parts.items())
          + "  fits: " + " ".join(f"{c}={'yes' if ok else 'NO'}" for c, ok in fits.items()))  # fmt: skip
  v = p["serving"]
  print(f"serving ({v['layout']} cache, {v['replicas']} replicas): {v['live_per_replica']} live "
        f"sequences each, decode batch {v['decode_batch_per_replica']} at "
        f"{v['live_context_tokens']} tokens, step {v['decode_step_ms']} ms, "
        f"{v['tokens_per_s']} tokens/s; weights-only model: async "
        f"{p['weights_only']['async_step_s']} s/step")  # fmt: skip
  print(f"train step {p['train_step_s']} s, decode {p['decode_token_ms']} ms/token; "
        f"sync {p['sync_step_s']} s/step, async {p['async_step_s']} s/step: "
        f"{p['speedup_async_vs_sync']}x, async trainer idle {p['async_trainer_idle']}")  # fmt: skip
  c = p["checkpoint"]
  print(f"checkpoint every {c['every_steps']} steps, {c['kept']} kept: {c['checkpoint_gb']} GB "
        f"in {c['checkpoint_write_s']} s at {c['write_gb_s']} GB/s ({c['write_fraction_of_interval']}"
        f" of the {c['interval_s']} s interval); weights version {c['weights_version_gb']} GB; bucket "
        f"{c['storage_gb']} GB")  # fmt: skip
  print(json.dumps(p))
  return 0 if p["trainer_fits"][chip] and p["serving_fits"][chip] else 1
