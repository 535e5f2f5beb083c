"""The main job (until the quickstart exists) runs end to end through the real CLI, learns, and
can be run again in the same workdir."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_cli_runs_twice_and_fits_the_chats(tmp_path):
  env = {**os.environ, "XLA_FLAGS": ""}  # one CPU device, as on a laptop
  cmd = [
    sys.executable, "-m", "asearcher_jax.main", "demo",
    f"--gin_param=demo.run.workdir='{tmp_path}'",
    "--gin_param=demo.run.train_steps=10",
    "--gin_param=demo.run.generate_tokens=3",
  ]  # fmt: skip
  for _ in range(2):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["nll_after"] < summary["nll_before"] - 1.0
    assert summary["checkpoint_restored"] is True
  assert (tmp_path / "hf_model" / "model.safetensors").is_file()
  assert (tmp_path / "metrics" / "metrics.jsonl").read_text().count("sft/loss") == 20
