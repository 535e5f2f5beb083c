"""`asearcher sft` as a multi-process program: 2 processes x 4 fake CPU devices (jax.distributed
over 127.0.0.1, bootstrapped by main.py from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID) train exactly like 1 process x 8 devices on the same (data 2, fsdp 2, tensor 2)
mesh: the same loss every step, the same eval loss, the same exported parameters.

Both runs are the real command in subprocesses (gin/runs/sft.gin, a qwen2-tiny-shaped policy
from scratch on the byte-level tokenizer of tests/sft/test_sft.py). Each process builds the same
data plan and places only its rows of each global batch; Orbax writes each process's shards;
only process 0 writes metrics, the summary and the HF export.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from asearcher_jax.model import hf_io
from tests.processes import finish, free_port
from tests.rl.test_multihost import flat_params
from tests.sft.test_sft import tok, tok_dir, trajs  # noqa: F401 (fixtures)

REPO = Path(__file__).resolve().parents[2]
STEPS = 4


def launch(run_dir: Path, data: Path, tokenizer: Path, processes: int) -> list[subprocess.Popen]:
  port = free_port()
  args = [
    sys.executable, "-m", "asearcher_jax.main", "sft",
    f"--gin_param=TRAJECTORIES='{data}'",
    f"--gin_param=TOKENIZER_DIR='{tokenizer}'",
    f"--gin_param=commands.sft.out_dir='{run_dir / 'out'}'",
    "--gin_param=commands.ScratchModel.preset='qwen2-tiny'",
    "--gin_param=sharding.MeshConfig.data=2",
    "--gin_param=sharding.MeshConfig.fsdp=2",
    "--gin_param=sharding.MeshConfig.tensor=2",
    f"--gin_param=sft.SFTConfig.steps={STEPS}",
    "--gin_param=sft.SFTConfig.row_len=256",
    "--gin_param=sft.SFTConfig.rows_per_batch=4",
    "--gin_param=sft.SFTConfig.eval_fraction=0.25",
    "--gin_param=sft.SFTConfig.eval_every=0",
    "--gin_param=sft.SFTConfig.checkpoint_every=2",
    "--gin_param=sft.SFTConfig.log_every=1",
    "--gin_param=sft.SFTConfig.progress=False",
    "--gin_param=steps.OptimizerConfig.learning_rate=3e-3",
    "--gin_param=steps.OptimizerConfig.warmup_steps=1",
    f"--gin_param=steps.OptimizerConfig.total_steps={STEPS}",
  ]  # fmt: skip
  run_dir.mkdir(parents=True, exist_ok=True)
  procs = []
  for i in range(processes):
    env = {
      **os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "",
      "ASEARCHER_LOCAL_DEVICE_COUNT": str(8 // processes),
    }  # fmt: skip
    if processes > 1:
      env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes),
                 JAX_PROCESS_ID=str(i))  # fmt: skip
    log = open(run_dir / f"process_{i}.log", "wb")  # noqa: SIM115 (closed with the process)
    procs.append(subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
  return procs


def logs(run_dir: Path) -> str:
  return "\n".join(
    f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:])
    for p in sorted(run_dir.glob("process_*.log"))
  )


def train_losses(run_dir: Path) -> dict[int, float]:
  rows = [json.loads(x) for x in (run_dir / "out" / "metrics" / "metrics.jsonl").read_text()
          .splitlines() if x]  # fmt: skip
  return {int(r["step"]): r["sft/loss"] for r in rows if "sft/loss" in r}


@pytest.mark.slow
def test_two_process_sft_trains_like_one(tmp_path, trajs, tok_dir):  # noqa: F811
  data = tmp_path / "expert.jsonl"
  data.write_text("".join(json.dumps(t.to_json()) + "\n" for t in trajs * 2))
  one, two = tmp_path / "one", tmp_path / "two"
  for run_dir, n in ((one, 1), (two, 2)):
    finish(launch(run_dir, data, tok_dir, n), timeout=240, what=f"sft x {n}",
           logs=lambda run_dir=run_dir: logs(run_dir))  # fmt: skip

  # The same loss trajectory, step by step, written by process 0 alone.
  want, got = train_losses(one), train_losses(two)
  assert sorted(want) == list(range(1, STEPS + 1)) and sorted(got) == sorted(want)
  np.testing.assert_allclose([got[s] for s in want], [want[s] for s in want], rtol=1e-5)
  assert want[STEPS] < want[1]  # it trained
  a, b = (json.loads((d / "out" / "sft_summary.json").read_text()) for d in (one, two))
  assert a["step"] == b["step"] == STEPS
  assert b["final"]["eval/loss"] == pytest.approx(a["final"]["eval/loss"], rel=1e-5)
  assert b["final"]["eval/tokens"] == a["final"]["eval/tokens"] > 0

  # The exported parameters (gathered from both processes' shards) equal the one-process run's.
  pa = flat_params(nnx.split(hf_io.load(one / "out" / "model")[0])[1])
  pb = flat_params(nnx.split(hf_io.load(two / "out" / "model")[0])[1])
  assert sorted(pa) == sorted(pb)
  worst = max(float(np.abs(pa[k] - pb[k]).max()) for k in pa)
  assert worst <= 1e-5, worst
  assert (two / "out" / "model" / "tokenizer.json").is_file()
  # Orbax's multi-host save: each process wrote the shards its devices hold.
  shards = {p.name for p in (two / "out" / "checkpoints" / str(STEPS) / "train_state").iterdir()}
  assert {"ocdbt.process_0", "ocdbt.process_1"} <= shards, shards
