"""The command line this process was started with, for the records that say how to make a result
again (model cards, SFT summaries).

`asearcher` (main.py) records its arguments before it runs a subcommand; a pipeline called from
Python (tests, a notebook) records nothing, and its records fall back to the recipe's command.
Why not `sys.argv`: under pytest or a notebook that is the host program's command line, and a card
that says `pytest -k ...` reproduces nothing.
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Iterator, Sequence

_ARGV: tuple[str, ...] | None = None


@contextlib.contextmanager
def recorded(argv: Sequence[str]) -> Iterator[None]:
  """Within this block, `command` is `asearcher` with these arguments (the program name left
  out); outside it, the default again, so that one test's command line never leaks into
  another's records."""
  global _ARGV
  before, _ARGV = _ARGV, tuple(argv)
  try:
    yield
  finally:
    _ARGV = before


def command(default: str) -> str:
  """The `asearcher` command this process runs, every --gin_param included, shell-quoted; the
  `default` (the recipe's own command) when the process was not started by `asearcher`."""
  return default if _ARGV is None else shlex.join(["asearcher", *_ARGV])
