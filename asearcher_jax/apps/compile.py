"""`asearcher compile RECIPE.gin --topology v5p-32`: the recipe's learner compiled for a TPU slice on this host, before paying for the slice.

The recipe's policy (`presets.model_config`), its PPO settings (`learner.PPOConfig`: row_len,
micro_rows), optimizer and trainer mesh (`TrainConfig.mesh`; fsdp over every chip when it binds
none) are read from its gin bindings; the optimizer step and the proximal log-prob pass are
compiled by libtpu for the named slice from abstract shapes (rl/aot.py: no weights, no data)
and their per-chip memory is set beside the chip's HBM and `asearcher plan`'s formula
(rl/plan_memory.py) for the same rows. The topology defaults to the recipe's own trainer slice
(`planning.plan.chip` and `plan_memory.TrainerShape.chips`). Prints a short report, then one
JSON line; exits 0 when the train step fits, 1 when it does not.

Flags: --topology NAME, --row_len N (the recipe's PPOConfig.row_len otherwise), --attention
dense|flash|splash|auto (the model's own otherwise; resolved for TPU), --rows_per_shard N,
--serving (one serving replica's paged decode and prefill steps instead, on its own slice); or
bind `compiling.compile_recipe.*` as for any subcommand. libtpu must be installed (requirements
.txt installs it on Linux x86-64); without a TPU attached the command runs JAX on the CPU with
libtpu's metadata lookups silenced (asearcher_jax/tpu_env.py), set before jax is imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import gin

from asearcher_jax.apps.train_config import TrainConfig
from asearcher_jax.errors import ConfigValueError
from asearcher_jax.model import presets, steps
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.model.sharding import MeshConfig
from asearcher_jax.rl import aot
from asearcher_jax.rl import plan_memory as mem
from asearcher_jax.rl.learner import PPOConfig

# Flags of the positional form and the compile_recipe argument each sets.
FLAGS = {"--topology": str, "--row_len": int, "--attention": str, "--rows_per_shard": int}


def split_flags(argv: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
  """`RECIPE.gin --topology v5p-32 ...` -> (the argv main parses, compile_recipe's overrides)."""
  parser = argparse.ArgumentParser(prog="asearcher compile", add_help=False)
  for flag, kind in FLAGS.items():
    parser.add_argument(flag, type=kind, default=None)
  parser.add_argument("--serving", action="store_true", default=None)
  known, rest = parser.parse_known_args(list(argv))
  return rest, {k: v for k, v in vars(known).items() if v is not None}


def _bound(configurable: Any, default: Any) -> Any:
  """What the parsed gin config builds for `configurable`; `default` when nothing binds it."""
  try:
    return gin.get_configurable(configurable)()
  except ValueError:  # not registered: no file imports or binds it
    return default


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
  """What a compile takes from a recipe's bindings."""

  # The policy's architecture.
  model: ModelConfig
  # The learner's PPO settings (row_len, micro_rows).
  ppo: PPOConfig
  # AdamW (its state's shapes).
  optimizer: steps.OptimizerConfig
  # The trainer's mesh over the slice's chips.
  mesh: MeshConfig
  # The planner's trainer shape (chips, live blocks) and target chip.
  trainer: mem.TrainerShape
  chip: str
  # The planner's serving replica (chips, slots, pages) and trajectory lengths.
  serving: mem.ServingShape = dataclasses.field(default_factory=mem.ServingShape)
  lengths: mem.LengthDistribution = dataclasses.field(default_factory=mem.LengthDistribution)


def recipe_from_gin(model: ModelConfig | None = None) -> Recipe:
  """The parsed recipe's model (unless given), PPO, optimizer, mesh and plan (gin must be
  parsed)."""
  model = model or _bound(presets.model_config, None)
  if model is None:
    raise ConfigValueError("the recipe binds no policy (presets.model_config)")
  config = _bound(TrainConfig, TrainConfig())
  try:
    # By name: this module may not import apps.plan (plan compiles through it: a cycle).
    chip = mem.chip_name(gin.get_bindings("plan").get("chip", "v5p"))
  except ValueError:
    chip = "v5p"
  return Recipe(
    model=model, ppo=config.ppo(), optimizer=config.learner.optimizer,
    mesh=config.mesh or MeshConfig(), trainer=_bound(mem.TrainerShape, mem.TrainerShape()),
    chip=chip, serving=_bound(mem.ServingShape, mem.ServingShape()),
    lengths=_bound(mem.LengthDistribution, mem.LengthDistribution()),
  )  # fmt: skip


def recipe_slice(recipe: Recipe) -> str:
  """The recipe's trainer slice: its plan's chip with `TrainerShape.chips` chips."""
  return aot.slice_for(recipe.chip, recipe.trainer.chips).name


def report(
  recipe: Recipe,
  *,
  topology: str | None = None,
  row_len: int | None = None,
  attention: str | None = None,
  rows_per_shard: int | None = None,
  score: bool = True,
) -> dict[str, Any]:
  """The compile report of `recipe` (see `aot.compile_for_slice`) with the planner's trainer
  figure for the same slice, rows and row length (`planner_gib_per_chip`)."""
  name = topology or recipe_slice(recipe)
  s = aot.tpu_slice(name)
  ppo = recipe.ppo if row_len is None else dataclasses.replace(recipe.ppo, row_len=row_len)
  out = aot.compile_for_slice(
    recipe.model, name, attention=attention, ppo=ppo, optimizer=recipe.optimizer,
    mesh=recipe.mesh, rows_per_shard=rows_per_shard, score=score,
  )  # fmt: skip
  shards = out["mesh"]["data"] * out["mesh"]["fsdp"]
  micro = out["micro_batch_rows"] or out["rows"]
  shape = dataclasses.replace(
    recipe.trainer, chips=s.chips, row_len=ppo.row_len, micro_rows=max(micro // shards, 1)
  )
  planned = mem.trainer_memory(recipe.model, shape)["total"]
  out["planner_gib_per_chip"] = round(planned / aot.GIB, 3)
  out["planner_live_blocks"] = shape.live_blocks
  return out


def serving_report(
  recipe: Recipe, *, topology: str | None = None, prefill_tokens: int = 2048
) -> dict[str, Any]:
  """One serving replica of `recipe` compiled for its slice (`aot.compile_serving`): decode
  and prefill steps of the paged engine at the plan's slots and pages (a fixed-cache plan is
  compiled at the pages its slots need on average, `plan_memory.pages_for`), with the
  planner's figures beside: HBM per chip and the live sequences the pages hold."""
  shape = recipe.serving
  name = topology or aot.slice_for(recipe.chip, shape.chips).name
  s = aot.tpu_slice(name)
  pages = shape.pages or mem.pages_for(shape.slots, recipe.lengths, shape.page_size)
  paged = dataclasses.replace(shape, chips=s.chips, pages=pages)
  out = aot.compile_serving(
    recipe.model, devices=aot.slice_devices(s), hbm_gib=s.hbm_gib, slots=shape.slots,
    pages=pages, page_size=shape.page_size,
    pages_per_seq=-(-shape.context // shape.page_size), prefill_tokens=prefill_tokens,
  )  # fmt: skip
  return {
    "topology": s.name,
    "topology_desc": s.topology,
    **out,
    "live_sequences_per_replica": round(mem.live_sequences(paged, recipe.lengths), 1),
    "live_context_tokens": round(mem.live_context(recipe.lengths)),
    "planner_gib_per_chip": round(mem.serving_memory(recipe.model, paged)["total"] / aot.GIB, 3),
  }


def _print_serving(r: dict[str, Any]) -> None:
  print(f"serving replica on {r['topology']} ({r['chips']} chips): {r['slots']} slots, "
        f"{r['pages']} pages of {r['page_size']} ({r['kv_cache_gib_per_chip']} GiB of KV a chip, "
        f"{r['kv_heads_per_chip']} KV head(s) a chip), {r['live_sequences_per_replica']} live "
        f"sequences at {r['live_context_tokens']} tokens each")  # fmt: skip
  for name in ("decode", "prefill"):
    p = r[name]
    bound = ">= " if p.get("total_is_lower_bound") else ""
    print(f"{name}: {bound}{p['total_gib']} GiB per chip of {r['hbm_gib_per_chip']} "
          f"(temporaries {p['temp_bytes'] / aot.GIB:.2f}) fits={'yes' if p['fits'] else 'NO'}, "
          f"compiled in {p['compile_s']} s")  # fmt: skip
  print(f"planner (asearcher plan): {r['planner_gib_per_chip']} GiB per chip")


def compile_recipe(
  *,
  model: ModelConfig | None = None,
  topology: str | None = None,
  row_len: int | None = None,
  attention: str | None = None,
  rows_per_shard: int | None = None,
  score: bool = True,
  serving: bool = False,
) -> int:
  """Compiles the recipe's learner for a TPU slice; prints the report and one JSON line.

  Args:
    model: The policy's architecture; None: the recipe's presets.model_config (its POLICY).
    topology: TPU slice (v4-8 .. v4-128, v5e-4 .. v5e-256, v5p-8 .. v5p-128, v6e-4 ..
      v6e-256); None: the recipe's trainer slice (planning.plan.chip, TrainerShape.chips).
    row_len: Tokens per packed row; None: the recipe's PPOConfig.row_len.
    attention: dense, flash, splash or auto, resolved for TPU; None: the model's own.
    rows_per_shard: Minibatch rows per data shard; None: two micro-batches (2 x micro_rows).
    score: Also compile the proximal log-prob pass.
    serving: Compile one serving replica's paged decode and prefill steps instead
      (`serving_report`; topology None: the replica's slice, planning.plan.chip with
      ServingShape.chips); exits 0 when both fit.
  """
  aot.require_libtpu()
  if serving:
    r = serving_report(recipe_from_gin(model), topology=topology)
    _print_serving(r)
    print(json.dumps(r))
    return 0 if r["decode"]["fits"] and r["prefill"]["fits"] else 1
  r = report(recipe_from_gin(model), topology=topology, row_len=row_len, attention=attention,
             rows_per_shard=rows_per_shard, score=score)  # fmt: skip
  print(f"{r['params_b']} B parameters on {r['topology']} ({r['topology_desc']}, {r['chips']} "
        f"chips, mesh {r['mesh']}), {r['rows']} rows x {r['row_len']} tokens "
        f"(micro-batches of {r['micro_batch_rows']}), attention {r['attention']}")  # fmt: skip
  for name in ("train", "score"):
    if name not in r:
      continue
    p = r[name]
    flops = "?" if p["flops_per_chip"] is None else f"{p['flops_per_chip'] / 1e12:.2f} TFLOP"
    bound = ">= " if p.get("total_is_lower_bound") else ""
    print(f"{name}: {bound}{p['total_gib']} GiB per chip of {r['hbm_gib_per_chip']} "
          f"(arguments {p['argument_bytes'] / aot.GIB:.2f}, temporaries "
          f"{p['temp_bytes'] / aot.GIB:.2f}) fits={'yes' if p['fits'] else 'NO'}, {flops} per "
          f"chip, compiled in {p['compile_s']} s" + (f"; {p['error']}" if "error" in p else ""))  # fmt: skip
  print(
    f"planner (asearcher plan): {r['planner_gib_per_chip']} GiB per chip "
    f"(live_blocks={r['planner_live_blocks']})"
  )
  print(json.dumps(r))
  return 0 if r["train"]["fits"] else 1


# Given a training recipe, which binds train, plan and serving but not this (gin_config.check).
compile_recipe.reads_recipes = True
