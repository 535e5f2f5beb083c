"""The learner compiled ahead of time for TPU slices by libtpu on this CPU host (rl/aot.py,
`asearcher compile`): the per-chip report of a tiny model on v5p-8, a program too big for its
slice reported as not fitting, the slice table, and a quiet libtpu on a host without a TPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asearcher_jax import tpu_env
from asearcher_jax.errors import ConfigValueError
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.rl import aot
from asearcher_jax.rl.learner import PPOConfig

REPO = Path(__file__).resolve().parents[2]
needs_libtpu = pytest.mark.skipif(not tpu_env.libtpu_installed(), reason="libtpu not installed")


def test_slices_name_their_chips_topology_and_hbm():
  s = aot.tpu_slice("v5p-32")
  assert (s.chips, s.topology, s.chips_per_host, s.hbm_gib) == (16, "v5p:2x2x4", (2, 2, 1), 95.0)
  assert aot.tpu_slice("v4-8").chips == 4 and aot.tpu_slice("v4-8").chip_config == "megacore"
  assert (aot.tpu_slice("v6e-8").topology, aot.tpu_slice("v6e-8").chips_per_host) == (
    "v6e:2x4",
    (2, 4, 1),
  )
  assert aot.tpu_slice("v5e-16").hbm_gib == 16.0
  assert aot.slice_for("v5p", 32).name == "v5p-64"
  with pytest.raises(
    ConfigValueError, match=r"unknown TPU slice 'v5p-12' \(known: v4-8, .*v6e-256"
  ):
    aot.tpu_slice("v5p-12")
  with pytest.raises(ConfigValueError, match="no known v5p slice has 3 chips"):
    aot.slice_for("v5p", 3)


def test_attention_is_resolved_for_the_target_platform_not_the_host():
  """A TPU program compiled on a CPU host gets splash for "auto"; an explicit choice stays."""
  cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                    num_heads=4, num_kv_heads=2)  # fmt: skip
  assert cfg.attention == "auto"
  assert aot.with_attention(cfg, None, "tpu").attention == "splash"
  assert aot.with_attention(cfg, None, "cpu").attention == "flash"
  assert aot.with_attention(cfg, "dense", "tpu").attention == "dense"


@needs_libtpu
def test_tiny_learner_compiles_for_v5p_8_and_reports_per_chip_memory_and_flops():
  """The benchmark's core (benchmarks/aot_compile.py) on a tiny model: both programs compile for
  a 4-chip v5p slice, with arguments and temporaries on every chip, the donated state aliased,
  FLOPs counted, and a fit."""
  cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1,
                    num_heads=4, num_kv_heads=2, param_dtype="bfloat16", dtype="bfloat16")  # fmt: skip
  r = aot.compile_for_slice(cfg, "v5p-8", ppo=PPOConfig(row_len=128))
  assert (r["topology"], r["chips"], r["mesh"]["fsdp"], r["rows"]) == ("v5p-8", 4, 4, 4)
  assert r["hbm_gib_per_chip"] == 95.0
  for name in ("train", "score"):
    p = r[name]
    assert p["argument_bytes"] > 0 and p["temp_bytes"] > 0 and p["flops_per_chip"] > 0, name
    assert p["fits"] and 0 < p["total_bytes"] < 95 * aot.GIB, name
  train = r["train"]
  assert train["alias_bytes"] > 0  # the state is donated: its buffers are the new state's
  # fp32 master weights + two Adam moments, sharded over 4 chips, are most of the arguments
  state_bytes = 3 * 4 * cfg.num_params() / 4
  assert state_bytes <= train["argument_bytes"] <= 1.5 * state_bytes + 4 * 7 * 128 * 4
  assert r["score"]["runs"] is False  # one minibatch: pi_prox comes from the step's forward


@needs_libtpu
def test_a_program_too_big_for_the_slice_is_reported_as_not_fitting():
  """4.3 B parameters with AdamW over the 4 chips of a v5e-4 (16 GiB each): the TPU compiler
  refuses it (RESOURCE_EXHAUSTED); the report says it does not fit and gives a lower bound."""
  cfg = ModelConfig(vocab_size=2**20, hidden_size=2048, intermediate_size=128, num_layers=1,
                    num_heads=4, num_kv_heads=2)  # fmt: skip
  r = aot.compile_for_slice(cfg, "v5e-4", ppo=PPOConfig(row_len=128), score=False)
  train = r["train"]
  assert train["fits"] is False and train["total_is_lower_bound"]
  assert "RESOURCE_EXHAUSTED" in train["error"]
  # fp32 weights + two moments, a quarter per chip (12 GiB), then the compiler's temporaries
  assert train["argument_bytes"] >= 3 * 4 * cfg.num_params() / 4
  assert train["total_bytes"] > train["argument_bytes"] and train["total_bytes"] > 16 * aot.GIB


def test_quiet_libtpu_sets_only_what_is_missing_and_nothing_with_a_tpu(monkeypatch):
  monkeypatch.setattr(tpu_env, "libtpu_installed", lambda: True)
  monkeypatch.setattr(tpu_env, "tpu_attached", lambda: False)
  env = {"TPU_WORKER_HOSTNAMES": "h0,h1"}
  assert tpu_env.quiet_libtpu(env)
  assert env == {"TPU_WORKER_HOSTNAMES": "h0,h1", "TPU_ACCELERATOR_TYPE": "v5p-8",
                 "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}  # fmt: skip
  assert not tpu_env.quiet_libtpu(env := {"JAX_PLATFORMS": "cpu"}) and env == {
    "JAX_PLATFORMS": "cpu"
  }
  monkeypatch.setattr(tpu_env, "tpu_attached", lambda: True)
  env = {}
  assert not tpu_env.quiet_libtpu(env) and env == {}
  tpu_env.for_ahead_of_time(env)
  assert env == {}  # a real TPU: its own topology, its own backend


@needs_libtpu
def test_asearcher_starts_quietly_without_jax_platforms_on_a_host_without_a_tpu(tmp_path):
  """libtpu is installed but no TPU is attached, JAX_PLATFORMS unset: the entry point's quieting
  leaves stderr free of libtpu's metadata-server warnings, and JAX runs on the CPU."""
  if tpu_env.tpu_attached():
    pytest.skip("a TPU is attached")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS" and not k.startswith("TPU_")}
  env["PYTHONPATH"] = str(REPO)
  code = (
    "from asearcher_jax import tpu_env\ntpu_env.quiet_libtpu()\n"
    "import jax\nprint(jax.devices()[0].platform)\n"
  )
  out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["cpu"]
  assert "could not determine" not in out.stderr and "TPU_WORKER_HOSTNAMES" not in out.stderr
  out = subprocess.run([sys.executable, "-m", "asearcher_jax.main", "--help"], env=env,
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip
  assert out.returncode == 0 and "compile" in out.stdout
  assert out.stderr == ""


@needs_libtpu
@pytest.mark.slow
def test_asearcher_compile_reads_a_recipe_and_compiles_for_its_trainer_slice(capsys):
  """`asearcher compile RECIPE.gin`: the 7B recipe's mesh and plan with the tiny overlay's
  policy, compiled for the recipe's own trainer slice (v5p, 16 chips: v5p-32) at a given row
  length; the report's last line is JSON, beside the planner's figure; exit 0 (it fits)."""
  from asearcher_jax import main

  code = main.main([
    "compile", "gin/experiments/asearcher_local_qwen2_5_7b.gin",
    "--gin_file", "gin/overlays/recipe_tiny.gin", "--row_len", "128", "--attention", "dense",
  ])  # fmt: skip
  lines = capsys.readouterr().out.strip().splitlines()
  assert code == 0, lines
  r = json.loads(lines[-1])
  assert (r["topology"], r["chips"], r["mesh"]["fsdp"], r["row_len"]) == ("v5p-32", 16, 16, 128)
  assert r["train"]["fits"] and r["train"]["flops_per_chip"] > 0
  assert r["planner_gib_per_chip"] > 0 and r["planner_live_blocks"] == 1
  assert any(line.startswith("planner (asearcher plan)") for line in lines)


@needs_libtpu
@pytest.mark.slow
def test_plan_takes_the_trainer_memory_from_the_compile_when_asked(capsys):
  """`asearcher plan RECIPE --gin_param=planning.plan.trainer_from_compile=True`: the trainer's
  total per chip is the compiled one (the formula's kept beside it), and the plan says so."""
  from asearcher_jax import main

  argv = ["plan", "gin/experiments/asearcher_local_qwen2_5_7b.gin",
          "--gin_file", "gin/overlays/recipe_tiny.gin",
          "--gin_param", "plan_memory.TrainerShape.row_len = 128"]  # fmt: skip
  main.main(argv)
  formula = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  main.main([*argv, "--gin_param", "planning.plan.trainer_from_compile = True"])
  compiled = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert formula["trainer_memory_source"].startswith("formula")
  assert compiled["trainer_memory_source"].startswith("compile (v5p-32, splash attention)")
  t = compiled["trainer_gb_per_chip"]
  assert t["formula_total"] == formula["trainer_gb_per_chip"]["total"]
  assert t["total"] > 0 and t["total"] != t["formula_total"]


@needs_libtpu
def test_asearcher_train_refuses_a_learner_too_big_for_its_devices_before_it_starts():
  """`apps.train.check_fit` (run by `build_run` on accelerators, before the engine or the
  learner's weights exist): the same tiny learner compiled for a v5p-8's devices passes at the
  chip's 95 GiB and is refused in one line at 1 MiB."""
  from asearcher_jax.apps import train as train_app
  from asearcher_jax.apps.train_config import LearnerConfig, TrainConfig
  from asearcher_jax.errors import AsearcherError

  cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1,
                    num_heads=4, num_kv_heads=2, param_dtype="bfloat16", dtype="bfloat16")  # fmt: skip
  config = TrainConfig(learner=LearnerConfig(ppo=PPOConfig(row_len=128, temperature=1.0)))
  devices = aot.slice_devices(aot.tpu_slice("v5p-8"))
  report = train_app.check_fit(config, cfg, devices, 95 * aot.GIB)
  assert report["train"]["fits"] and report["chips"] == 4
  with pytest.raises(AsearcherError, match=r"train step needs .* GiB a device .* 4 x .* has 0\.0"):
    train_app.check_fit(config, cfg, devices, 2**20)


@pytest.mark.slow
def test_tiny_paged_serving_step_compiles_for_v5p_8_with_its_heads_split():
  """A serving replica's decode and prefill steps (ragged paged attention, the Pallas TPU kernel)
  compile for the 4 chips of a v5p-8 with explicit block sizes; 2 KV heads over 4 chips are
  duplicated, so each chip's cache is one head (a quarter of the duplicated cache), donated."""
  cfg = ModelConfig(vocab_size=512, hidden_size=512, intermediate_size=256, num_layers=1,
                    num_heads=4, num_kv_heads=2, param_dtype="bfloat16", dtype="bfloat16")  # fmt: skip
  s = aot.tpu_slice("v5p-8")
  r = aot.compile_serving(cfg, devices=aot.slice_devices(s), hbm_gib=s.hbm_gib, slots=8,
                          pages=64, page_size=16, pages_per_seq=8, prefill_tokens=64)  # fmt: skip
  assert (r["chips"], r["kv_repeat"], r["kv_heads_per_chip"]) == (4, 2, 1)
  pool = 64 * 16 * 2 * 128 * 2  # pages x page_size x (k, v) x head_dim x bf16, one head a chip
  assert r["kv_cache_gib_per_chip"] == round(pool / aot.GIB, 3)
  for name in ("decode", "prefill"):
    p = r[name]
    assert p["fits"] and p["alias_bytes"] >= pool, name  # the cache updated in place
    assert p["argument_bytes"] >= pool + 2 * cfg.num_params() / 4, name


def test_compile_serving_flag_selects_the_serving_programs():
  from asearcher_jax.apps import compile as compiling

  rest, overrides = compiling.split_flags(["gin/experiments/x.gin", "--serving", "--topology",
                                           "v5p-8"])  # fmt: skip
  assert rest == ["gin/experiments/x.gin"] and overrides == {"serving": True, "topology": "v5p-8"}
  assert compiling.split_flags(["x.gin"])[1] == {}


def test_engine_compiler_leaves_no_program_in_jax_caches():
  """A rehearsal compiles a whole warm-up in one process: each program's module and executable
  must be released once reported, not kept in jax's caches until the process ends."""
  import jax
  import jax.numpy as jnp
  from jax._src.interpreters import pxla

  compile_ = aot.engine_compiler(aot.GIB)
  for n in (8, 16, 32):
    lowered = jax.jit(lambda x: jnp.sin(x) @ x.T).lower(jax.ShapeDtypeStruct((n, n), jnp.float32))
    compiled, report = compile_(lowered, ())
    assert report["fits"] and report["total_bytes"] >= 2 * n * n * 4  # the argument and output
    assert compiled.output_shardings is not None  # what the engine reads after the report
    assert pxla._cached_compilation.cache_info().currsize == 0
    assert pxla._cached_lowering_to_hlo.cache_info().currsize == 0
