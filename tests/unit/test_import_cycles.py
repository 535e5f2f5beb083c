"""No import cycles between the modules of asearcher_jax/, and the check really catches one.

Two modules that import each other are usually one object cut in halves (a mixin reading its
host's private attributes, a helper importing its caller back for an annotation): the shape a
line cap on modules produced. Every import counts here, top-level, function-local and those under
`if TYPE_CHECKING:`: an annotation-only import back into the importer is how those halves hid
(all three cycles of 2026-12 did), and a type two modules need belongs in a third, lower one.
A check over grimp's module graph rather than an `.importlinter` contract: `acyclic_siblings`
compares the children of each package (a cycle through a package's `__init__` and its own
modules is invisible to it), and the lint drops TYPE_CHECKING imports for every contract.

Run as a script (`python tests/unit/test_import_cycles.py`) it prints the cycles of the package
found on sys.path and exits 1 if there are any: the copy tests run it over a copy of the package
with one import added.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "asearcher_jax"


def _graph(package: str = PACKAGE) -> grimp.ImportGraph:
  return grimp.build_graph(package, exclude_type_checking_imports=False, cache_dir=None)


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan), each sorted."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  found: list[list[str]] = []

  def visit(module: str) -> None:
    index[module] = low[module] = len(index)
    stack.append(module)
    on_stack.add(module)
    for imported in sorted(graph.find_modules_directly_imported_by(module)):
      if imported not in index:
        visit(imported)
        low[module] = min(low[module], low[imported])
      elif imported in on_stack:
        low[module] = min(low[module], index[imported])
    if low[module] == index[module]:
      component = []
      while not component or component[-1] != module:
        component.append(stack.pop())
        on_stack.discard(component[-1])
      if len(component) > 1:
        found.append(sorted(component))

  for module in sorted(graph.modules):  # depth <= the module count: a few hundred
    if module not in index:
      visit(module)
  return sorted(found)


def describe(graph: grimp.ImportGraph, component: list[str]) -> str:
  """One cycle through the component's first module, each import with its line."""
  first = component[0]
  chains = [
    (first, *graph.find_shortest_chain(importer=m, imported=first))
    for m in sorted(graph.find_modules_directly_imported_by(first))
    if m in component
  ]
  chain = min(chains, key=len)
  steps = []
  for importer, imported in itertools.pairwise(chain):
    details = graph.get_import_details(importer=importer, imported=imported)
    where = f" (line {details[0]['line_number']}: {details[0]['line_contents']})" if details else ""
    steps.append(f"  {importer} -> {imported}{where}")
  return f"cycle among {', '.join(component)}:\n" + "\n".join(steps)


def report(graph: grimp.ImportGraph) -> str:
  return "\n".join(describe(graph, c) for c in cycles(graph))


def test_the_package_has_no_import_cycles():
  graph = _graph()
  assert len(graph.modules) > 80  # the graph sees the package, not an empty one
  assert not cycles(graph), "import cycles (merge the halves or move the shared part down):\n" + (
    report(graph)
  )


def _check_copy(tmp_path: Path, module: str, added: str) -> subprocess.CompletedProcess:
  copy = tmp_path / PACKAGE
  shutil.copytree(ROOT / PACKAGE, copy, ignore=shutil.ignore_patterns("assets", "__pycache__"))
  target = copy / module
  target.write_text(target.read_text(encoding="utf-8") + f"\n{added}\n", encoding="utf-8")
  env = {**os.environ, "PYTHONPATH": str(tmp_path)}
  return subprocess.run(
    [sys.executable, str(Path(__file__).resolve())],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )


@pytest.mark.parametrize(
  ("module", "added", "between"),
  [
    (
      "serving/sampling.py",
      "from asearcher_jax.serving import engine  # added by the test",
      ("asearcher_jax.serving.engine", "asearcher_jax.serving.sampling"),
    ),
    (
      "serving/sampling.py",
      "def _added():\n  from asearcher_jax.serving.engine import Engine  # added by the test",
      ("asearcher_jax.serving.engine", "asearcher_jax.serving.sampling"),
    ),
    (
      "model/config.py",
      "from typing import TYPE_CHECKING\n"
      "if TYPE_CHECKING:\n  from asearcher_jax.serving.engine import Engine  # added by the test",
      ("asearcher_jax.model.config", "asearcher_jax.serving.engine"),
    ),
  ],
  ids=["top-level", "function-local", "type-checking"],
)
def test_an_added_cycle_fails_the_check_naming_its_modules(tmp_path, module, added, between):
  out = _check_copy(tmp_path, module, added)
  assert out.returncode == 1, out.stdout + out.stderr
  named = [
    set(line.removeprefix("cycle among ").removesuffix(":").split(", "))
    for line in out.stdout.splitlines()
    if line.startswith("cycle among ")
  ]
  assert any(set(between) <= modules for modules in named), out.stdout
  assert f"{between[0]} -> " in out.stdout and f"{between[1]} -> " in out.stdout, out.stdout
  assert "added by the test" in out.stdout  # the added import's line is quoted


if __name__ == "__main__":
  found = report(_graph())
  print(found or "no import cycles")
  sys.exit(1 if found else 0)
