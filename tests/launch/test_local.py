"""The local backend end to end: the tiny overlay of the ASearcher-Local 7B recipe as real
processes (retrieval server, 2 serve-model servers, 2 trainer processes of one fake CPU device
each joined by jax.distributed over 127.0.0.1, the weights store in a directory), a server
SIGKILLed mid-run and brought back by the launcher, 3 RL steps trained on one 2-device mesh and
generated on the servers, then `stop` leaves no process behind (checked with psutil); a trainer
process SIGKILLed mid-run ends the run at once. One device per trainer process: with this
overlay's 1,024-token rows a process holds ~2 GB of learner temporaries per device (measured
2026-11-25: peak RSS 2 x 3.1 GB with 1 device each, 2 x 5.0 GB with 2), and the suite shares its
machine; tests/rl/test_multihost.py covers several devices per process."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
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
trainers = 2
trainer_devices = 1
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


def assert_nothing_left(run: Path, seen: set[int]) -> None:
  """No live process of the run: none of the pids seen, none naming the run directory."""
  left = [p for p in psutil.process_iter(["pid", "cmdline"])
          if p.info["pid"] in seen or str(run) in " ".join(p.info["cmdline"] or [])]  # fmt: skip
  assert not [p for p in left if p.status() != psutil.STATUS_ZOMBIE], left


def test_local_spec_errors(tmp_path):
  def start_fails(text: str) -> str:
    """`start` on a spec of `text`: exit status 2 and nothing created; returns stderr."""
    bad = tmp_path / "s.toml"
    bad.write_text(text)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
      assert cli.main(["start", "--backend", "local", "--spec", str(bad)]) == 2
    assert not (tmp_path / "r").exists()
    return err.getvalue()

  good = SPEC.format(run=tmp_path / "r")
  assert "unknown key(s) servers" in start_fails(good + "servers = 3\n")
  zero = good.replace("trainer_devices = 1", "trainer_devices = 0")
  assert "trainer_devices must be an integer >= 1, got 0" in start_fails(zero)
  assert "not valid TOML" in start_fails(good + "trainers = 3\n")  # a duplicate key
  wrong = good.replace('overlays = ["gin/overlays/recipe_tiny.gin"]', "overlays = 'x.gin'")
  assert "overlays must be a list of strings" in start_fails(wrong)
  wrong = good.replace(
    'experiment = "gin/experiments/asearcher_local_qwen2_5_7b.gin"', "experiment = 7"
  )
  assert "experiment must be one gin file path (a string), got 7" in start_fails(wrong)


def test_a_dry_run_leaves_an_earlier_run_as_it_was_and_bad_pid_files_are_named(tmp_path, capsys):
  run = tmp_path / "r"
  (run / "pids").mkdir(parents=True)
  (run / "pids" / "trainer-0.json").write_text('{"role": "trainer-0", "pid": 1234')  # torn
  (run / "supervisor.done").write_text("0\n")
  (run / "supervisor.pid").write_text("abc")
  (run / "launch.json").write_text("{}")
  spec = tmp_path / "s.toml"
  spec.write_text(SPEC.format(run=run))
  assert cli.main(["start", "--backend", "local", "--spec", str(spec), "--dry-run"]) == 0
  assert (run / "pids" / "trainer-0.json").exists() and (run / "supervisor.done").exists()
  assert (run / "launch.json").read_text() == "{}"
  capsys.readouterr()
  assert cli.main(["status", "--backend", "local", "--spec", str(spec)]) == 0
  err = capsys.readouterr().err
  assert "trainer-0.json is not a pid file this launcher wrote; skipped" in err
  assert "supervisor.pid holds no pid; skipped" in err


def test_trainer_processes_get_jax_distributed_env(tmp_path):
  spec = local.LocalSpec(
    name="t", experiment="e.gin", run_dir=str(tmp_path), serving=2, trainers=2, trainer_devices=4
  )
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
  assert {e["ASEARCHER_LOCAL_DEVICE_COUNT"] for e in envs} == {"4"}
  train_argv = started[3][1]
  assert any("serve-0.json" in a and "serve-1.json" in a for a in train_argv)


def stand_in(code: str) -> list[str]:
  return [sys.executable, "-c", code]


@pytest.mark.parametrize("trainer_1", ["import sys; sys.exit(3)", "pass"])
def test_a_trainer_program_that_loses_a_process_is_stopped(tmp_path, trainer_1, capsys):
  """One trainer process exits (with an error, or cleanly while trainer 0 hangs): the supervisor
  ends the run within its grace, tears every process down and reports failure."""
  spec = local.LocalSpec(name="t", experiment="e.gin", run_dir=str(tmp_path), trainers=2)
  sup = local.Supervisor(spec, tmp_path, ())
  for d in ("logs", "pids"):
    (tmp_path / d).mkdir()
  sleeper = stand_in("import time; time.sleep(120)")
  for role, argv in (
    ("serve-0", sleeper),
    ("trainer-0", sleeper),
    ("trainer-1", stand_in(trainer_1)),
  ):
    sup.spawn(role, argv)
  t0 = time.monotonic()
  assert sup.loop(poll_s=0.1, trainer_grace_s=2.0) == 1
  assert time.monotonic() - t0 < 60
  assert all(p.poll() is not None for p in sup.procs.values())
  out = capsys.readouterr().out
  if "exit" in trainer_1:
    assert "trainer-1 exited 3; the trainer program lost a process" in out
  else:
    assert "trainer-0 still running 2 s after another trainer process finished" in out


@pytest.fixture
def launched(tmp_path, monkeypatch):
  """`launch start` of SPEC; yields (run dir, pids seen); then `launch stop`, and nothing of the
  run (no process it started, no stale pid file) is left."""
  # The launched roles see one CPU device each, as on a laptop (not the suite's 8 fake devices).
  monkeypatch.setenv("XLA_FLAGS", "")
  run = tmp_path / "run"
  spec = tmp_path / "spec.toml"
  spec.write_text(SPEC.format(run=run))
  assert launch("start", spec)[0] == 0
  seen: set[int] = set()
  try:
    yield run, seen
  finally:
    seen |= set(local.pids(run).values())
    assert launch("stop", spec)[0] == 0
  assert_nothing_left(run, seen)


@pytest.mark.slow
def test_local_backend_survives_a_killed_server_and_stops_clean(launched, tmp_path):
  run, seen = launched
  spec = tmp_path / "spec.toml"
  trainer_log, follower_log = (run / "logs" / f"trainer-{i}.log" for i in (0, 1))
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
  summaries = [
    json.loads(f.read_text().strip().splitlines()[-1]) for f in (trainer_log, follower_log)
  ]
  assert [s["version"] for s in summaries] == [3, 3]
  assert summaries[0]["groups_trained"] == summaries[1]["groups_trained"] == 6  # B = 2, 3 steps
  for i, f in enumerate((trainer_log, follower_log)):  # one program over 2 processes
    assert f"process {i} of 2, 1 local / 2 global devices" in f.read_text()
  # Only process 0 writes the metrics: one line per step.
  metrics = (run / "train" / "metrics" / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(x)["step"] for x in metrics] == [1, 2, 3]
  # Every trainer process wrote its shards of the last version, and both servers loaded it.
  parts = run / "weights" / "v00000003" / "parts"
  assert sorted(p.name for p in parts.iterdir()) == ["process_0.json", "process_1.json"]
  for i in (0, 1):
    assert "loaded version 3 " in (run / "logs" / f"serve-{i}.log").read_text()
  log = (run / "supervisor.log").read_text()
  assert "serve-0 (pid" in log  # the restart was logged
  assert "ignored SIGTERM" not in log, log  # every role ends on SIGTERM
  assert len(list((run / "weights").glob("v*"))) >= 1


@pytest.mark.slow
def test_a_killed_trainer_process_ends_the_run(launched):
  """SIGKILL trainer process 1 while process 0 waits for rollouts (in a collective every poll):
  the supervisor ends the run at once instead of leaving process 0 to the heartbeat timeout, and
  `stop` finds nothing left."""
  run, seen = launched
  follower_log = run / "logs" / "trainer-1.log"
  wait_for("trainer 1's start", lambda: follower_log.exists()
           and "[train] fresh start" in follower_log.read_text())  # fmt: skip
  pids = local.pids(run)
  seen |= set(pids.values())
  os.kill(pids["trainer-1"], signal.SIGKILL)
  t0 = time.monotonic()
  done = run / "supervisor.done"
  code = wait_for("the run's end", lambda: done.exists() and done.read_text().strip(), 90.0)
  took = time.monotonic() - t0
  assert code == "1"
  log = (run / "supervisor.log").read_text()
  assert "trainer-1 exited -9; the trainer program lost a process" in log
  assert "ignored SIGTERM" not in log, log  # trainer 0 honoured it (no JAX preemption trap)
  assert not any(local._alive(p) for p in pids.values() if p != pids["supervisor"]), took


@pytest.mark.slow
def test_two_retrieval_replicas_share_the_requests(tmp_path, monkeypatch):
  """`retrieval = 2`: two real `asearcher serve-retrieval` processes on loopback, started at once
  (they build the shipped corpus's default index under one lock: one builds, the other reuses),
  both announced in the run's address dir; the trainer's retrieval client, given that dir,
  spreads its searches over both (each server's /health counts some)."""
  import asyncio

  import aiohttp

  from asearcher_jax.tools.http_retry import CallStats
  from asearcher_jax.tools.search import LocalRetrievalClient, LocalRetrievalConfig

  monkeypatch.setenv("ASEARCHER_HOME", str(tmp_path / "home"))  # a fresh default index
  spec = local.LocalSpec(name="t", experiment="gin/experiments/asearcher_local_qwen2_5_7b.gin",
                         overlays=("gin/overlays/recipe_tiny.gin",), run_dir=str(tmp_path / "r"),
                         retrieval=2)  # fmt: skip
  sup = local.Supervisor(spec, tmp_path / "r", ())
  sup.start_retrieval()
  try:
    assert sorted(sup.procs) == ["retrieval-0", "retrieval-1"]
    addr_dir = tmp_path / "r" / "retrieval"
    wait_for("two announced servers", lambda: len(list(addr_dir.glob("Host*_IP*.txt"))) == 2, 300)
    trainer_argv = " ".join(local.roles.trainer_argv(sup.lay))
    assert f'LocalRetrievalConfig.addr_dir="{addr_dir}"' in trainer_argv

    async def spread() -> list[int]:
      client = LocalRetrievalClient(LocalRetrievalConfig(addr_dir=str(addr_dir)))
      try:
        for q in ("Teutberga", "Lothair II", "demon", "Lilu", "queen", "river") * 2:
          docs = await asyncio.wait_for(client.search(q, 3, CallStats()), 30)
          assert docs
        counts = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
          for address in client.servers():
            async with s.get(f"http://{address}/health") as resp:
              counts.append((await resp.json())["requests"]["retrieve"])
        return counts
      finally:
        await client.close()

    counts = asyncio.run(spread())
    assert len(counts) == 2 and sum(counts) == 12 and min(counts) >= 5, counts
  finally:
    sup.teardown(grace_s=20)
  assert all(p.poll() is not None for p in sup.procs.values())
