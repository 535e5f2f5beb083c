"""gs:// inputs a reader needs as local files (a checkpoint, a questions file, an index) are
copied once into the local cache (`storage.local_copy`), on the GCS emulator's bucket."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from etils import epath

from asearcher_jax import storage


def test_a_gs_folder_is_copied_once_and_a_path_passes_through(gcs_bucket, tmp_path, monkeypatch,
                                                                caplog):  # fmt: skip
  monkeypatch.setenv("ASEARCHER_HOME", str(tmp_path / "home"))
  root = epath.Path(f"{gcs_bucket}/models/tiny")
  (root / "sub").mkdir(parents=True, exist_ok=True)
  (root / "config.json").write_text('{"a": 1}')
  (root / "sub" / "weights.bin").write_bytes(b"\x00\x01" * 1000)
  assert storage.local_copy(str(tmp_path), what="x") == str(tmp_path)  # a path is left alone
  with caplog.at_level(logging.INFO, logger="asearcher_jax.storage"):
    local = storage.local_copy(str(root), what="model_dir")
  assert local.startswith(storage.cache_root()) and local.endswith("models/tiny")
  assert (Path(local) / "config.json").read_text() == '{"a": 1}'
  assert (Path(local) / "sub" / "weights.bin").read_bytes() == b"\x00\x01" * 1000
  assert f"model_dir: copying {root} (2 files)" in caplog.text
  marker = os.path.join(local, "config.json")
  mtime = os.stat(marker).st_mtime_ns
  assert storage.local_copy(str(root), what="model_dir") == local
  assert os.stat(marker).st_mtime_ns == mtime  # complete files are not copied again
  one = storage.local_copy(f"{root}/config.json", what="questions")
  assert Path(one).read_text() == '{"a": 1}'
  with pytest.raises(FileNotFoundError, match=r"^questions: gs://.*/nothing\.jsonl does not exist"):
    storage.local_copy(f"{gcs_bucket}/nothing.jsonl", what="questions")
