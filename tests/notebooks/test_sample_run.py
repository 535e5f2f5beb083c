"""The sample run shipped with the package (what the views and notebooks show before a user has a
run), the views over a run directory on a bucket (a local GCS emulator), and the notebooks on a
fresh clone with no run of its own."""

from __future__ import annotations

import shutil

import pytest
from etils import epath

from asearcher_jax import storage
from asearcher_jax.views import runs
from tests.notebooks.conftest import execute


def test_the_sample_run_shows_training_and_evaluation_episodes():
  run = runs.RunDir(runs.sample_run())
  sources = {e.source for e in run.episodes}
  assert sources == {"train", "eval:sft", "eval:rl"}  # before and after RL, and the RL run
  assert len(run.eval_dirs) == 2 and run.metrics_files and run.tokenizer is not None
  train = [e for e in run.episodes if e.source == "train"]
  assert all(e.version is not None and e.trajectory.calls for e in train)


def test_views_read_a_run_directory_on_a_bucket(tmp_path, gcs_bucket, monkeypatch):
  """A run on a bucket reads as the same run on disk: mirrored without its checkpoints, and
  mirrored once (a second look copies nothing)."""
  monkeypatch.setenv("ASEARCHER_HOME", str(tmp_path / "home"))
  url = f"{gcs_bucket}/runs/sample"
  for path in runs.sample_run().rglob("*"):
    if path.is_file():
      dest = epath.Path(url) / path.relative_to(runs.sample_run()).as_posix()
      dest.parent.mkdir(parents=True, exist_ok=True)
      dest.write_bytes(path.read_bytes())
  (epath.Path(url) / "rl" / "checkpoints" / "1").mkdir(parents=True, exist_ok=True)
  (epath.Path(url) / "rl" / "checkpoints" / "1" / "state.bin").write_bytes(b"\0" * 4096)

  remote = runs.RunDir(url)
  local = runs.RunDir(runs.sample_run())
  assert remote.url == url and str(remote.root).startswith(storage.cache_root())
  assert [e.id for e in remote.episodes] == [e.id for e in local.episodes]
  assert [e.score for e in remote.episodes] == [e.score for e in local.episodes]
  assert not (remote.root / "rl" / "checkpoints").exists()  # never the weights
  stamps = {p: p.stat().st_mtime_ns for p in remote.root.rglob("*") if p.is_file()}
  again = runs.RunDir(url)  # a second look copies nothing
  assert {p: p.stat().st_mtime_ns for p in again.root.rglob("*") if p.is_file()} == stamps
  with pytest.raises(runs.AsearcherError, match="cannot read run directory"):
    runs.RunDir(f"{gcs_bucket}/runs/none")


@pytest.mark.parametrize(
  "name", ["trajectory_inspector.ipynb", "training_dashboard.ipynb", "evaluation_comparison.ipynb"]
)
def test_notebooks_run_on_a_fresh_clone_with_no_run(name, tmp_path):
  """No runs/quickstart (a fresh clone): the notebook says so and shows the sample run, top to
  bottom without an error."""
  work = tmp_path / "clone"
  work.mkdir()
  nb, _ = execute(name, work / "runs" / "quickstart", work)
  text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]  # fmt: skip
  assert not errors
  assert "showing the sample run shipped with the package" in text
  assert not (work / "runs").exists()  # nothing written where the user's run would go
  shutil.rmtree(work)
