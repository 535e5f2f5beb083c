"""The package stays readable: modules of a few hundred lines, functions without long argument lists.

Long argument lists are what nested frozen configs replace (one default in one place, bindable from
gin); a module past ~500 lines holds more than one thing. A new offender fails here with its place.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "asearcher_jax"
MAX_LINES = 520  # "a few hundred lines": ~500, with a little slack for docstrings
MAX_PARAMS = 12


def _modules() -> list[Path]:
  return sorted(PACKAGE.rglob("*.py"))


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
  a = fn.args
  names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
  return len([n for n in names if n not in ("self", "cls")])


def test_no_module_is_longer_than_the_limit():
  long = [f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p in _modules()
          if (n := p.read_text(encoding="utf-8").count("\n")) > MAX_LINES]  # fmt: skip
  assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_function_takes_a_long_argument_list():
  wide = []
  for path in _modules():
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _params(node) > MAX_PARAMS:
        wide.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}")
  assert not wide, f"functions with more than {MAX_PARAMS} parameters: {wide}"


def test_the_checks_see_the_package():
  # Guards against a path change that would make both checks pass vacuously.
  assert len(_modules()) > 80
  assert any(p.name == "transformer.py" for p in _modules())
