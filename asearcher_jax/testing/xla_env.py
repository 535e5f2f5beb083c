"""XLA flags for the test suite's processes.

The suite's programs are tiny (0.1-10M parameters) and each is compiled once and run briefly, so
XLA:CPU's LLVM optimisation is most of their cost: without it `tests/serving` took 341 s against
481 s, and `tests/rl` with `tests/model` 312 s against 352 s (2026-11-27, 2 cores, runs back to
back). The programs' HLO is unchanged; only the CPU code generated from it is less optimised.
`ASEARCHER_TEST_XLA_OPT=1` runs the suite with XLA's default optimisation instead.
"""

from __future__ import annotations

import os

# Added to every test process's XLA_FLAGS (unless ASEARCHER_TEST_XLA_OPT=1).
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def suite_flags(flags: str, *, devices: int) -> str:
  """`flags` with `devices` fake host devices and the suite's compile options, each once."""
  kept = [f for f in flags.split() if "host_platform_device_count" not in f]
  if os.environ.get("ASEARCHER_TEST_XLA_OPT") != "1":
    kept += [f for f in FAST_COMPILE if f not in kept]
  return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])


def one_device() -> str:
  """XLA_FLAGS for a child process that sees one CPU device, as from a shell, with this
  process's other flags (the suite's compile options)."""
  kept = [
    f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f
  ]
  return " ".join(kept)
