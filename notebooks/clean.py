"""Keeps the notebooks in their stored form: no outputs, no execution counts, minimal metadata,
stable cell ids, the Colab badge and the install cell written from REPO, one canonical JSON
layout, so a notebook diffs like code.

  python notebooks/clean.py            # rewrites every notebooks/*.ipynb in place
  python notebooks/clean.py --check    # exit 1 (naming the files) if any is not clean

tests/notebooks/test_notebooks.py fails on a notebook that this would change.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import nbformat

# The GitHub repository the Colab badges open and the install cell installs from.
REPO = "asearcher-jax/asearcher_jax"
BRANCH = "main"
HERE = Path(__file__).resolve().parent
BADGE_MARK = "[![Open In Colab]"
# The release the install cell pins (the tag v<version> of pyproject.toml's version), so a
# notebook opened later installs the package it was written against, not whatever main is.
VERSION = tomllib.loads((HERE.parent / "pyproject.toml").read_text())["project"]["version"]

INSTALL = f"""\
# Colab: install asearcher_jax (a checkout with the package importable skips this).
import importlib.util
import subprocess
import sys

if importlib.util.find_spec("asearcher_jax") is None:
  url = "git+https://github.com/{REPO}.git@v{VERSION}"
  subprocess.run([sys.executable, "-m", "pip", "install", "-q", url], check=True)"""

KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}


def badge(name: str) -> str:
  link = f"https://colab.research.google.com/github/{REPO}/blob/{BRANCH}/notebooks/{name}"
  return f"{BADGE_MARK}(https://colab.research.google.com/assets/colab-badge.svg)]({link})"


def canonical(nb: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
  """The stored form of `nb` (named `name`): cell 0 is markdown whose badge line points at this
  notebook, cell 1 is the install cell."""
  nb = nbformat.from_dict(nb)
  nb.metadata = nbformat.from_dict({"colab": {"provenance": []}, "kernelspec": KERNELSPEC})
  lines = [ln for ln in nb.cells[0].source.splitlines() if not ln.startswith(BADGE_MARK)]
  title, rest = lines[:1], lines[1:]
  nb.cells[0].source = "\n".join([*title, "", badge(name), *rest]).replace("\n\n\n", "\n\n")
  if not nb.cells[1].source.startswith("# Colab: install asearcher_jax"):
    nb.cells.insert(1, nbformat.v4.new_code_cell(INSTALL))
  nb.cells[1].source = INSTALL
  for i, cell in enumerate(nb.cells):
    cell.id = f"c{i:02d}"
    cell.metadata = nbformat.from_dict({})
    if cell.cell_type == "code":
      cell.outputs = []
      cell.execution_count = None
    cell.source = cell.source.strip("\n")
  nb.nbformat, nb.nbformat_minor = 4, 5
  return nb


def dumps(nb: nbformat.NotebookNode) -> str:
  return nbformat.writes(nb) + "\n"


def main(argv: list[str]) -> int:
  check = "--check" in argv
  dirty = []
  for path in sorted(HERE.glob("*.ipynb")):
    text = path.read_text(encoding="utf-8")
    clean = dumps(canonical(nbformat.reads(text, as_version=4), path.name))
    if clean != text:
      dirty.append(path.name)
      if not check:
        path.write_text(clean, encoding="utf-8")
  if check and dirty:
    print(f"not clean (run python notebooks/clean.py): {', '.join(dirty)}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
