"""gs:// paths reach the storage libraries untouched (offline: nothing is written to a bucket).

On a pod the weights store and the checkpoints are gs:// URLs that Orbax and tensorstore write
with their own GCS drivers; only the small shared files (address files) and the replay journal's
sealed segments (`storage.ShippedJournal`, never appended to) go through the gcsfuse mount. A URL
must never be turned into a local path on the way. tests/gcs_emulator.py runs them on a bucket."""

from __future__ import annotations

import json
import os
from pathlib import Path

import orbax.checkpoint as ocp
import pytest
from etils import epath

from asearcher_jax import checkpoint as checkpoint_lib
from asearcher_jax import storage
from asearcher_jax.apps.train import checkpoint_config
from asearcher_jax.apps.train_config import TrainConfig
from asearcher_jax.errors import CheckpointError
from asearcher_jax.serving import weights_dir as wd
from launch import gcloud, roles
from launch.spec import load

SPECS = Path(__file__).resolve().parents[2] / "launch" / "specs"


def test_checkpoint_urls_go_to_orbax_as_they_are(tmp_path, monkeypatch):
  seen: list[str] = []

  class Manager:  # stands in for Orbax's: records the directory it was given
    def __init__(self, directory, options=None) -> None:
      seen.append(os.fspath(directory))

  monkeypatch.setattr(ocp, "CheckpointManager", Manager)
  url = "gs://bucket/runs/x/train/checkpoints"
  cfg = checkpoint_config(TrainConfig(checkpoint_dir=url, checkpoints_kept=3), tmp_path / "run")
  assert (cfg.directory, cfg.max_to_keep) == (url, 3)
  checkpoint_lib.Checkpointer(cfg)
  assert seen == [url] and not (tmp_path / "run").exists()  # nothing created locally
  # Unset: the run's own directory, made absolute for Orbax.
  local = checkpoint_config(TrainConfig(), tmp_path / "run")
  assert (local.directory, local.max_to_keep) == (str(tmp_path / "run" / "checkpoints"), 2)
  with pytest.raises(ValueError, match="checkpoints_kept must be >= 1"):
    TrainConfig(checkpoints_kept=0)


def test_weight_store_urls_use_tensorstores_gcs_driver():
  root = wd.store_path("gs://bucket/runs/x/weights")
  assert isinstance(root, epath.Path) and os.fspath(root) == "gs://bucket/runs/x/weights"
  arrays = wd.version_dir(root, 3) / wd.ARRAYS / "embed.embedding"
  assert wd._kvstore(arrays) == {
    "driver": "gcs",
    "bucket": "bucket",
    "path": "runs/x/weights/v00000003/arrays/embed.embedding/",
  }
  assert wd._kvstore(epath.Path("/mnt/a/w")) == {"driver": "file", "path": "/mnt/a/w/"}
  with pytest.raises(CheckpointError, match="only local paths and gs:// URLs"):
    wd._kvstore(epath.Path("s3://bucket/w"))


def test_a_pod_run_writes_weights_and_checkpoints_to_the_bucket_not_the_mount():
  spec = load(SPECS / "v5p.toml")
  lay = gcloud.layout(spec)
  name, prefix = gcloud._bucket(spec)
  assert lay.weights_dir == f"gs://{name}/{prefix}runs/{spec.name}/weights"
  assert lay.checkpoint_dir == f"gs://{name}/{prefix}runs/{spec.name}/train/checkpoints"
  # The same objects the mount shows: `asearcher export --run_dir` on the mount finds them.
  assert lay.checkpoint_dir.removeprefix(f"gs://{name}/") == (
    lay.run_dir.removeprefix(f"{spec.mount}/") + "/checkpoints"
  )
  trainer = roles.trainer_argv(lay)
  assert f'--gin_param=train_config.TrainConfig.checkpoint_dir="{lay.checkpoint_dir}"' in trainer
  assert f'--gin_param=train_config.RemoteEnginesConfig.weights_dir="{lay.weights_dir}"' in trainer
  assert f'--gin_param=serve_model.serve.weights_dir="{lay.weights_dir}"' in roles.serve_argv(
    lay, 0
  )


def test_jsonl_lines_split_on_newline_only():
  rows = [{"t": "a\u2028b"}, {"t": "c\x85d\u2029"}, {"t": "e\r"}]
  text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows) + '{"t": "f"}\r\n'
  assert len(text.splitlines()) > 4  # what tore records before
  lines = [x for x in storage.jsonl_lines(text) if x.strip()]
  assert [json.loads(x) for x in lines] == [*rows, {"t": "f"}]
  assert storage.jsonl_lines("a\nb\n") == ["a", "b"] and storage.jsonl_lines("") == []
