"""Every gin file parses on its own (unknown names are errors) and builds what it configures."""

from __future__ import annotations

import shlex
from pathlib import Path

import gin
import pytest

from asearcher_jax import main
from asearcher_jax.model import presets
from asearcher_jax.model.config import ModelConfig

GIN_ROOT = Path(__file__).resolve().parents[2] / "gin"
FILES = sorted(GIN_ROOT.rglob("*.gin"))


def test_there_are_gin_files_in_every_layer():
  layers = {p.parent.name for p in FILES}
  assert {"models", "runs", "experiments", "overlays"} <= layers


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(GIN_ROOT)))
def test_gin_file_parses_and_builds(path):
  gin.clear_config()
  text = path.read_text()
  assert text.startswith("#"), (
    "each gin file starts with a header saying what it needs and how to run it"
  )
  assert "from __gin__ import dynamic_registration" in text
  for p in main.GIN_SEARCH_PATHS:
    gin.add_config_file_search_path(str(p))
  try:
    gin.parse_config_files_and_bindings([str(path)], [], skip_unknown=False)
    if "presets.model_config" in text or "include 'gin/models/" in text:
      cfg = gin.get_configurable(presets.model_config)()
      assert isinstance(cfg, ModelConfig)
  finally:
    gin.clear_config()


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_every_preset_has_a_model_gin(name):
  texts = [p.read_text() for p in (GIN_ROOT / "models").glob("*.gin")]
  assert any(f'presets.model_config.name = "{name}"' in t for t in texts)


def _subcommand(path: Path) -> str | None:
  """The subcommand a gin file configures: the one whose function it binds, else None (model
  layers and overlays are read only through the files that include them)."""
  gin.clear_config()
  for p in main.GIN_SEARCH_PATHS:
    gin.add_config_file_search_path(str(p))
  try:
    gin.parse_config_files_and_bindings([str(path)], [], skip_unknown=False)
    bound = {sel for _, sel in gin.config._CONFIG}
    for name, target in main.SUBCOMMANDS.items():
      fn = main._resolve(target)
      configurable = gin.config._INVERSE_REGISTRY.get(fn)
      if configurable is not None and configurable.selector in bound:
        return name
    return None
  finally:
    gin.clear_config()


CONFIGURING = [p for p in FILES if p.parent.name in ("runs", "experiments", "sweeps")]


@pytest.mark.parametrize("path", CONFIGURING, ids=lambda p: str(p.relative_to(GIN_ROOT)))
def test_gin_file_passes_the_command_lines_checks(path):
  """What `asearcher SUBCOMMAND --gin_file PATH` checks before it runs: every binding has the
  right type, names no path under a file, and reaches the subcommand through gin (a binding of
  a class nothing builds would be ignored)."""
  name = _subcommand(path)
  own = path.stem.replace("_", "-")
  if path.parent.name == "runs" and own in main.SUBCOMMANDS:  # the subcommand's default file
    assert name in (None, own), f"{path} binds {name}, not {own}"
    name = own
  assert name is not None, f"{path} binds no subcommand's function"
  try:
    main.configure(name, [str(path)], [])
  finally:
    gin.clear_config()


def _layered_command(path: Path) -> list[str]:
  """The gin files of the command an overlay's header gives (`#   asearcher SUB --gin_file ...`)."""
  lines = [ln for ln in path.read_text().splitlines() if ln.startswith("#   asearcher ")]
  assert len(lines) == 1, f"{path}: one '#   asearcher ...' command line in the header"
  words = shlex.split(lines[0].removeprefix("#"))
  return [words[i + 1] for i, w in enumerate(words) if w == "--gin_file"]


LONG_HORIZON_OVERLAYS = sorted((GIN_ROOT / "overlays" / "long_horizon").glob("*.gin"))


def test_long_horizon_variants_are_overlays_not_recipes():
  """gin/experiments holds recipes a user runs; a variant is an overlay (docs/experiments/)."""
  recipes = sorted(p.name for p in (GIN_ROOT / "experiments").glob("*.gin"))
  # The training recipes, their evaluation recipes (eval_*.gin) and the CPU ones.
  assert len(recipes) <= 16, recipes
  assert [r for r in recipes if r.startswith("long_horizon")] == [
    "long_horizon.gin",
    "long_horizon_warm_start.gin",
  ]
  assert len(LONG_HORIZON_OVERLAYS) >= 5


@pytest.mark.parametrize("path", LONG_HORIZON_OVERLAYS, ids=lambda p: p.name)
def test_long_horizon_overlay_command_passes_the_checks(path):
  """The command an overlay's header documents: the recipe first, the overlay last, and every
  binding of the stack checked as `asearcher long-horizon` checks it before it runs."""
  files = _layered_command(path)
  rel = str(path.relative_to(GIN_ROOT.parent))
  assert files[0] == "gin/experiments/long_horizon.gin" and files[-1] == rel, files
  experiments = (GIN_ROOT.parent / "docs" / "experiments" / "long_horizon.md").read_text()
  assert path.name in experiments, f"{rel} is not listed in docs/experiments/long_horizon.md"
  try:
    main.configure("long-horizon", files, [])
  finally:
    gin.clear_config()
