"""Worker processes a test starts: a free loopback port for their coordinator, and waiting for all
of them under one deadline (killed either way, so no worker outlives its test)."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence

import pytest


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def kill(procs: Sequence[subprocess.Popen]) -> None:
  """SIGKILL whatever still runs, then reap every process (30 s each at most)."""
  for p in procs:
    if p.poll() is None:
      p.send_signal(signal.SIGKILL)
  for p in procs:
    p.wait(30)


def finish(
  procs: Sequence[subprocess.Popen], *, timeout: float, what: str, logs: Callable[[], str]
) -> None:
  """Waits for every process to exit within `timeout` seconds in all, kills any left, and fails
  the test (naming `what`, with `logs()`) when one was still running or exited non-zero."""
  deadline = time.monotonic() + timeout
  try:
    for p in procs:
      p.wait(max(deadline - time.monotonic(), 1))
  except subprocess.TimeoutExpired:
    pytest.fail(f"{what} still running after {timeout:g} s\n{logs()}")
  finally:
    kill(procs)
  assert [p.returncode for p in procs] == [0] * len(procs), f"{what} failed\n{logs()}"
