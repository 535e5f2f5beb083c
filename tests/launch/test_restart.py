"""A role's process restarted by launch/supervise.py, as on a TPU VM: the local backend with
`restarts` wraps every role in it. The trainer of a local pod run SIGKILLed after its first
checkpoint comes back, resumes from that checkpoint and reaches its train_steps; a stand-in
that fails once is restarted within the budget without a model."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from launch import local
from tests.launch.test_local import assert_nothing_left, launch, wait_for

SPEC = """name = "restart"
experiment = "gin/experiments/asearcher_local_qwen2_5_7b.gin"
overlays = ["gin/overlays/recipe_tiny.gin"]
run_dir = "{run}"
serving = 1
trainers = 1
restarts = 2
restart_backoff_s = 0.5
"""


def test_a_role_that_fails_once_is_restarted_and_the_run_succeeds(tmp_path, capsys):
  spec = local.LocalSpec(name="t", experiment="e.gin", run_dir=str(tmp_path), restarts=1,
                         restart_backoff_s=0.0)  # fmt: skip
  sup = local.Supervisor(spec, tmp_path, ())
  for d in ("logs", "pids"):
    (tmp_path / d).mkdir()
  marker = tmp_path / "ran"
  once = (f"import pathlib, sys; m = pathlib.Path({str(marker)!r}); first = not m.exists(); "
          "m.touch(); sys.exit(5 if first else 0)")  # fmt: skip
  sup.spawn("trainer-0", [sys.executable, "-c", once])
  assert sup.loop(poll_s=0.1) == 0
  log = (tmp_path / "logs" / "trainer-0.log").read_text()
  assert "exited 5; restart 1/1" in log and "exited 0; done" in log
  pid = json.loads((tmp_path / "pids" / "trainer-0.json").read_text())
  assert pid["argv"][1:3] == ["-m", "launch.supervise"]  # the supervisor is the role's process


def _checkpoint_steps(run: Path) -> list[int]:
  d = run / "train" / "checkpoints"
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


@pytest.mark.slow
def test_a_killed_trainer_is_restarted_and_resumes_from_its_checkpoint(tmp_path, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "")  # each role's own device, not the suite's 8
  run, spec = tmp_path / "run", tmp_path / "spec.toml"
  spec.write_text(SPEC.format(run=run))
  assert launch("start", spec)[0] == 0
  seen: set[int] = set()
  log = run / "logs" / "trainer-0.log"
  try:
    wait_for("a checkpoint", lambda: _checkpoint_steps(run) and "published version 1 " in
             log.read_text())  # fmt: skip
    child_file = run / "pids" / "trainer-0.child"
    child = int(child_file.read_text())
    seen |= {child, *local.pids(run).values()}
    os.kill(child, signal.SIGKILL)
    seen.add(wait_for("the trainer restarted",
                      lambda: (p := int(child_file.read_text() or 0)) != child and p))  # fmt: skip
    done = run / "supervisor.done"
    code = wait_for("the trainer's end", lambda: done.exists() and done.read_text().strip())
  finally:
    seen |= set(local.pids(run).values())
    assert launch("stop", spec)[0] == 0
  text = log.read_text()
  assert code == "0", text[-3000:]
  assert "exited -9; restart 1/2" in text
  resumed = [line for line in text.splitlines() if line.startswith("[train] resumed at version ")]
  assert len(resumed) == 1, text[-3000:]
  # The summary is the trainer's last JSON line (the supervisor's own lines follow it).
  summary = json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
  assert text.strip().splitlines()[-1].endswith("exited 0; done")
  assert summary["resumed_from"] >= 1 and summary["version"] == 3  # the tiny recipe's steps
  assert max(_checkpoint_steps(run)) == 3
  assert_nothing_left(run, seen)
