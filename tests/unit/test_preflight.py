"""`--check` as a preflight: each mistake that used to pass as "configuration ok" (a recipe whose
model, questions or index are on no disk here, an unknown topology or dataset, a slice spelled
the other way) is exit 2 with one line naming the binding or the path; what passes says what
was checked. The help of a recipe shows its bindings, and a misspelt name suggests the nearest
one."""

from __future__ import annotations

import gzip
import json

import gin
import pytest

from asearcher_jax import main, tpu_env
from asearcher_jax.apps import preflight
from asearcher_jax.rl import aot
from asearcher_jax.rl import plan_memory as mem
from launch.spec import SpecError, gcloud_type, parse_accelerator

RECIPE_7B = "gin/experiments/asearcher_local_qwen2_5_7b.gin"
TINY = "gin/overlays/recipe_tiny.gin"


@pytest.fixture(autouse=True)
def _clear_gin():
  gin.clear_config()
  yield
  gin.clear_config()


def check(argv: list[str], capsys) -> tuple[int, list[str], str]:
  """(exit status, stdout lines, the one stderr line) of `asearcher ARGV`."""
  rc = main.main(argv)
  out, err = capsys.readouterr()
  assert err.count("\n") <= 1, err  # one line, never a traceback
  return rc, out.splitlines(), err.strip()


def test_a_7b_recipe_without_its_model_questions_or_index_names_the_missing_path(capsys, tmp_path):
  """The recipe's paths are a bucket mount of the pod; on this host none exists, and each is
  named in turn as the one before it is provided."""
  model = tmp_path / "Qwen2.5-7B"
  model.mkdir()
  questions = tmp_path / "q.jsonl"
  questions.write_text('{"question": "q", "answer": ["a"]}\n')
  steps = [
    ([], "commands.train.model_dir = '/mnt/asearcher/models/Qwen2.5-7B' does not exist"),
    ([f'MODEL_DIR="{model}"'], "commands.train.questions = '/mnt/asearcher/data/ASearcher"),
    ([f'MODEL_DIR="{model}"', f'QUESTIONS="{questions}"'],
     "commands.train.retrieval_index_dir = '/mnt/asearcher/indexes/wiki18_e5' does not exist"),
  ]  # fmt: skip
  for params, message in steps:
    argv = ["train", f"--gin_file={RECIPE_7B}", "--check", "--check_programs=none"]
    rc, out, err = check([*argv, *(f"--gin_param={p}" for p in params)], capsys)
    assert rc == 2 and out == [], (out, err)
    assert err.startswith("asearcher train: config error: gin/experiments/")
    assert message in err


def test_paths_inside_the_runs_own_output_are_made_by_the_run(tmp_path):
  outputs = [str(tmp_path / "run")]
  assert preflight._made_by_run(str(tmp_path / "run" / "warm_start" / "model"), outputs)
  assert not preflight._made_by_run(str(tmp_path / "elsewhere"), outputs)
  assert preflight.exists(str(tmp_path)) and not preflight.exists(str(tmp_path / "nope"))


def test_the_recipe_on_cpu_passes_and_says_what_was_checked(capsys):
  """With the CPU overlay (no model, the shipped questions and index) the recipe passes: its
  slices, the plan's fit and, where libtpu is installed, the trainer's rehearsal."""
  argv = ["train", f"--gin_file={RECIPE_7B}", f"--gin_file={TINY}", "--check"]
  rc, out, err = check(argv, capsys)
  assert rc == 0, err
  assert out[-1] == "asearcher train: configuration ok"
  assert "asearcher train: slices trainer v5p-32, serving v5p-8" in out
  assert any(line.startswith("asearcher train: plan fits v5p (trainer ") for line in out)
  rehearsed = [line for line in out if "rehearsal (arguments) fits v5p-32" in line]
  assert len(rehearsed) == (1 if tpu_env.libtpu_installed() else 0), out


def test_a_plan_that_does_not_fit_its_chip_is_refused(capsys):
  """The 7B recipe's serving replica on a v5e chip (16 GB): refused before any slice is paid
  for, naming the plan's binding and the part that does not fit."""
  argv = ["train", f"--gin_file={RECIPE_7B}", f"--gin_file={TINY}", "--check",
          "--gin_param=presets.model_config.name='qwen2.5-7b'",
          "--gin_param=planning.plan.chip='v5e'"]  # fmt: skip
  rc, out, err = check(argv, capsys)
  assert rc == 2 and out == []
  assert "planning.plan.chip" in err and "the plan's trainer needs" in err and "v5e" in err


def test_print_config_works_with_check(capsys):
  rc, out, _ = check(["demo", "--check", "--print_config"], capsys)
  assert rc == 0
  assert any(line.startswith("demo.run.") for line in out), out
  assert out[-1] == "asearcher demo: configuration ok"


@pytest.mark.parametrize("spelling", ["v5e-16", "v5litepod-16"])
def test_both_spellings_of_a_slice_are_accepted_by_compile_and_launch(capsys, spelling):
  rc, out, err = check(["compile", RECIPE_7B, "--topology", spelling, "--check",
                        f"--gin_file={TINY}"], capsys)  # fmt: skip
  assert rc == 0 and out[-1] == "asearcher compile: configuration ok", err
  assert aot.tpu_slice(spelling) is aot.SLICES["v5e-16"]
  chip, chips, hosts = parse_accelerator(spelling, "x")
  assert (chip.name, chips, hosts) == ("v5e", 16, 4)
  assert gcloud_type(spelling) == "v5litepod-16"  # what gcloud is given either way
  assert mem.chip_name(spelling.split("-")[0]) == "v5e"  # and the planner


def test_an_unknown_topology_is_refused_by_both_commands(capsys):
  rc, out, err = check(["compile", RECIPE_7B, "--topology", "v5e-3", "--check",
                        f"--gin_file={TINY}"], capsys)  # fmt: skip
  assert rc == 2 and out == []
  assert err.startswith("asearcher compile: config error: --topology v5e-3: unknown TPU slice")
  with pytest.raises(SpecError, match="'v5e-3' is not a v5e slice size"):
    parse_accelerator("v5e-3", "[trainer] accelerator_type")
  rc, _, err = check(["train", f"--gin_file={RECIPE_7B}", f"--gin_file={TINY}", "--check",
                      "--gin_param=planning.plan.chip='v9z'"], capsys)  # fmt: skip
  assert rc == 2 and "planning.plan.chip: unknown chip 'v9z'" in err


def test_an_unknown_dataset_is_refused(capsys, tmp_path):
  rc, out, err = check(
    ["eval", "--check", "--gin_param=commands.EvalData.datasets=['hotpotqa_train100', 'nq3000']"],
    capsys,
  )
  assert rc == 2 and out == []
  assert "commands.EvalData.datasets: unknown dataset 'nq3000'" in err
  assert err.startswith("asearcher eval: config error: --gin_param=")
  own = tmp_path / "mine.jsonl.gz"
  with gzip.open(own, "wt") as f:
    f.write(json.dumps({"question": "q", "answer": ["a"]}) + "\n")
  rc, out, err = check(["eval", "--check", f"--gin_param=commands.EvalData.datasets=['{own}']"],
                       capsys)  # fmt: skip
  assert rc == 0, err
  assert "asearcher eval: 1 dataset(s) known" in out


def test_a_missing_gs_path_is_named(capsys, monkeypatch):
  """gs:// paths go through etils.epath; a store that cannot answer is one line naming it."""

  def unreachable(path: str, timeout_s: float = 0.0) -> bool:
    raise preflight.AsearcherError(f"{path}: no answer within 30 s")

  monkeypatch.setattr(preflight, "exists", unreachable)
  rc, _, err = check(["serve-retrieval", "--check",
                      "--gin_param=serve_retrieval.serve.index_dir='gs://nowhere/index'"],
                     capsys)  # fmt: skip
  assert rc == 2
  assert (
    "serve_retrieval.serve.index_dir = 'gs://nowhere/index': gs://nowhere/index: no answer" in err
  )


def test_recipe_help_shows_the_recipes_bindings():
  text = main._help("train", [RECIPE_7B])
  assert "train_config.TrainConfig.train_steps = 200" in text  # not the smoke run's 4
  assert "(default 4)" in text
  assert "steps.OptimizerConfig.learning_rate = 5e-06" in text
  assert "commands.train.model_dir = '/mnt/asearcher/models/Qwen2.5-7B'" in text


@pytest.mark.parametrize(
  "param, suggestion",
  [
    ("train_config.TrainConfig.train_step=3", "did you mean 'train_steps'?"),
    ("train_config.TrainConfg.train_steps=3", "did you mean 'TrainConfig'?"),
    ("staleness.StalenessConfig.max_stalness=1", "did you mean 'max_staleness'?"),
  ],
)
def test_an_unknown_binding_suggests_the_nearest_name(capsys, param, suggestion):
  rc, _, err = check(["train", "--check", f"--gin_param={param}"], capsys)
  assert rc == 2 and err.endswith(f"({suggestion})"), err
