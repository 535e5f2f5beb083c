"""The notebooks: stored clean (no outputs, minimal metadata, canonical JSON, a Colab badge and an
install cell), and each one executed top to bottom in a real kernel against the tiny run, where
a raising cell fails the test. The trajectory inspector's HTML output is then rendered in a real
headless browser (Debian's chromium) and the screenshot checked for content."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess

import nbformat
import numpy as np
import pytest

from tests.notebooks.conftest import NAMES, NOTEBOOKS, execute


def _clean_module():
  spec = importlib.util.spec_from_file_location("nb_clean", NOTEBOOKS / "clean.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_the_five_notebooks_are_stored_clean():
  clean = _clean_module()
  assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(NAMES)
  for name in NAMES:
    text = (NOTEBOOKS / name).read_text(encoding="utf-8")
    nb = nbformat.reads(text, as_version=4)
    nbformat.validate(nb)
    assert text == clean.dumps(clean.canonical(nb, name)), f"{name}: run python notebooks/clean.py"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code), name
    assert all(c.metadata == {} for c in nb.cells) and set(nb.metadata) == {"colab", "kernelspec"}
    assert f"notebooks/{name})" in nb.cells[0].source and "colab-badge.svg" in nb.cells[0].source
    assert "pip" in nb.cells[1].source and f"github.com/{clean.REPO}.git" in nb.cells[1].source
    assert f".git@v{clean.VERSION}" in nb.cells[1].source  # a pinned release, not a branch


def test_clean_strips_outputs_and_restores_the_badge(tmp_path):
  clean = _clean_module()
  nb = nbformat.read(NOTEBOOKS / "training_dashboard.ipynb", as_version=4)
  nb.cells[0].source = "# Title only"
  nb.cells[2].outputs = [nbformat.v4.new_output("stream", text="noise")]
  nb.cells[2].execution_count = 7
  nb.cells[2].metadata = {"collapsed": True}
  nb.metadata["widgets"] = {"state": {}}
  fixed = clean.canonical(nb, "training_dashboard.ipynb")
  assert fixed.cells[2].outputs == [] and fixed.cells[2].execution_count is None
  assert "widgets" not in fixed.metadata and fixed.cells[2].metadata == {}
  assert clean.badge("training_dashboard.ipynb") in fixed.cells[0].source


def test_a_cell_that_raises_fails_the_execution(tmp_path, monkeypatch):
  import nbclient.exceptions

  bad = tmp_path / "notebooks"
  bad.mkdir()
  nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("raise ValueError('boom')")])
  nbformat.write(nb, bad / "bad.ipynb")
  monkeypatch.setattr("tests.notebooks.conftest.NOTEBOOKS", bad)
  with pytest.raises(nbclient.exceptions.CellExecutionError, match="boom"):
    execute("bad.ipynb", tmp_path, tmp_path)


def _outputs(nb, mime: str) -> list[str]:
  return [
    o["data"][mime]
    for c in nb.cells
    if c.cell_type == "code"
    for o in c.outputs
    if "data" in o and mime in o["data"]
  ]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_executes_against_a_tiny_run(executed, name):
  nb, seconds = executed(name)
  print(f"{name}: executed in {seconds:.1f} s")
  errors = [
    o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
  ]
  assert not errors
  html, png = _outputs(nb, "text/html"), _outputs(nb, "image/png")
  if name == "trajectory_inspector.ipynb":
    assert any("data-mask" in h for h in html)  # the token view was drawn
    assert any("class='cols'" in h for h in html)  # before/after RL side by side
  if name in ("quickstart.ipynb", "training_dashboard.ipynb", "evaluation_comparison.ipynb"):
    assert png, f"{name} drew no figure"
  if name == "synthesis_browser.ipynb":
    assert any("statements" in h and "checks" in h for h in html)


def _chromium() -> str | None:
  return next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)


@pytest.mark.slow
def test_trajectory_inspector_renders_in_a_headless_browser(executed, tmp_path):
  browser = _chromium()
  if browser is None:
    pytest.skip("no chromium on this machine (apt-get install chromium)")
  nb, _ = executed("trajectory_inspector.ipynb")
  episode = next(h for h in _outputs(nb, "text/html") if "data-mask" in h)
  page = tmp_path / "inspector.html"
  page.write_text(f"<!doctype html><meta charset='utf-8'><body>{episode}</body>", "utf-8")
  png = tmp_path / "inspector.png"
  subprocess.run(
    [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
     "--force-device-scale-factor=0.7", f"--screenshot={png}", "--window-size=1150,1900",
     page.as_uri()],
    check=True, capture_output=True, timeout=120,
  )  # fmt: skip
  import matplotlib.image

  img = matplotlib.image.imread(png)
  assert img.shape[0] >= 1300 and img.shape[1] >= 780  # 1150 x 1900 CSS pixels at 0.7
  # Drawn content, not a blank page: many distinct colours (token backgrounds, blocks, text).
  colours = np.unique((img[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
  assert len(colours) > 50 and img[..., :3].std() > 0.05
  out = os.environ.get("ASEARCHER_SCREENSHOT_OUT")
  if out:  # refreshes the picture in the docs (a 128-colour palette keeps it small)
    from PIL import Image

    Image.open(png).convert("RGB").quantize(128).save(out, optimize=True)
