"""The local backend end to end: the tiny overlay of the ASearcher-Local 7B recipe as real
processes (retrieval server, 2 serve-model servers, 1 trainer with remote engines and the weights
store in a directory), a server SIGKILLed mid-run and brought back by the launcher, 3 RL steps,
then `stop` leaves no process behind (checked with psutil). One trainer process: the multi-host
learner that would join 2 through jax.distributed is not on main yet (the launcher already gives
each trainer process its JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from launch import cli, local

SPEC = """name = "tiny"
experiment = "gin/experiments/asearcher_local_qwen2_5_7b.gin"
overlays = ["gin/overlays/recipe_tiny.gin"]
run_dir = "{run}"
serving = 2
trainers = 1
"""


def launch(action: str, spec: Path) -> tuple[int, str]:
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    rc = cli.main([action, "--backend", "local", "--spec", str(spec)])
  return rc, out.getvalue()


def wait_for(what: str, cond, timeout_s: float = 900.0):
  deadline = time.monotonic() + timeout_s
  while not (v := cond()):
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.5)
  return v


def test_local_spec_errors(tmp_path):
  bad = tmp_path / "s.toml"
  bad.write_text(SPEC.format(run=tmp_path / "r") + "servers = 3\n")
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    assert cli.main(["start", "--backend", "local", "--spec", str(bad)]) == 2
  assert "unknown key(s) servers" in err.getvalue() and not (tmp_path / "r").exists()


def test_trainer_processes_get_jax_distributed_env(tmp_path):
  spec = local.LocalSpec(name="t", experiment="e.gin", run_dir=str(tmp_path), serving=2, trainers=2)
  sup = local.Supervisor(spec, tmp_path, ())
  started = []
  sup.spawn = lambda role, argv, env=None: started.append((role, argv, env))
  sup.start()
  roles = [r for r, _, _ in started]
  assert roles == ["retrieval", "serve-0", "serve-1", "trainer-0", "trainer-1"]
  envs = [e for r, _, e in started if r.startswith("trainer")]
  assert [e["JAX_PROCESS_ID"] for e in envs] == ["0", "1"]
  assert {e["JAX_NUM_PROCESSES"] for e in envs} == {"2"}
  assert len({e["JAX_COORDINATOR_ADDRESS"] for e in envs}) == 1
  train_argv = started[3][1]
  assert any("serve-0.json" in a and "serve-1.json" in a for a in train_argv)


@pytest.mark.slow
def test_local_backend_survives_a_killed_server_and_stops_clean(tmp_path, monkeypatch):
  # The launched roles see one CPU device each, as on a laptop (not the suite's 8 fake devices).
  monkeypatch.setenv("XLA_FLAGS", "")
  run = tmp_path / "run"
  spec = tmp_path / "spec.toml"
  spec.write_text(SPEC.format(run=run))
  assert launch("start", spec)[0] == 0
  seen: set[int] = set()
  try:
    trainer_log = run / "logs" / "trainer-0.log"
    wait_for("version 1", lambda: trainer_log.exists()
             and "published version 1 " in trainer_log.read_text())  # fmt: skip
    pids = local.pids(run)
    seen |= set(pids.values())
    os.kill(pids["serve-0"], signal.SIGKILL)
    new = wait_for("serve-0 restarted", lambda: (p := local.pids(run)["serve-0"]) != pids["serve-0"]
                   and local._alive(p) and p)  # fmt: skip
    seen.add(new)
    _, out = launch("status", spec)
    assert f"serve-0 {new} alive" in out and "serve-1" in out and "retrieval" in out
    code = wait_for("the trainer's end", lambda: (run / "supervisor.done").exists()
                    and (run / "supervisor.done").read_text().strip())  # fmt: skip
    assert code == "0", trainer_log.read_text()[-3000:]
    summary = json.loads(trainer_log.read_text().strip().splitlines()[-1])
    assert summary["version"] == 3
    assert "serve-0 (pid" in (run / "supervisor.log").read_text()  # the restart was logged
    assert len(list((run / "weights").glob("v*"))) >= 1
  finally:
    seen |= set(local.pids(run).values())
    assert launch("stop", spec)[0] == 0
  left = [p for p in psutil.process_iter(["pid", "cmdline"])
          if p.info["pid"] in seen or str(run) in " ".join(p.info["cmdline"] or [])]  # fmt: skip
  assert not [p for p in left if p.status() != psutil.STATUS_ZOMBIE], left
