"""harness/ is the project's own: pyproject's package find must not ship it with the library."""

from __future__ import annotations

import tomllib
from pathlib import Path

import setuptools

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_find_ships_asearcher_jax_only():
  find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
  found = setuptools.find_packages(str(ROOT), **find["find"])
  assert "asearcher_jax.testing" in found  # the test doubles are shipped
  assert found and all(p.split(".")[0] == "asearcher_jax" for p in found), found
  assert (ROOT / "harness" / "__init__.py").is_file()
