"""`pip install .` installs what the package imports: every third-party module imported under
asearcher_jax/ comes from a distribution pyproject.toml declares (importlib.metadata maps the
module to its distribution), and requirements files pin each declared one. (A module imported
inside `try: ... except ImportError` is optional and not required.) CI also builds a fresh
venv with `pip install .` and runs `asearcher --help` (.ci/run)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _optional(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
  """Whether an import sits in a `try` whose handlers catch ImportError."""
  while node in parents:
    node, child = parents[node], node
    if isinstance(node, ast.Try) and child in node.body:
      for h in node.handlers:
        caught = h.type
        names = [caught] if not isinstance(caught, ast.Tuple) else list(caught.elts)
        if any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError")
               for n in names):  # fmt: skip
          return True
  return False


def third_party_imports() -> dict[str, set[str]]:
  """Top-level module -> files importing it, for every required third-party import."""
  out: dict[str, set[str]] = {}
  for path in sorted((REPO / "asearcher_jax").rglob("*.py")):
    tree = ast.parse(path.read_text(), str(path))
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
      else:
        continue
      for name in names:
        top = name.split(".")[0]
        if top in sys.stdlib_module_names or top in ("asearcher_jax", "__future__"):
          continue
        if not _optional(node, parents):
          out.setdefault(top, set()).add(str(path.relative_to(REPO)))
  return out


def declared() -> set[str]:
  deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
  return {_norm(re.match(r"[A-Za-z0-9_.\-]+", d).group()) for d in deps}


def pinned() -> set[str]:
  """Every name pinned in the requirements files, following `-r` includes (requirements.txt
  starts with the runtime set, requirements-runtime.txt)."""
  out, todo, seen = set(), ["requirements.txt", "requirements-nodeps.txt"], set()
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    for line in (REPO / name).read_text().splitlines():
      if line.strip().startswith("-r "):
        todo.append(line.strip()[3:].strip())
      elif m := re.match(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==", line.strip()):
        out.add(_norm(m.group(1)))
  return out


def test_every_imported_distribution_is_declared_in_pyproject():
  imports = third_party_imports()
  assert {"jax", "flax", "jetstream", "gin", "wandb"} <= set(imports)  # the walk sees them
  dists = importlib.metadata.packages_distributions()
  have = declared()
  missing = {
    top: sorted(files)[0]
    for top, files in imports.items()
    if not any(_norm(d) in have for d in dists.get(top, []))
  }
  assert not missing, f"imported but not in pyproject [project].dependencies: {missing}"


def test_every_declared_dependency_is_pinned():
  unpinned = declared() - pinned()
  assert not unpinned, f"declared in pyproject.toml but pinned in no requirements file: {unpinned}"
