"""The worker helper of the multi-process tests (tests/processes.py) fails loudly and leaves nothing
running: a worker past the deadline is killed and named, a failed one is named with its logs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.processes import finish


def _python(code: str) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-c", code])


def test_workers_that_exit_cleanly_pass():
  procs = [_python("pass"), _python("pass")]
  finish(procs, timeout=60, what="workers", logs=lambda: "")
  assert [p.returncode for p in procs] == [0, 0]


def test_a_worker_past_the_deadline_is_killed_and_named():
  procs = [_python("pass"), _python("import time; time.sleep(600)")]
  with pytest.raises(pytest.fail.Exception, match=r"(?s)sft x 2 still running after 2 s.*the log"):
    finish(procs, timeout=2, what="sft x 2", logs=lambda: "the log")
  assert procs[1].returncode is not None and procs[1].returncode < 0  # SIGKILLed, reaped


def test_a_failed_worker_fails_the_test_with_its_logs():
  procs = [_python("raise SystemExit(3)")]
  with pytest.raises(AssertionError, match=r"(?s)workers failed.*worker_0 said"):
    finish(procs, timeout=60, what="workers", logs=lambda: "worker_0 said")
