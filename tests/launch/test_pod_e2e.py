"""The pod as launched, on this machine: the local backend starts every role with the command
line the gcloud backend gives it (launch/roles.py), from a model written as a Hugging Face
directory, each serve-model tensor parallel over 2 fake devices, the retrieval server as its own
process, and the weights store and checkpoints on a gs:// bucket served by a local GCS emulator
(tests/gcs_emulator.py): a few RL steps, then the weight versions and checkpoints read back
from the bucket and the replay log, appended on the trainer's own disk, from its shipped
segments."""

from __future__ import annotations

import json
import urllib.request

import pytest
from etils import epath
from flax import nnx

from asearcher_jax.model import hf_io, presets, transformer
from launch import local
from tests.launch.test_local import assert_nothing_left, launch, wait_for

SPEC = """name = "pod"
experiment = "gin/experiments/asearcher_local_qwen2_5_7b.gin"
overlays = ["gin/overlays/recipe_tiny.gin"]
run_dir = "{run}"
bucket = "{bucket}"
serving = 1
serving_devices = 2
retrieval = 1
trainers = 1
gin_params = [
  'commands.train.model_dir = "{model}"',
  'loading.PolicyConfig.model_dir = "{model}"',
  'train_config.TrainConfig.reward = "smoke"',
]
"""


@pytest.mark.slow
def test_the_local_pod_trains_from_a_hf_directory_through_a_bucket(
  tmp_path, gcs_bucket, monkeypatch
):
  monkeypatch.setenv("XLA_FLAGS", "")  # each role's own devices, not the suite's 8
  model = tmp_path / "model"
  hf_io.save(
    transformer.Transformer(presets.model_config(name="qwen2-tiny"), rngs=nnx.Rngs(0)), model
  )
  run, spec = tmp_path / "run", tmp_path / "spec.toml"
  spec.write_text(SPEC.format(run=run, bucket=gcs_bucket, model=model))
  assert launch("start", spec)[0] == 0
  seen: set[int] = set()
  try:
    address = run / "addresses" / "serve-0.json"
    wait_for("serve-0's address", address.exists, 300)
    seen |= set(local.pids(run).values())
    http = json.loads(address.read_text())["http"]
    with urllib.request.urlopen(f"http://{http}/health", timeout=30) as r:
      mesh = json.loads(r.read())["mesh"]
    done = run / "supervisor.done"
    code = wait_for("the trainer's end", lambda: done.exists() and done.read_text().strip())
  finally:
    seen |= set(local.pids(run).values())
    assert launch("stop", spec)[0] == 0
  trainer_log = (run / "logs" / "trainer-0.log").read_text()
  assert code == "0", trainer_log[-3000:]
  assert mesh["tensor"] == 2 and mesh["kv_heads_per_chip"] == 1  # qwen2-tiny: 2 KV heads
  summary = json.loads(trainer_log.strip().splitlines()[-1])
  assert summary["version"] == 3 and summary["groups_trained"] == 6  # B = 2 groups, 3 steps
  assert str(model) in trainer_log  # the policy came from the HF directory
  assert "loaded version 3 " in (run / "logs" / "serve-0.log").read_text()
  # Read back from the bucket: every published version, the checkpoints.
  remote = epath.Path(f"{gcs_bucket}/pod")
  versions = sorted(p.name for p in (remote / "weights").iterdir() if p.name.startswith("v"))
  assert versions and versions[-1] == "v00000003", versions
  assert any((remote / "checkpoints").iterdir())
  # The replay log was appended on the trainer's disk and shipped to the run dir in segments.
  assert (run / "journal" / "replay").is_dir()
  assert any((run / "train" / "replay").rglob("*.segments/*/*"))
  assert_nothing_left(run, seen)
