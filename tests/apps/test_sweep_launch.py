"""`asearcher sweep` with `sweeping.sweep.launch` (`sweeping.Launch`): every point a launched run (`python -m
launch start/stop/logs` processes). The gcloud path through its dry run (the exact per-point
commands, and the launcher's own dry run of one of them); a launch that fails is a failed row and
the sweep goes on; one real point on the local backend (retrieval server, one serve-model and one
trainer process of the tiny overlay, 1 RL step) lands in the table and leaves nothing running."""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import sys
import time
from pathlib import Path

import gin
import psutil
import pytest

from asearcher_jax import main as cli
from asearcher_jax.apps import sweep_launch
from launch import cli as launch_cli

REPO = Path(__file__).resolve().parents[2]
V5P_SWEEP = "gin/sweeps/asearcher_local_7b_v5p.gin"
TINY_SWEEP = "gin/sweeps/recipe_tiny_launch.gin"
# The cheapest launched run: one serve-model and one trainer process (and the retrieval server).
SPEC_1X1 = """name = "tiny1"
experiment = "gin/experiments/asearcher_local_qwen2_5_7b.gin"
overlays = ["gin/overlays/recipe_tiny.gin"]
run_dir = "runs/unused"
serving = 1
trainers = 1
"""
# The tiny overlay cut to one step of one group, one turn, 512-token rows (one prefill bucket).
SMALLER = (
  "train_config.TrainConfig.train_steps = 1", "staleness.StalenessConfig.batch_groups = 1",
  "engine.EngineConfig.max_seq_len = 512", "engine.EngineConfig.prefill_buckets = (512,)",
  "learner.PPOConfig.row_len = 512", "asearcher.AsearcherAgentConfig.max_tokens = 512",
  "asearcher.AsearcherAgentConfig.max_turns = 1",
  "asearcher.AsearcherAgentConfig.max_new_tokens = 8",
)  # fmt: skip


def sweep(sweep_file: str, *params: str) -> tuple[int, str, str]:
  gin.clear_config()
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = cli.main(["sweep", sweep_file, *(f"--gin_param={p}" for p in params)])
  gin.clear_config()
  return rc, out.getvalue(), err.getvalue()


@pytest.mark.slow
def test_gcloud_dry_run_prints_every_points_launch_commands(tmp_path):
  root = tmp_path / "v5p"
  rc, out, _ = sweep(V5P_SWEEP, f'sweeping.sweep.root="{root}"', "sweeping.sweep.dry_run=True")
  assert rc == 0 and not root.exists()  # nothing run, nothing written
  spec = REPO / "launch" / "specs" / "v5p_local_7b.toml"
  lines = out.splitlines()
  assert len(lines) == 4 * 5
  p01 = "p01-learning_rate=5e-6-max_staleness=4"
  head = f"{sys.executable} -m launch"
  where = f"--backend gcloud --spec {spec} --run_dir sweeps/v5p/{p01}"
  assert lines[5:10] == [
    f"sweep: {p01}: {head} start {where} --gin_param=steps.OptimizerConfig.learning_rate=5e-6 "
    "--gin_param=staleness.StalenessConfig.max_staleness=4",
    f"sweep: {p01}: {head} status {where}  # every 60 s until no trainer process is alive "
    "(at most 86400 s)",
    f"sweep: {p01}: {head} stop {where}",
    f"sweep: {p01}: {head} logs {where} --lines 5",
    f"sweep: {p01}: {head} fetch {where} --to {root / p01}",
  ]
  # The launcher's own dry run of that start: the trainer on every v5p-32 worker gets the
  # point's bindings and the point's run directory on the bucket mount.
  start = shlex.split(lines[5].split(": ", 2)[2])[3:]
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    assert launch_cli.main([*start, "--dry-run"]) == 0
  trainers = [
    c for c in printed.getvalue().splitlines() if "asearcher_venv/bin/asearcher train" in c
  ]
  assert len(trainers) == 4  # v5p-32: 16 chips, 4 hosts
  for c in trainers:
    assert "staleness.StalenessConfig.max_staleness=4" in c
    assert f"/mnt/asearcher/sweeps/v5p/{p01}/train" in c
  # Its fetch: the point's metrics (TensorBoard files too), episodes and operative config from
  # the bucket into its local dir.
  fetch = shlex.split(lines[9].split(": ", 2)[2])[3:]
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    assert launch_cli.main([*fetch, "--dry-run"]) == 0
  train = f"gs://my-bucket/sweeps/v5p/{p01}/train"
  assert printed.getvalue().splitlines() == [
    f"gcloud storage cp --recursive {train}/metrics {root / p01}",
    f"gcloud storage cp --recursive {train}/episodes.jsonl.gz.segments {root / p01}",
    f"gcloud storage cp {train}/operative_config.gin {root / p01}/operative_config.gin",
  ]
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    assert launch_cli.main([*start[:5], "--run_dir", "/abs", "--dry-run"]) == 2
  assert "--run_dir: '/abs' must be a relative path under gs://my-bucket" in err.getvalue()


@pytest.mark.slow
def test_launch_mistakes_are_one_line_and_a_failed_launch_is_a_failed_row(tmp_path, monkeypatch):
  root = tmp_path / "s"
  rc_spec = f'sweeping.sweep.root="{root}"'
  for param, message in (
    ('sweeping.Launch.backend="xpk"', "Launch.backend: 'xpk' is not one of"),
    (f'sweeping.Launch.spec="{tmp_path}/none.toml"', "Launch.spec: no such file"),
    ('sweeping.sweep.command="quickstart"', "a launched point runs train, not 'quickstart'"),
  ):
    rc, _, err = sweep(TINY_SWEEP, rc_spec, param)
    assert rc == 2 and err.count("\n") == 1 and "asearcher sweep: config error: sweeping." in err
    assert message in err
  assert not root.exists()
  bad = tmp_path / "bad.toml"
  bad.write_text(SPEC_1X1 + "servers = 3\n")  # the launcher's dry run of every point rejects it
  rc, out, err = sweep(
    TINY_SWEEP, rc_spec, "sweeping.sweep.launch=@sweeping.Launch()", f'sweeping.Launch.spec="{bad}"'
  )
  assert rc == 2 and out == "" and err.count("\n") == 1 and not root.exists()
  assert "sweep: p00-learning_rate=1e-5-max_staleness=0: launch start: spec error: " in err
  assert "unknown key(s) servers" in err and "(and 3 more points)" in err
  good = tmp_path / "good.toml"
  good.write_text(SPEC_1X1)
  typo = 'sweeping.sweep.points=({"staleness.StalenessConfig.max_stalenes": "2"},)'
  rc, out, err = sweep(
    TINY_SWEEP,
    rc_spec,
    "sweeping.sweep.launch=@sweeping.Launch()",
    f'sweeping.Launch.spec="{good}"',
    typo,
  )
  assert rc == 2 and out == "" and not root.exists()  # the last point's typo: nothing started
  assert (
    "sweep: p04-max_stalenes=2: launch start: spec error: the " in err and "max_stalenes" in err
  )
  # A start that fails once running (ssh, a port, a slice) is a failed row; the sweep goes on.
  real = sweep_launch._call
  monkeypatch.setattr(sweep_launch, "_call", lambda p, action, log: (
    (2, "") if action == "start" else real(p, action, log)))  # fmt: skip
  rc, out, _ = sweep(
    TINY_SWEEP,
    rc_spec,
    "sweeping.sweep.launch=@sweeping.Launch()",
    f'sweeping.Launch.spec="{good}"',
  )
  assert rc == 1 and out.count("| launch start failed (2; see") == 4
  rows = [json.loads(x) for x in (root / "results.jsonl").read_text().splitlines()]
  assert len(rows) == 4  # every point tried
  assert all(r["status"].startswith("launch start failed (2; see") for r in rows)
  log = (root / rows[0]["point"] / "sweep.log").read_text()
  assert " stop " in log  # stopped even so


@pytest.mark.slow
def test_a_point_past_its_timeout_is_stopped_and_leaves_nothing(tmp_path, monkeypatch):
  """timeout_s = 5: the wait gives up while the roles still start; `stop` ends every process."""
  monkeypatch.setenv("XLA_FLAGS", "")
  spec = tmp_path / "spec.toml"
  spec.write_text(SPEC_1X1)
  root = tmp_path / "sweep"
  rc, out, _ = sweep(TINY_SWEEP, f'sweeping.sweep.root="{root}"',
                     "sweeping.sweep.launch=@sweeping.Launch()", f'sweeping.Launch.spec="{spec}"', "sweeping.sweep.timeout_s=5",
                     'sweeping.sweep.points=({"rollout.RolloutConfig.group_size": "2"},)',
                     'sweeping.sweep.grid={}')  # fmt: skip
  assert rc == 1 and out.count("| timed out after 5 s |") == 1
  point = root / "p00-group_size=2"
  pids = [json.loads(f.read_text())["pid"] for f in (point / "pids").glob("*.json")]
  assert len(pids) == 3  # retrieval, serve-0, trainer-0 were started
  left = [p for p in psutil.process_iter(["cmdline"])
          if str(root) in " ".join(p.info["cmdline"] or [])]  # fmt: skip
  assert not [p for p in left if p.status() != psutil.STATUS_ZOMBIE], left


def test_status_and_logs_parsing_of_both_backends():
  alive = sweep_launch._TRAINER_ALIVE.search
  assert alive("t-w-0 trainer 812 alive\nt-w-0 retrieval 700 alive")  # gcloud
  assert alive("serve-0 9 alive\ntrainer-0 10 alive")  # local
  assert not alive("t-w-0 trainer 812 dead\nt-s-0 serve 13 alive")
  logs = ('==> /home/u/asearcher_run/logs/serve.log <==\n{"not": "this"}\n'
          '==> /home/u/asearcher_run/logs/trainer.log <==\n{"version": 7}\n')  # fmt: skip
  assert sweep_launch._summary(logs) == {"version": 7}
  shutdown = '{"version": 7}\nINFO jax: shutting down\n==> trainer-1.log <==\n{"version": 8}\n'
  assert sweep_launch._summary("==> trainer-0.log <==\n{}\n" + shutdown) == {"version": 7}
  assert sweep_launch._summary("==> trainer-0.log <==\nTraceback ...\n") is None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_local_launched_point_lands_in_the_table(tmp_path, monkeypatch):
  """The shipped tiny launch sweep cut to one point of the 1 x 1 spec: start, supervisor.done,
  stop, the trainer's summary and last metrics row in the table; no process left; a rerun
  starts nothing."""
  monkeypatch.setenv("XLA_FLAGS", "")  # launched roles see one CPU device, as from a shell
  spec = tmp_path / "spec.toml"
  spec.write_text(SPEC_1X1)
  root = tmp_path / "sweep"
  params = (
    f'sweeping.sweep.root="{root}"', "sweeping.sweep.launch=@sweeping.Launch()", f'sweeping.Launch.spec="{spec}"',
    'sweeping.sweep.grid={"staleness.StalenessConfig.max_staleness": ("4",)}',
    f"sweeping.sweep.gin_params={SMALLER!r}".replace("'", '"'), "sweeping.sweep.timeout_s=400",
    "sweeping.sweep.table=@sweeping.Table()",
    'sweeping.Table.metrics=("version", "groups_trained", "last/step")',
  )  # fmt: skip
  try:
    rc, out, _ = sweep(TINY_SWEEP, *params)
    point = root / "p00-max_staleness=4"
    assert rc == 0, out + (point / "sweep.log").read_text()[-3000:]
    assert "| point | max_staleness | version | groups_trained | last/step | status |" in out
    assert "| p00-max_staleness=4 | 4 | 1 | 1 | 1 | ran |" in out
    assert (point / "supervisor.done").read_text().strip() == "0"
    assert (point / "train" / "metrics" / "metrics.jsonl").exists()
    launched = json.loads((point / "launch.json").read_text())["extra"]
    assert "staleness.StalenessConfig.max_staleness=4" in launched
    assert json.loads((point / "summary.json").read_text())["version"] == 1
    op = (point / "train" / "operative_config.gin").read_text()  # the point's own config
    assert "StalenessConfig.max_staleness = 4" in op and "TrainConfig.train_steps = 1" in op
  finally:
    left = [p for p in psutil.process_iter(["cmdline"])
            if str(root) in " ".join(p.info["cmdline"] or [])]  # fmt: skip
  assert not [p for p in left if p.status() != psutil.STATUS_ZOMBIE], left
  rc, out, _ = sweep(TINY_SWEEP, *params)
  assert rc == 0 and "| done before |" in out


def test_dry_run_of_local_process_points(tmp_path):
  """Without launch_spec a dry run prints each point's `asearcher` process and runs nothing."""
  root = tmp_path / "q"
  rc, out, _ = sweep("gin/sweeps/quickstart_ci.gin", f'sweeping.sweep.root="{root}"',
                     "sweeping.sweep.dry_run=True")  # fmt: skip
  lines = out.splitlines()
  assert rc == 0 and len(lines) == 4 and not root.exists()
  argv = shlex.split(lines[3].split(": ", 2)[2])
  assert argv[:4] == [sys.executable, "-m", "asearcher_jax.main", "quickstart"]
  assert "--gin_param=staleness.StalenessConfig.max_staleness=4" in argv
  assert (
    f"--operative_config={root}/p03-learning_rate=3e-4-max_staleness=4/operative_config.gin" in argv
  )


def test_gcloud_wait_ends_with_the_trainer_or_after_repeated_status_failures(monkeypatch, tmp_path):
  """The gcloud wait on `status` output as launch prints it (gcloud itself cannot run here):
  done once no trainer process is alive; a passing failure is retried, three in a row (slices
  preempted or deleted) fail the point; the deadline bounds it all."""
  monkeypatch.setitem(sweep_launch.POLL_S, "gcloud", 0.0)
  p = sweep_launch.LaunchPoint(spec="s.toml", backend="gcloud", run_dir="sweeps/x/p00",
                               gin_params=(), local_dir=str(tmp_path))  # fmt: skip

  def wait_on(answers: list[tuple[int, str]], deadline_s: float = 30.0):
    calls = iter(answers)
    monkeypatch.setattr(sweep_launch, "_call", lambda p, action, log: next(calls))
    return sweep_launch._wait(p, None, time.monotonic() + deadline_s)

  running = (0, "ACTIVE\nw0 trainer 812 alive\nw0 retrieval 700 alive\n")
  over = (0, "ACTIVE\nw0 trainer 812 dead\nw0 retrieval 700 alive\n")
  assert wait_on([running, (1, ""), running, over]) is None
  why = wait_on([running, (1, ""), (1, ""), (1, ""), running])
  assert why is not None and why.startswith("launch status failed 3 times in a row")
  monkeypatch.setitem(sweep_launch.POLL_S, "gcloud", 0.05)
  assert wait_on([running] * 1000, deadline_s=0.2) == "timed out"
