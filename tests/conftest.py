"""Test-session setup shared by every test.

XLA_FLAGS must be set before jax is imported anywhere: 8 fake CPU devices let mesh tests run the
same sharded code a TPU slice would. Tests never touch the network.

One persistent JAX compilation cache for the session, inherited by every subprocess the tests
start (`asearcher train` lives, sweep points, launched roles): the same tiny programs compiled once
instead of once per process, as an operator's restarts would.
"""

import atexit
import itertools
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _own_temp_dir(var: str, prefix: str) -> None:
  """Points `var` at a fresh directory removed at exit, unless the user set it."""
  if var in os.environ and os.environ.get(f"{var}_FROM_TESTS") != "1":
    return
  path = tempfile.mkdtemp(prefix=prefix)
  os.environ[var], os.environ[f"{var}_FROM_TESTS"] = path, "1"
  atexit.register(shutil.rmtree, path, ignore_errors=True)


# Set once in the controlling process, so pytest-xdist workers share the compilation cache. Every
# compile is cached (the tests' programs are small: most compile in 0.02-1 s, and the same ones
# recur across tests and processes). No size bound: with one, JAX lists the whole directory under a
# file lock on every write (~10 ms each with a thousand entries). Without the lock a reader that
# meets a half-written entry fails to decompress it, warns and compiles (jax/_src/compiler.py).
if os.environ.get("PYTEST_XDIST_WORKER") is None:
  _own_temp_dir("JAX_COMPILATION_CACHE_DIR", "asearcher-test-jax-cache-")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# One ASEARCHER_HOME per test process (per xdist worker): the default index is never built by two
# workers into one directory at once, and the user's ~/.cache is never touched.
_own_temp_dir("ASEARCHER_HOME", "asearcher-test-home-")


# Tests that use the session's `tiny_run`, by node id: they run on one xdist worker, so the
# CI-size quickstart is built once. (pytest-xdist 3.8's `xdist_group` marks do nothing under
# pytest 9: it renames node ids through an attribute pytest 9 no longer reads.) The collection hook
# below fails the session if a test uses `tiny_run` outside these.
TINY_RUN_TESTS = (
  "tests/notebooks/",
  "tests/apps/test_pipeline_e2e.py::test_quickstart_ci_size_trains_on_accepted_groups_and_reports",
  "tests/apps/test_plan_sweep.py::test_sweep_of_the_ci_sized_quickstart",
  "tests/apps/test_export.py::test_export_of_the_quickstart_run_is_its_newest_checkpoint",
)


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects: the marks below count there
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
  """Every user of the session's `tiny_run` is slow (the CI-size quickstart it builds takes a
  minute or more); slow end-to-end tests first (two xdist workers then finish together instead
  of one running the longest test last)."""
  for item in items:
    if item.nodeid.startswith(TINY_RUN_TESTS):
      item.add_marker(pytest.mark.slow)
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order kept
  strays = [
    item.nodeid for item in items
    if "tiny_run" in getattr(item, "fixturenames", ()) and not item.nodeid.startswith(TINY_RUN_TESTS)
  ]  # fmt: skip
  if strays:
    raise pytest.UsageError(
      f"tests/conftest.py: add to TINY_RUN_TESTS (they use tiny_run): {strays}"
    )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
  """`--dist loadgroup` with the tiny_run users as one group; every other test on its own; a
  crashed worker fails its test and the run goes on (tests/scheduling.py)."""
  if config.getvalue("dist") != "loadgroup":
    return None
  from tests import scheduling

  scheduling.ONE_WORKER_PREFIXES = TINY_RUN_TESTS
  return scheduling.TinyRunOnOneWorker(config, log)


_crashed: dict[str, str] = {}  # node id -> what xdist said of the crash


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched) -> None:
  """A test whose worker died (a segfault in native code) runs once more on a fresh worker and
  is reported as a rerun, named in the summary; crashing twice fails it."""
  if crashitem in _crashed or not hasattr(sched, "mark_test_pending"):
    return
  _crashed[crashitem] = str(report.longrepr)
  sched.mark_test_pending(crashitem)
  report.outcome = "rerun"  # type: ignore[assignment]


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config):
  if report.outcome == "rerun":
    return "rerun", "R", ("RERUN", {"yellow": True})
  return None


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
  for nodeid, why in _crashed.items():
    terminalreporter.write_line(f"RERUN after a worker crash ({why}): {nodeid}", yellow=True)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
  """<root>/quickstart (a CI-size quickstart: world, evaluations before/after RL, the RL run
  with its episode export and metrics, the report) and <root>/synth (a toy synthesis run).
  ASEARCHER_TINY_RUN=<dir> reuses one built by `python -m tests.notebooks.tiny_run <dir>`."""
  prebuilt = os.environ.get("ASEARCHER_TINY_RUN")  # local iteration: a dir made by tiny_run.py
  if prebuilt:
    return Path(prebuilt)
  root = tmp_path_factory.mktemp("tiny_run")
  from tests.notebooks.tiny_run import make_tiny_run  # imports jax: after the env above

  timings = make_tiny_run(root)
  print(f"tiny run built: {timings}")
  return root


@pytest.fixture(scope="session")
def gcs_emulator():
  """A local GCS emulator for this test process, with every storage client pointed at it
  (tests/gcs_emulator.py); stopped at the end of the session."""
  from tests import gcs_emulator

  with gcs_emulator.running() as emulator:
    yield emulator


_buckets = itertools.count()


@pytest.fixture
def gcs_bucket(gcs_emulator, request) -> str:
  """A fresh bucket on the session's emulator, as its gs:// URL (`gs://t<n>-<test name>`)."""
  stem = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")
  return gcs_emulator.create_bucket(f"t{next(_buckets)}-{stem}"[:63].rstrip("-"))
