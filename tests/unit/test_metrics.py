from __future__ import annotations

import json
from unittest import mock

import jax.numpy as jnp
import numpy as np

from asearcher_jax import metric_writer
from asearcher_jax.metric_writer import MetricWriter


def test_writes_jsonl_and_tensorboard_on_host0(tmp_path):
  w = MetricWriter(tmp_path)
  w.write(1, {"ppo/loss": jnp.float32(0.5), "rollout/reward": 0.25})
  w.write(2, {"ppo/loss": 0.4})
  w.close()
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2]
  assert rows[0]["ppo/loss"] == 0.5 and rows[0]["rollout/reward"] == 0.25
  assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())


def test_other_hosts_write_nothing(tmp_path):
  with mock.patch("jax.process_index", return_value=1):
    w = MetricWriter(tmp_path / "h1")
  w.write(1, {"x": 1.0})
  w.close()
  assert not (tmp_path / "h1").exists()


def test_host_memory_follows_what_the_process_holds():
  """`host/rss_mb` rises by what an array holds once touched and falls back when it is freed;
  the peak keeps the high point (on Linux, where /proc says what is resident)."""
  before = metric_writer.host_memory()
  block = np.ones(64 * 2**20 // 8)  # 64 MB, every page written
  held = metric_writer.host_memory()
  del block
  after = metric_writer.host_memory()
  assert held["host/rss_mb"] - before["host/rss_mb"] > 48
  assert held["host/peak_rss_mb"] >= held["host/rss_mb"] - 1
  assert after["host/rss_mb"] < held["host/rss_mb"] - 48
  assert after["host/peak_rss_mb"] >= held["host/peak_rss_mb"]
