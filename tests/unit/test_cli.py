"""The command line as a user meets it: per-subcommand help generated from the code, and every
configuration mistake as one line with exit status 2, run as real processes from a directory
outside the repository."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from asearcher_jax import main
from asearcher_jax.apps import cli_help

REPO = Path(__file__).resolve().parents[2]
T = 240  # seconds: bound on each subprocess


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
  env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-m", "asearcher_jax.main", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=T)  # fmt: skip


def test_global_help_gives_one_line_per_subcommand(tmp_path):
  out = run(["--help"], tmp_path)
  assert out.returncode == 0, out.stderr
  for name in main.SUBCOMMANDS:
    (line,) = [x for x in out.stdout.splitlines() if x.split()[:1] == [name]]
    assert len(line.split()) > 3, line  # the name and what it does


def test_every_subcommand_help_names_each_parameter_of_its_config(tmp_path):
  """One process prints every subcommand's help (each --help is also run as its own process
  for two of them below); the text must name every parameter of the function and of every
  config dataclass reachable from it, with its default."""
  code = (
    "import sys\nfrom asearcher_jax import main\n"
    "for name in main.SUBCOMMANDS:\n"
    "  print('=====', name)\n  print(main._help(name, []))\n"
  )
  env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=T)  # fmt: skip
  assert out.returncode == 0, out.stderr[-2000:]
  texts = dict(part.split("\n", 1) for part in out.stdout.split("===== ")[1:])
  assert set(texts) == set(main.SUBCOMMANDS)
  for name, target in main.SUBCOMMANDS.items():
    text = texts[name]
    default = main.default_gin_file(name)
    files = cli_help.gin_includes(default, main.GIN_SEARCH_PATHS) if default else []
    names = cli_help.module_names(main._resolve(target), cli_help.file_imports(files))
    params = cli_help.parameters(main._resolve(target), names)  # named as the gin files do
    fn_selector = params[0].selector
    assert fn_selector.split(".")[-1] == target.split(":")[1]
    own = [p for p in params if p.selector == fn_selector]
    assert [p.name for p in own] == list(inspect.signature(main._resolve(target)).parameters)
    for p in params:
      assert f"{p.selector}.{p.name} = {p.default}" in text, (name, p)
      assert p.meaning and p.meaning in text, (name, p)  # every parameter says what it does
    default = main.default_gin_file(name)
    if default is not None:
      assert str(default.relative_to(REPO)) in text
  # Meanings come from the field comments and Args sections, not from a copy.
  assert "decode batch: requests decoded together" in texts["serve-model"]
  assert "Init seed of the random policy." in texts["serve-model"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Grouped:
  # Entities per type.
  people: int = 1
  places: int = 2

  works: int = 3  # A trailing comment.
  # Its own comment.
  years: int = 4
  months: int = 5

  lone: int = 6


def test_a_comment_above_consecutive_fields_means_each_of_them():
  meanings = {p.name: p.meaning for p in cli_help.parameters(_grouped)}
  assert meanings["people"] == meanings["places"] == "Entities per type."
  assert meanings["works"] == "A trailing comment."  # the blank line ended the group
  assert meanings["years"] == meanings["months"] == "Its own comment."
  assert meanings["lone"] == ""  # after a blank line: no comment of its own, none inherited
  assert meanings["config"] == "The grouped settings."


def _grouped(*, config: _Grouped = _Grouped()) -> int:
  """A subcommand-shaped function.

  Args:
    config: The grouped settings.
  """
  return 0


@pytest.mark.parametrize("name", ["index", "serve-model"])
def test_subcommand_help_as_a_process(tmp_path, name):
  out = run([name, "--help"], tmp_path)
  assert out.returncode == 0 and not out.stderr.strip(), out.stderr
  assert out.stdout.startswith(f"usage: asearcher {name}")
  assert "gin/runs/" in out.stdout


GIN_HEAD = "from __gin__ import dynamic_registration\nfrom asearcher_jax.apps import index\n"

CASES = {
  "syntax": (GIN_HEAD + "index.BM25Config.k1 = [1\n", [], "bad.gin:3", "EOF"),
  "unknown_selector": (GIN_HEAD + "index.build_indx.k1 = 1\n", [], "bad.gin:3", "build_indx"),
  "unknown_module": (
    "from __gin__ import dynamic_registration\nfrom asearcher_jax.apps import indx\n",
    [],
    "bad.gin:2",
    "asearcher_jax.apps.indx",
  ),
  "unknown_parameter": (GIN_HEAD + "index.build_index.kk = 1\n", [], "bad.gin:3", "'kk'"),
  "wrong_type_in_file": (
    GIN_HEAD + "index.build_index.force = False\nindex.BM25Config.k1 = 'high'\n",
    [],
    "bad.gin:4",
    "BM25Config.k1 = 'high': expected float",
  ),
  "wrong_type_in_flag": (
    GIN_HEAD,
    ["index.build_index.force = 3"],
    "--gin_param='index.build_index.force = 3'",
    "expected bool",
  ),
  "invalid_value": (
    "from __gin__ import dynamic_registration\nfrom asearcher_jax.apps import serve_model\n"
    "from asearcher_jax.serving import driver\n"
    "serve_model.serve.driver = @driver.DriverConfig()\n"
    "driver.DriverConfig.kv_on_update = 'sometimes'\n",
    [],
    "bad.gin:5",
    "kv_on_update must be one of",
  ),
  "flag_syntax": (GIN_HEAD, ["index.BM25Config.k1 = (1"], "--gin_param='index.BM25Config.k1", ""),
  "flag_unknown_class": (GIN_HEAD, ["index.BM25Confg.k1 = 1"], "--gin_param=", "BM25Confg"),
  "missing_file": (None, [], "nope.gin", "Unable to open file"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_error_is_one_line_with_exit_2(tmp_path, case):
  text, params, where, fragment = CASES[case]
  if text is not None:
    (tmp_path / "bad.gin").write_text(text)
  command = "serve-model" if case == "invalid_value" else "index"
  args = [command, "--gin_file", "bad.gin" if text is not None else "nope.gin"]
  args += [f"--gin_param={p}" for p in params]
  out = run(args, tmp_path)
  assert out.returncode == 2, (out.stdout, out.stderr)
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1, out.stderr
  assert "Traceback" not in out.stderr
  assert lines[0].startswith(f"asearcher {command}: config error: "), lines[0]
  assert where in lines[0] and fragment in lines[0], lines[0]


def test_missing_required_parameter_is_a_config_error(tmp_path):
  (tmp_path / "empty.gin").write_text(
    "from __gin__ import dynamic_registration\nfrom asearcher_jax.apps import sft\n"
  )
  out = run(["sft", "--gin_file", "empty.gin"], tmp_path)
  assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
  assert "sft.trajectories is required" in out.stderr


def test_default_includes_resolve_outside_the_repository(tmp_path):
  """`demo`'s default gin file includes gin/models/qwen2_tiny.gin; run from elsewhere, nothing
  logs "Path not found" and the configuration resolves (shown by --print_config of a bad flag
  reaching the type check, after the includes were read)."""
  out = run(["demo", "--gin_param=demo.run.train_steps = 'x'"], tmp_path)
  assert out.returncode == 2, out.stderr
  assert "Path not found" not in out.stderr and "ERROR" not in out.stderr
  assert "demo.run.train_steps = 'x': expected int" in out.stderr
