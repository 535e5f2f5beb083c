"""W&B beside TensorBoard: `asearcher train` with gin/overlays/wandb.gin in offline mode writes a
W&B run directory holding the run's metrics, through the real entry point (CPU, no network)."""

from __future__ import annotations

import json
from pathlib import Path

import gin
import pytest

from asearcher_jax import main


@pytest.fixture(autouse=True)
def fresh_gin():
  gin.clear_config()
  yield
  gin.clear_config()


# W&B's transaction log (.wandb): a 7-byte file header, then LevelDB-log records in 32 KiB
# blocks (checksum 4, length 2, type 1; FULL = 1, FIRST = 2, MIDDLE = 3, LAST = 4).
_BLOCK, _HEADER = 32768, 7


def _records(run_file: Path) -> list[bytes]:
  data = run_file.read_bytes()
  assert data[:4] == b":W&B", run_file
  out, pos, parts = [], _HEADER, b""
  while pos + _HEADER <= len(data):
    left = _BLOCK - pos % _BLOCK
    if left < _HEADER:  # the block's tail is padding
      pos += left
      continue
    length = int.from_bytes(data[pos + 4 : pos + 6], "little")
    kind = data[pos + 6]
    body = data[pos + _HEADER : pos + _HEADER + length]
    pos += _HEADER + length
    if kind == 0 and length == 0:
      break
    parts += body
    if kind in (1, 4):
      out.append(parts)
      parts = b""
  return out


def _history(run_file: Path) -> list[dict]:
  """The logged rows of an offline W&B run (its history records, decoded by wandb's protos)."""
  from wandb.proto import wandb_internal_pb2

  rows = []
  for data in _records(run_file):
    record = wandb_internal_pb2.Record()
    record.ParseFromString(data)
    if record.WhichOneof("record_type") == "history":
      rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                   for i in record.history.item})  # fmt: skip
  return rows


@pytest.mark.slow
def test_two_step_train_writes_a_wandb_offline_run(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_home"))
  monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
  monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
  run_dir = tmp_path / "run"
  params = [
    f'commands.train.run_dir="{run_dir}"',
    "commands.train.max_questions=8",
    "train_config.TrainConfig.train_steps=2",
    "train_config.TrainConfig.batch_timeout_s=60.0",
    "staleness.StalenessConfig.batch_groups=1",
    "staleness.StalenessConfig.max_concurrent=2",
    "rollout.RolloutConfig.group_size=2",
    "rollout.RolloutConfig.episode_timeout_s=60.0",
    'metric_writer.WandbConfig.mode="offline"',
    'metric_writer.WandbConfig.name="two-steps"',
  ]
  argv = ["train", "--gin_file=gin/runs/train.gin", "--gin_file=gin/overlays/wandb.gin"]
  assert main.main([*argv, *(f"--gin_param={p}" for p in params)]) == 0
  metrics = run_dir / "metrics"
  jsonl = [json.loads(x) for x in (metrics / "metrics.jsonl").read_text().splitlines() if x]
  assert [r["step"] for r in jsonl] == [1, 2]
  run_id = (metrics / "wandb_run_id").read_text().strip()
  runs = list((metrics / "wandb").glob(f"offline-run-*-{run_id}"))
  assert len(runs) == 1, list((metrics / "wandb").iterdir())
  history = _history(next(runs[0].glob("run-*.wandb")))
  assert [row["_step"] for row in history] == [1, 2]
  for logged, row in zip(history, jsonl, strict=True):  # the same values as the JSONL log
    assert logged["ppo/loss"] == pytest.approx(row["ppo/loss"])
    assert logged["rollout/reward"] == pytest.approx(row["rollout/reward"])
  assert list(metrics.glob("events.out.tfevents.*"))  # TensorBoard beside it
