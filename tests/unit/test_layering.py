"""The package layering (.importlinter) holds, and `lint-imports` really catches a forbidden import.

The second test lints a copy of the package with one upward import added: if the contracts stopped
catching it (a contract dropped, a layer renamed), CI's own lint run would be passing vacuously.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
  env = {**os.environ, "PYTHONPATH": str(pythonpath)}
  return subprocess.run(
    [str(LINT), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
  )


def _copy_package(dest: Path) -> Path:
  shutil.copytree(
    ROOT / "asearcher_jax",
    dest / "asearcher_jax",
    ignore=shutil.ignore_patterns("assets", "__pycache__"),
  )
  for root in ("launch", "harness"):  # the other root packages .importlinter names
    shutil.copytree(ROOT / root, dest / root, ignore=shutil.ignore_patterns("__pycache__"))
  shutil.copy(ROOT / ".importlinter", dest / ".importlinter")
  return dest


def _layers() -> list[str]:
  config = configparser.ConfigParser()
  config.read(ROOT / ".importlinter")
  names = config["importlinter:contract:layers"]["layers"].split()
  return [n.removeprefix("asearcher_jax.") for n in names if n != "|"]


def test_every_top_level_module_has_a_layer():
  """A new package or module outside the layers contract would be free to import anything."""
  top = {p.stem for p in (ROOT / "asearcher_jax").glob("*.py") if p.stem != "__init__"}
  top |= {p.parent.name for p in (ROOT / "asearcher_jax").glob("*/__init__.py")}
  layers = _layers()
  assert len(layers) == len(set(layers)) and {"main", "apps", "model", "errors"} <= set(layers)
  assert sorted(top - set(layers)) == [], "add them to .importlinter's layers"
  assert sorted(set(layers) - top) == [], "layers that name nothing in asearcher_jax/"


def test_the_package_keeps_its_layers():
  out = _lint(ROOT, ROOT)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "0 broken" in out.stdout


@pytest.mark.parametrize(
  ("module", "forbidden", "contract"),
  [
    ("serving/types.py", "from asearcher_jax.rl import reward", "Serving imports no RL"),
    ("model/config.py", "from asearcher_jax.serving import types", "The model knows nothing"),
    ("agent/base.py", "from asearcher_jax.model import transformer", "Agents talk to a generation"),
    ("tools/budget.py", "from asearcher_jax.apps import train", "Nothing but main imports apps"),
    ("data/qa.py", "from asearcher_jax.synthwiki import world", "Package layers"),
    ("rl/episodes.py", "from asearcher_jax.views import runs", "Package layers"),
    ("plotting.py", "from asearcher_jax.evaluation import report", "Package layers"),
    ("apps/sweep.py", "import launch.cli", "The library never imports launch/"),
    ("rl/audit.py", "from harness import faults", "The library never imports harness/"),
  ],
)
def test_a_forbidden_import_breaks_the_lint(tmp_path, module, forbidden, contract):
  copy = _copy_package(tmp_path)
  target = copy / "asearcher_jax" / module
  target.write_text(target.read_text() + f"\n{forbidden}  # added by the test\n")
  out = _lint(copy, copy)
  assert out.returncode != 0, out.stdout
  broken = [line for line in out.stdout.splitlines() if line.endswith("BROKEN")]
  assert any(line.startswith(contract) for line in broken), out.stdout
