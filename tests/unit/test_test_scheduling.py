"""The suite's xdist scheduler survives a worker that crashes (tests/scheduling.py): the test it
died on runs once more, then fails if it crashes again; every other test runs once, and the
session ends instead of hanging."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CONFTEST = """
import pytest
from tests.conftest import pytest_handlecrashitem, pytest_report_teststatus, pytest_terminal_summary

@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  from tests import scheduling
  scheduling.ONE_WORKER_PREFIXES = ("test_group.py",)
  return scheduling.TinyRunOnOneWorker(config, log)
"""

CRASHING = """
import os, signal
from pathlib import Path

def test_before():
  pass

def test_segfaults():
  os.kill(os.getpid(), signal.SIGSEGV)

def test_segfaults_once():
  marker = Path(__file__).with_name("crashed-once")
  if not marker.exists():
    marker.touch()
    os.kill(os.getpid(), signal.SIGSEGV)

def test_after():
  pass
"""

GROUP = """
def test_one():
  pass

def test_two():
  pass
"""


@pytest.mark.parametrize("workers", [1, 2])
def test_a_segfaulting_test_fails_once_and_the_session_finishes(tmp_path, workers):
  (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
  (tmp_path / "test_crash.py").write_text(textwrap.dedent(CRASHING))
  (tmp_path / "test_group.py").write_text(textwrap.dedent(GROUP))
  for i in range(4):
    (tmp_path / f"test_plain_{i}.py").write_text("def test_plain():\n  pass\n")
  env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}
  env.pop("PYTEST_XDIST_WORKER", None)
  proc = subprocess.run(
    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers),
     "--dist", "loadgroup", "-o", "addopts=", "-o", "faulthandler_timeout=0", str(tmp_path)],
    cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
  )  # fmt: skip
  out = proc.stdout + proc.stderr
  assert proc.returncode == 1, out
  assert "1 failed, 9 passed, 2 rerun" in out, out
  assert out.count("FAILED test_crash.py::test_segfaults ") == 1, out
  assert "RERUN after a worker crash" in out and "test_crash.py::test_segfaults_once" in out, out
