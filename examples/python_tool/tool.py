"""`<python>code</python>`: runs the model's code in a subprocess with a time and a memory limit.

The child is a fresh `python -I` (isolated: no user site, no PYTHON* environment) in an empty
temporary directory and its own session. A few lines of bootstrap set its address-space and
CPU-time limits with `resource.setrlimit` and then run the model's code (no `preexec_fn`: forking
with one is unsafe in the trainer, which has threads); the wall-clock limit is enforced here by
killing the child's process group. This bounds
runaway code; it is not a security boundary (the child can still read files and open sockets), so
run untrusted policies in a container as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
import tempfile
from typing import ClassVar

from asearcher_jax.tools.base import Tool, ToolOutput
from asearcher_jax.tools.http_retry import ToolFailure


@dataclasses.dataclass(frozen=True, kw_only=True)
class PythonToolConfig:
  """Limits of one execution and how much of its output the model sees."""

  # Seconds of wall-clock time one execution may take (then it is killed).
  timeout_s: float = 5.0
  # Address-space limit of the child in MiB (RLIMIT_AS); the interpreter itself needs ~30.
  memory_mb: int = 512
  # Characters kept of stdout and of stderr each (the tail of stderr: the traceback's end).
  max_output_chars: int = 2000
  # Executions running at once (each is a process).
  max_concurrent: int = 4
  # Interpreter that runs the code.
  python: str = sys.executable

  def __post_init__(self) -> None:
    if self.timeout_s <= 0 or self.memory_mb < 32 or self.max_output_chars < 1:
      raise ValueError(
        f"PythonToolConfig: timeout_s > 0, memory_mb >= 32 and max_output_chars >= 1, got {self}"
      )


# Runs first in the child: limits, then the model's code as __main__ (argv: MiB, CPU s, code).
_BOOT = """\
import resource, sys
mem, cpu, src = int(sys.argv[1]) * 1048576, int(sys.argv[2]), sys.argv[3]
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
del sys.argv[1:]
try:
  exec(compile(src, "<python>", "exec"), {"__name__": "__main__"})
except SystemExit:
  raise
except BaseException as e:  # the traceback from the model's code on, without this frame
  import traceback
  traceback.print_exception(type(e), e, e.__traceback__.tb_next)
  sys.exit(1)
"""


def _kill(pid: int) -> None:
  """SIGKILL to the child's whole process group (its session: whatever it spawned too)."""
  with contextlib.suppress(ProcessLookupError, PermissionError):  # it has just exited
    os.killpg(pid, signal.SIGKILL)


def _cut(text: str, n: int, *, tail: bool = False) -> str:
  if len(text) <= n:
    return text
  dropped = len(text) - n
  return f"[{dropped} chars cut]...{text[-n:]}" if tail else f"{text[:n]}...[{dropped} chars cut]"


class PythonTool(Tool):
  """Executes the argument as a Python program and shows its stdout, stderr and exit status."""

  tag: ClassVar[str] = "python"
  description: ClassVar[str] = (
    "a Python program; it runs in a fresh interpreter and you see what it prints"
  )
  result_label: ClassVar[str] = "output"
  style: ClassVar[str] = "bold yellow"

  def __init__(self, config: PythonToolConfig | None = None) -> None:
    self.config = config or PythonToolConfig()
    self._slots = asyncio.Semaphore(self.config.max_concurrent)

  async def call(self, argument: str) -> ToolOutput:
    cfg = self.config
    async with self._slots:  # waiting here is bounded by the ToolBox's per-call timeout
      with tempfile.TemporaryDirectory(prefix="python_tool_") as workdir:
        try:
          proc = await asyncio.create_subprocess_exec(
            cfg.python, "-I", "-c", _BOOT, str(cfg.memory_mb), str(int(cfg.timeout_s) + 1),
            argument,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=workdir, start_new_session=True,
            env={"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0"},
          )  # fmt: skip
        except OSError as e:  # no interpreter, no processes left: ours, not the policy's
          raise ToolFailure("python", f"cannot start {cfg.python}: {e}") from e
        timed_out = False
        try:
          async with asyncio.timeout(cfg.timeout_s):
            out, err = await proc.communicate()
        except TimeoutError:
          timed_out = True
          _kill(proc.pid)
          async with asyncio.timeout(10):
            out, err = await proc.communicate()
        finally:  # cancelled from outside (the ToolBox's own timeout): no child outlives the call
          if proc.returncode is None:
            _kill(proc.pid)
    return self._render(proc.returncode, out, err, timed_out)

  def _render(self, code: int | None, out: bytes, err: bytes, timed_out: bool) -> ToolOutput:
    n = self.config.max_output_chars
    stdout = _cut(out.decode("utf-8", "replace"), n)
    stderr = _cut(err.decode("utf-8", "replace"), n, tail=True)
    if timed_out:
      status = f"killed: exceeded the time limit of {self.config.timeout_s:g} s"
    elif code is not None and code < 0:
      status = f"killed by signal {-code} (time or memory limit)"
    else:
      status = f"exit code {code}"
    parts = [f"[{status}]"]
    if stdout:
      parts.append(f"stdout:\n{stdout.rstrip()}")
    if stderr:
      parts.append(f"stderr:\n{stderr.rstrip()}")
    return ToolOutput(text="\n".join(parts), found=code == 0 and not timed_out)
