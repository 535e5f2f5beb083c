"""The executed notebooks (each executed once per session, by whichever test needs it first), over
the session's tiny run (`tiny_run`, tests/conftest.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = REPO / "notebooks"
NAMES = (
  "quickstart.ipynb",
  "trajectory_inspector.ipynb",
  "training_dashboard.ipynb",
  "evaluation_comparison.ipynb",
  "synthesis_browser.ipynb",
)
CELL_TIMEOUT_S = 600


def execute(name: str, run_dir: Path, workdir: Path):
  """Executes notebooks/<name> in a fresh kernel (cwd `workdir`, ASEARCHER_RUN_DIR=`run_dir`);
  a cell that raises fails with nbclient's CellExecutionError. Returns (notebook, seconds)."""
  import nbclient
  import nbformat

  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  env = {
    "ASEARCHER_RUN_DIR": str(run_dir),
    "MPLBACKEND": "module://matplotlib_inline.backend_inline",
  }
  old = {k: os.environ.get(k) for k in [*env, "PYTHONPATH"]}
  os.environ.update(env)
  os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), old["PYTHONPATH"]) if p)
  try:
    client = nbclient.NotebookClient(
      nb,
      timeout=CELL_TIMEOUT_S,
      kernel_name="python3",
      resources={"metadata": {"path": str(workdir)}},
    )
    t0 = time.perf_counter()
    client.execute()
    return nb, time.perf_counter() - t0
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


@pytest.fixture(scope="session")
def executed(tiny_run, tmp_path_factory):
  """name -> (executed notebook, seconds); each notebook runs at most once per session."""
  cache: dict[str, tuple] = {}

  def get(name: str):
    if name not in cache:
      cache[name] = execute(name, tiny_run, tmp_path_factory.mktemp("nb"))
    return cache[name]

  return get
