"""docs/peers.md maps AReaL's YAML keys and ASearcher's evaluation flags to gin bindings: every
binding it names must be one gin accepts (the alias as a recipe imports it, the configurable, the
parameter), so a researcher who copies a row gets a binding, not an error. Also: the page says
that no recipe has run on a TPU, and the README links it."""

from __future__ import annotations

import re
from pathlib import Path

import gin
import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "peers.md"
GIN_IMPORT_RE = re.compile(r"^from (asearcher_jax[\w.]*) import (\w+)(?: as (\w+))?$", re.M)
# A table row whose second cell starts with a backticked `alias.Name.field`.
ROW_RE = re.compile(r"^\| (`[^|]+`[^|]*) \| `([a-z_]+\.[A-Za-z_]+\.[a-z_]+)`", re.M)


def _imports() -> dict[str, set[str]]:
  """alias -> the `from X import Y as alias` lines the gin files use for it."""
  out: dict[str, set[str]] = {}
  for path in (ROOT / "gin").rglob("*.gin"):
    for package, name, alias in GIN_IMPORT_RE.findall(path.read_text()):
      line = f"from {package} import {name}" + (f" as {alias}" if alias else "")
      out.setdefault(alias or name, set()).add(line)
  return out


def _rows() -> list[tuple[str, str]]:
  return ROW_RE.findall(PAGE.read_text())


def _binds(binding: str, imports: dict[str, set[str]]) -> str | None:
  """None when gin parses `binding = None` under one of the alias's imports, else why not."""
  alias = binding.split(".", 1)[0]
  errors = []
  for line in sorted(imports.get(alias, ())):
    gin.clear_config()
    try:
      gin.parse_config(f"from __gin__ import dynamic_registration\n{line}\n{binding} = None\n")
      return None
    except (ValueError, AttributeError, ImportError) as e:
      errors.append(str(e).splitlines()[0])
    finally:
      gin.clear_config()
  return "; ".join(errors) or f"no gin file imports an alias {alias!r}"


def test_the_map_has_the_rows_a_researcher_looks_for():
  keys = " ".join(key for key, _ in _rows())
  for key in ("max_head_offpolicyness", "n_samples", "eps_clip", "behav_imp_weight_cap",
              "reward_scaling", "optimizer.lr", "--pass-at-k"):  # fmt: skip
    assert key in keys, f"docs/peers.md maps no {key!r}"
  assert len(_rows()) >= 35


@pytest.mark.parametrize(("key", "binding"), _rows(), ids=lambda x: x[:40])
def test_every_binding_in_the_map_resolves_with_gin(key, binding):
  problem = _binds(binding, _imports())
  assert problem is None, f"docs/peers.md maps {key} to {binding}, which gin refuses: {problem}"


def test_a_binding_that_does_not_exist_is_caught():
  imports = _imports()
  assert _binds("learner.PPOConfig.eps_clip", imports) is None
  assert "doesn't have a parameter" in _binds("learner.PPOConfig.no_such_field", imports)
  assert "has no attribute no_such_config" in _binds("learner.no_such_config.x", imports)
  assert _binds("nosuchalias.X.y", imports) == "no gin file imports an alias 'nosuchalias'"


def test_the_page_says_what_ran_where_and_the_readme_links_it():
  text = PAGE.read_text()
  assert "No recipe of `gin/experiments/` has run on a TPU yet." in text
  assert "one NVIDIA H100" in text and "libtpu" in text
  for peer in ("AReaL / ASearcher", "verl", "SkyRL", "tunix"):
    assert f"| {peer} " in text or f" {peer} |" in text, peer
  assert "](docs/peers.md)" in (ROOT / "README.md").read_text()
