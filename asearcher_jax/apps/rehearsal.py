"""`asearcher rehearse --topology SLICE ROLE_ARGV...`: one launched role built exactly as its own
command line builds it, every program it compiles before its first step or first request
compiled ahead of time for its slice, on this host (libtpu's compiler; no TPU needed).

A part compiled alone proves nothing about the whole: the launch specs start `asearcher
serve-model`, `asearcher train` and `asearcher serve-retrieval` with gin files and parameters
(launch/roles.py), and what those programs compile depends on every binding on the way. So the
rehearsal does not rebuild a role from the recipe by hand. `main` parses the role's own argv as
it would to run it and calls the role's own function with a rehearsal active; the function
validates and assembles its configuration as it always does and, where it would touch devices,
hands its pieces here instead (`active()`):
  serving    the engine the server builds (its EngineConfig, its mesh over the slice's chips,
             the policy resolved from config.json as `load_policy` resolves it) as an
             `AotEngine`, whose `warmup` is the server's own warm-up: every prefill bucket,
             suffix extend and decode program, compiled instead of run;
  trainer    the learner's optimizer step and proximal pass (`aot.compile_learner`) for the
             model `train` builds (config.json's architecture, the recipe's remat and attention)
             on the trainer mesh over the whole slice;
  retrieval  no accelerator: the role runs on the CPU platform and compiles nothing for a chip.
The checkpoint directory of a role (on the bucket mount of a pod) is not on this host: its
config.json is read from the copy the package ships for each model a recipe names
(`SHIPPED_MODEL_CONFIGS`), or from the directory itself where it exists here.

Per role, one JSON line: the topology and mesh, programs the warm-up dispatches and programs
compiled (equal unless a compile failed), the largest program's HBM per chip, whether every
program fits, and the compile seconds summed (the cold start a fresh TPU VM pays; a compile
cache on the bucket pays it once).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asearcher_jax.errors import ConfigValueError

# Imported by every role's module (serve-retrieval among them), so the compiler's modules (jax,
# the model, the learner) are imported only where a rehearsal runs.
if TYPE_CHECKING:
  from asearcher_jax.model import loading
  from asearcher_jax.model.config import ModelConfig

# How much of a role a rehearsal compiles: "all" (every program its warm-up compiles: the cold
# start), "largest" (the largest program of each step: what decides the fit, in minutes) or
# "arguments" (nothing compiled: weights and caches per chip against the chip's HBM, in seconds).
PROGRAMS = ("all", "largest", "arguments")

# Where the package keeps the config.json of each model a shipped recipe names, by the name of
# the model directory the recipe binds (the Hugging Face repository's name; the base and
# instruct models share one architecture).
ASSET_MODELS = Path(__file__).resolve().parents[1] / "assets" / "models"
SHIPPED_MODEL_CONFIGS = {
  "Qwen2.5-7B": "qwen2_5_7b_instruct",
  "Qwen2.5-7B-Instruct": "qwen2_5_7b_instruct",
  "Qwen2.5-14B": "qwen2_5_14b_instruct",
  "Qwen2.5-14B-Instruct": "qwen2_5_14b_instruct",
  "QwQ-32B": "qwq_32b",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
  """What a rehearsal compiles for."""

  # The role's slice (a name of `aot.SLICES`, e.g. "v5p-8"), or "cpu" for a host with none.
  topology: str
  # One of PROGRAMS.
  programs: str = "all"

  def __post_init__(self):
    if self.programs not in PROGRAMS:
      raise ConfigValueError(
        f"rehearse --programs must be one of {PROGRAMS}, got {self.programs!r}"
      )
    if self.topology != "cpu":
      from asearcher_jax.rl import aot

      aot.tpu_slice(self.topology)  # an unknown name: one line listing the known ones


_TARGET: contextvars.ContextVar[Target | None] = contextvars.ContextVar("rehearsal", default=None)


@contextlib.contextmanager
def rehearsing(target: Target) -> Iterator[None]:
  """Makes role functions called inside hand their programs to the rehearsal."""
  token = _TARGET.set(target)
  try:
    yield
  finally:
    _TARGET.reset(token)


def active() -> Target | None:
  """The rehearsal a role function is called under, or None when it runs for real."""
  return _TARGET.get()


def model_config_dir(model_dir: str) -> str:
  """A directory here holding `model_dir`'s config.json: itself where it exists on this host,
  else the shipped copy for its model name; a ConfigValueError naming both otherwise."""
  if (Path(model_dir) / "config.json").is_file():
    return model_dir
  name = SHIPPED_MODEL_CONFIGS.get(Path(model_dir).name)
  if name is None or not (ASSET_MODELS / name / "config.json").is_file():
    raise ConfigValueError(
      f"no config.json for model_dir {model_dir!r} on this host, and the package ships none for "
      f"{Path(model_dir).name!r} (shipped: {', '.join(sorted(SHIPPED_MODEL_CONFIGS))})"
    )
  return str(ASSET_MODELS / name)


def role_model(model_dir: str | None, model: ModelConfig | None) -> ModelConfig:
  """The model a role computes with (`loading.resolve_config`, as `load_policy` resolves it),
  its "auto" attention resolved for the TPU it will run on."""
  from asearcher_jax.model import loading
  from asearcher_jax.rl import aot

  cfg = loading.resolve_config(None if model_dir is None else model_config_dir(model_dir), model)
  return aot.with_attention(cfg, None, "tpu")


def _summary(role: str, target: Target, reports: list[dict[str, Any]], warmed: int,
             extra: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
  compiled = [r for r in reports if "error" not in r or r.get("total_is_lower_bound")]
  largest = max(reports, key=lambda r: r.get("total_gib") or 0.0, default=None)
  return {
    "role": role,
    "topology": target.topology,
    "programs": target.programs,
    **extra,
    "programs_warmed": warmed,
    "programs_compiled": len(compiled),
    "hbm_gib_per_chip_max": None if largest is None else largest.get("total_gib"),
    "largest_program": None if largest is None else largest.get("name"),
    "fits": bool(compiled) and len(compiled) == warmed and all(r["fits"] for r in reports),
    "compile_s_total": round(sum(r.get("compile_s", 0.0) for r in reports), 1),
    # every program, largest first: name, GiB a chip, fits, compile seconds (and any error)
    "program_reports": [
      {k: r.get(k) for k in ("name", "total_gib", "fits", "compile_s", "error") if k in r}
      for r in sorted(reports, key=lambda r: -(r.get("total_gib") or 0.0))
    ],
  }


def serving(
  *, policy: loading.PolicyConfig, engine: Any, warmup_modes: tuple[str, ...], jetstream: bool
) -> dict[str, Any]:
  """A serving replica as `serve-model` builds it (`engine`: its EngineConfig, mesh included),
  its warm-up compiled for the rehearsal's slice."""
  from asearcher_jax.rl import aot
  from asearcher_jax.serving.engine_aot import AotEngine
  from asearcher_jax.tokenizer import Tokenizer

  target = active()
  s = aot.tpu_slice(target.topology)
  model = role_model(policy.model_dir, policy.model)
  devices = aot.slice_devices(s)
  args = aot.engine_arguments_gib(model, engine, devices)
  extra = {
    "chips": s.chips,
    "mesh": {"tensor": args["chips"]},
    "mesh_is_slice": args["chips"] == s.chips,
    "hbm_gib_per_chip": s.hbm_gib,
    "arguments_gib_per_chip": round(args["weights_gib"] + args["decode_state_gib"], 3),
    **args,
  }
  if extra["arguments_gib_per_chip"] > s.hbm_gib:  # no compile can make it fit
    what = (
      f"its weights ({args['weights_gib']} GiB) and decode state ({args['decode_state_gib']} GiB)"
    )
    report = {"name": what, "total_gib": extra["arguments_gib_per_chip"], "fits": False}
    return {**_summary("serving", target, [report], 1, extra), "programs_compiled": 0}
  if target.programs == "arguments":
    return {**_summary("serving", target, [], 0, extra), "fits": True}
  cfg = aot.largest_programs(engine) if target.programs == "largest" else engine
  eng = AotEngine(model, Tokenizer.qwen2(), cfg, devices=devices,
                  compiler=aot.engine_compiler(s.hbm_gib * aot.GIB))  # fmt: skip
  eng.warmup(modes=warmup_modes or ("sample",), jetstream=jetstream)
  reports = [{"name": f"{p.step}{p.statics}", **p.report} for p in eng.programs]
  extra["paged_attention"] = eng.paged_attention if eng.paged else None
  return _summary("serving", target, reports, eng.programs_dispatched, extra)


def trainer(*, config: Any, model_dir: str | None, model: ModelConfig | None) -> dict[str, Any]:
  """The learner `train` builds (`config`: its TrainConfig) compiled for the rehearsal's slice:
  the optimizer step and, where it runs, the proximal log-prob pass."""
  from asearcher_jax.model.sharding import MeshConfig
  from asearcher_jax.rl import aot

  target = active()
  s = aot.tpu_slice(target.topology)
  cfg = role_model(model_dir, model)
  extra = {"chips": s.chips, "hbm_gib_per_chip": s.hbm_gib, "remat_policy": cfg.remat_policy,
           "attention": cfg.attention, "params_b": round(cfg.num_params() / 1e9, 3)}  # fmt: skip
  devices = aot.slice_devices(s)
  args = aot.learner_arguments_gib(
    cfg, devices=devices, optimizer=config.learner.optimizer, mesh=config.mesh or MeshConfig()
  )
  extra |= args
  if args["train_state_gib"] > s.hbm_gib:  # no compile can make it fit
    what = f"its train state ({args['train_state_gib']} GiB)"
    report = {"name": what, "total_gib": args["train_state_gib"], "fits": False}
    return {**_summary("trainer", target, [report], 1, extra), "programs_compiled": 0}
  if target.programs == "arguments":
    return {**_summary("trainer", target, [], 0, extra), "fits": True}
  ppo = config.ppo()
  r = aot.compile_learner(
    cfg, devices=devices, hbm_gib=s.hbm_gib, ppo=ppo,
    optimizer=config.learner.optimizer, mesh=config.mesh or MeshConfig(),
    score=bool(ppo.recompute_prox and not ppo.prox_in_step),
  )  # fmt: skip
  extra |= {"mesh": r["mesh"], "rows": r["rows"], "row_len": r["row_len"]}
  reports = [{"name": name, **r[name]} for name in ("train", "score") if name in r]
  return _summary("trainer", target, reports, len(reports), extra)


def cpu_role(role: str) -> dict[str, Any]:
  """A role that needs no accelerator (it runs JAX on the CPU platform and never joins the
  TPU cluster): nothing to compile for a chip."""
  target = active()
  return {"role": role, "topology": "cpu", "programs": target.programs, "programs_warmed": 0,
          "programs_compiled": 0, "hbm_gib_per_chip_max": 0.0, "largest_program": None,
          "fits": True, "compile_s_total": 0.0}  # fmt: skip


def finish(report: dict[str, Any], t0: float) -> int:
  """Prints the role's report as one JSON line; 0 when every program fits, 1 otherwise."""
  print(json.dumps({**report, "wall_s": round(time.perf_counter() - t0, 1)}), flush=True)
  return 0 if report["fits"] else 1
