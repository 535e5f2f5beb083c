"""The multi-host learner: 2 processes x 4 fake CPU devices (jax.distributed over 127.0.0.1, gloo
collectives) train exactly like 1 process x 8 devices, and survive SIGKILL.

Each process runs tests/rl/multihost_worker.py: the real Learner / Trainer / Orbax checkpointer /
persisted replay queue / staleness manager on a (data 2, fsdp 2, tensor 2) mesh over all 8
devices, with deterministic groups admitted through the staleness rule (the worker's
`ScriptedRollout`). The single-process run is the oracle: the same groups in the same steps, the
same parameters after every step (<= 1e-5), the same staleness and replay counters. Then both
processes are SIGKILLed after step 3 (checkpoint 2 on disk, step 3 trained but in no
checkpoint), restarted, and must end where the uninterrupted run ends, with every group in the
replay journal committed exactly once.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from asearcher_jax import distributed
from asearcher_jax.apps import export as export_lib
from asearcher_jax.apps.train import POLICY_CONFIG
from asearcher_jax.model import hf_io
from asearcher_jax.model.sharding import MeshConfig
from asearcher_jax.serving.weights_dir import load_version, version_dir, versions
from asearcher_jax.tokenizer import Tokenizer
from tests.processes import finish, free_port, kill
from tests.rl.test_trainer_e2e import pending_on_disk, replay_logs

REPO = Path(__file__).resolve().parents[2]
STEPS, CHECKPOINT_EVERY, KILL_AFTER, TOTAL_GROUPS = 5, 2, 3, 16


def worker_spec(run_dir: Path, *, processes: int, process_id: int, port: int | None, **kw) -> dict:
  return {
    "num_processes": processes, "process_id": process_id, "local_devices": 8 // processes,
    "coordinator": f"127.0.0.1:{port}" if port else None, "run_dir": str(run_dir),
    "out_dir": str(run_dir / "out"), "total_groups": TOTAL_GROUPS, "steps": STEPS,
    "checkpoint_every": CHECKPOINT_EVERY, **kw,
  }  # fmt: skip


def launch(run_dir: Path, processes: int, **kw) -> list[subprocess.Popen]:
  port = free_port() if processes > 1 else None
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  run_dir.mkdir(parents=True, exist_ok=True)
  procs = []
  for i in range(processes):
    spec = worker_spec(run_dir, processes=processes, process_id=i, port=port, **kw)
    log = open(run_dir / f"worker_{i}.log", "ab")  # noqa: SIM115 (closed with the process)
    procs.append(
      subprocess.Popen(
        [sys.executable, "-m", "tests.rl.multihost_worker", json.dumps(spec)],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
      )
    )  # fmt: skip
  return procs


def logs(run_dir: Path) -> str:
  out = []
  for p in sorted(run_dir.glob("worker_*.log")):
    lines = [x for x in p.read_text(errors="replace").splitlines() if "spmd_partitioner" not in x]
    out.append(f"--- {p.name}\n" + "\n".join(lines[-40:]))
  return "\n".join(out)


def params(run_dir: Path, version: int) -> dict[str, np.ndarray]:
  with np.load(run_dir / "out" / f"params_v{version}.npz") as f:
    return dict(f)


def flat_params(state) -> dict[str, np.ndarray]:
  """The worker's npz layout: keystr of every leaf path -> array."""
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree.leaves_with_path(state)}


def assert_params_close(got: dict, want: dict) -> None:
  assert sorted(got) == sorted(want)
  worst = max(float(np.abs(got[k] - want[k]).max()) for k in want)
  assert worst <= 1e-5, worst


def metrics(run_dir: Path) -> list[dict]:
  text = (run_dir / "metrics" / "metrics.jsonl").read_text()
  return [json.loads(x) for x in text.splitlines() if x]


def counters(m: dict, *, windows: bool = True) -> dict:
  """The staleness and replay counters of one step. Left out: timings, and `replay/leased`,
  which counts groups whose asynchronous checkpoint had not finished when the step began
  (timing). `windows=False` also leaves out the per-bucket counts, windows that restart with
  the process."""
  return {
    k: v for k, v in m.items()
    if k.startswith(("staleness/", "replay/")) and "wait_s" not in k and k != "replay/leased"
    and (windows or not k.startswith("replay/len_"))
  }  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
  """1 process x 8 devices, STEPS steps uninterrupted: the oracle."""
  run_dir = tmp_path_factory.mktemp("one_process")
  procs = launch(run_dir, 1)
  finish(procs, timeout=300, what="workers", logs=lambda: logs(run_dir))
  return run_dir


@pytest.mark.slow
def test_two_processes_train_like_one_and_resume_after_sigkill(tmp_path, reference):
  ref = json.loads((reference / "out" / "result_0.json").read_text())
  flat = [g for step in ref["trained_ids"] for g in step]
  assert ref["version"] == STEPS and flat == [f"g{i:03d}" for i in range(2 * STEPS)]

  # --- life 1: two processes, paused (then killed) after step KILL_AFTER -----------------------
  run_dir = tmp_path / "two_processes"
  procs = launch(run_dir, 2, pause_after=KILL_AFTER)
  try:
    markers = [run_dir / "out" / f"paused_{i}" for i in range(2)]
    checkpoint = run_dir / "ckpt" / str(CHECKPOINT_EVERY)  # Orbax renames it when complete
    deadline = time.monotonic() + 300
    while not (all(m.exists() for m in markers) and checkpoint.is_dir()):
      assert all(p.poll() is None for p in procs), logs(run_dir)
      assert time.monotonic() < deadline, "no pause within 300 s\n" + logs(run_dir)
      time.sleep(0.1)
    # Every step so far equals the one-process run: parameters, batches, counters.
    for v in range(1, KILL_AFTER + 1):
      assert_params_close(params(run_dir, v), params(reference, v))
    two, one = metrics(run_dir), metrics(reference)
    assert [m["step"] for m in two] == list(range(1, KILL_AFTER + 1))  # the lead alone wrote
    for a, b in zip(two, one):
      assert counters(a) == counters(b) and counters(a)
      assert a["ppo/loss"] == pytest.approx(b["ppo/loss"], abs=1e-6)
    # Orbax's multi-host save: each process wrote the shards its devices hold.
    shards = {p.name for p in (checkpoint / "train_state").iterdir()}
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= shards, shards
  finally:
    kill(procs)  # SIGKILL both mid-run: step 3 is trained but in no checkpoint

  # --- life 2: the same command again resumes from checkpoint 2 ----------------------------------
  procs = launch(run_dir, 2, export=True, store=True)
  finish(procs, timeout=300, what="workers", logs=lambda: logs(run_dir))
  lead, follower = (json.loads((run_dir / "out" / f"result_{i}.json").read_text()) for i in (0, 1))
  assert lead["resumed"] == CHECKPOINT_EVERY == follower["resumed"]
  assert lead["version"] == STEPS == follower["version"]
  # The groups of step 3 (lost with the processes) are trained again, then the rest, in the
  # reference's order; the follower trained exactly the lead's batches.
  assert lead["trained_ids"] == ref["trained_ids"][CHECKPOINT_EVERY:] == follower["trained_ids"]
  # Published through the sharded weight store this time (every process its own shards).
  assert versions(run_dir / "weights")[-1] == STEPS
  assert_params_close(flat_params(load_version(version_dir(run_dir / "weights", STEPS))),
                      params(reference, STEPS))  # fmt: skip
  assert lead["staleness"] == ref["staleness"]
  assert lead["pending"] == ref["pending"]
  for a, b in zip(metrics(run_dir)[KILL_AFTER:], metrics(reference)[CHECKPOINT_EVERY:]):
    assert a["step"] == b["step"] and counters(a, windows=False) == counters(b, windows=False)
  # The replay journal: every group committed exactly once, in order; nothing pushed was lost.
  pushed, committed, discarded = replay_logs(run_dir / "replay")
  assert committed == flat and not discarded
  assert len(pushed) == len(set(pushed))
  assert sorted(pushed) == sorted(committed + pending_on_disk(run_dir / "replay"))
  assert replay_logs(reference / "replay") == (pushed, committed, discarded)
  # The HF export of the final policy: tensors sharded over both processes were gathered, and
  # the checkpoint process 0 wrote loads back to the same parameters.
  model, _ = hf_io.load(run_dir / "export")
  assert_params_close(flat_params(nnx.split(model)[1]), params(reference, STEPS))
  # `asearcher export` in one process reads the checkpoint both processes wrote (each its own
  # shards) into the same parameters: a pod's checkpoint leaves the pod. The worker's files laid
  # out as `asearcher train` lays out a run (checkpoints/, tokenizer/, policy_config.json).
  pod = tmp_path / "pod_run"
  pod.mkdir()
  (pod / "checkpoints").symlink_to(run_dir / "ckpt")
  shutil.copy(run_dir / "export" / "config.json", pod / POLICY_CONFIG)
  Tokenizer.qwen2().save(pod / "tokenizer")
  assert export_lib.export(run_dir=str(pod), out_dir=str(tmp_path / "exported")) == 0
  assert json.loads((tmp_path / "exported" / export_lib.EXPORTED_FROM).read_text())["step"] == STEPS
  model, _ = hf_io.load(tmp_path / "exported")
  assert_params_close(flat_params(nnx.split(model)[1]), params(reference, STEPS))


@pytest.mark.slow
def test_two_processes_publish_in_the_background_beside_checkpoints(tmp_path, reference):
  """Both processes publish every version on their writer threads while the next steps train
  and Orbax checkpoints on the trainer thread (the pair that deadlocked when the weights went
  through Orbax too): no wait hangs (every one has a timeout; the run must finish), every
  committed version holds the learner's parameters of its own step, a superseded version is
  never half-written, both processes wrote the same versions, and the trainer thread's share
  of a publish is small against the write."""
  run_dir = tmp_path / "background"
  procs = launch(run_dir, 2, store=True, background=True)
  finish(procs, timeout=300, what="workers", logs=lambda: logs(run_dir))
  lead, follower = (json.loads((run_dir / "out" / f"result_{i}.json").read_text()) for i in (0, 1))
  assert lead["version"] == STEPS == follower["version"]
  assert lead["store"]["written"] == follower["store"]["written"]
  written, superseded = lead["store"]["written"], lead["store"]["superseded"]
  assert written[-1] == STEPS and sorted(written + superseded) == list(range(1, STEPS + 1))
  assert versions(run_dir / "weights") == written  # committed: every process's part is there
  for v in written:
    got = flat_params(load_version(version_dir(run_dir / "weights", v)))
    assert_params_close(got, params(reference, v))
    parts = sorted(p.name for p in (version_dir(run_dir / "weights", v) / "parts").iterdir())
    assert parts == ["process_0.json", "process_1.json"]
  charged = [m["weight_sync/charged_s"] for m in lead["history"] if "weight_sync/charged_s" in m]
  writes = list(lead["store"]["write_s"].values())
  assert len(charged) == STEPS and writes
  # The trainer thread takes the copy and starts the device->host transfer; the writer waits
  # for the bytes, writes them and meets the other process at three barriers.
  assert float(np.median(charged)) < 0.5 * float(np.median(writes)), (charged, writes)


# --- fast checks of the bootstrap -------------------------------------------------------------


def test_distributed_config_from_environment():
  env = {
    "JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234",
    "JAX_NUM_PROCESSES": "4",
    "JAX_PROCESS_ID": "3",
  }
  cfg = distributed.DistributedConfig().resolved(env)
  assert (cfg.coordinator_address, cfg.num_processes, cfg.process_id) == ("10.0.0.2:1234", 4, 3)
  assert cfg.multi_process
  # gin (explicit fields) wins over the environment
  assert distributed.DistributedConfig(process_id=1).resolved(env).process_id == 1
  assert not distributed.DistributedConfig().resolved({}).multi_process
  with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two' is not an integer"):
    distributed.DistributedConfig().resolved({"JAX_NUM_PROCESSES": "two"})


def test_distributed_config_mistakes_name_the_field(monkeypatch):
  for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(var, raising=False)
  with pytest.raises(ValueError, match="coordinator_address, process_id unset"):
    distributed.initialize(distributed.DistributedConfig(num_processes=2))
  with pytest.raises(ValueError, match="process_id 2 >= num_processes 2"):
    distributed.initialize(
      distributed.DistributedConfig(
        coordinator_address="127.0.0.1:1", num_processes=2, process_id=2
      )
    )
  with pytest.raises(ValueError, match="num_processes must be >= 1"):
    distributed.DistributedConfig(num_processes=0)
  # One process with nothing set: nothing to join, the lead of itself.
  assert not distributed.initialize(
    distributed.DistributedConfig(tpu_autodetect="never")
  ).multi_process
  assert distributed.is_lead() and distributed.broadcast_bytes(b"abc") == b"abc"
  assert distributed.agree(7) == 7


def test_mesh_config_fills_and_validates():
  mesh = MeshConfig(data=2, fsdp=-1, tensor=2).build()
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert dict(MeshConfig().build().shape) == {"data": 1, "fsdp": 8, "tensor": 1}
  with pytest.raises(ValueError, match="at most one -1"):
    MeshConfig(data=-1, fsdp=-1)
  with pytest.raises(ValueError, match="needs 16 devices"):
    MeshConfig(data=2, fsdp=4, tensor=2).build()


def test_pod_recipe_binds_the_bootstrap_and_the_mesh():
  """main.py reads the DistributedConfig the gin files bind (library defaults when none does)
  and `asearcher train` gets the mesh."""
  import gin

  from asearcher_jax import main
  from asearcher_jax.apps.train_config import TrainConfig

  try:
    fn = main.configure("train", [str(REPO / "gin/runs/train_pod.gin")], [])
    cfg = main.distributed_config()
    assert cfg.initialization_timeout_s == 600 and cfg.num_processes is None
    train_cfg = gin.get_configurable(TrainConfig)()
    assert train_cfg.mesh == MeshConfig(data=1, fsdp=-1, tensor=1)
    assert dict(train_cfg.learner_mesh().shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert callable(fn)
    gin.clear_config()
    main.configure("train", [], [])
    assert main.distributed_config() == distributed.DistributedConfig()
  finally:
    gin.clear_config()
