"""launch/supervise.py: a role's process restarted after a failed exit or a SIGKILL, within its
restart budget, its log shipped to the run dir, and a stop that ends it without a restart."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from launch import supervise
from launch.spec import REPO

# Fails (exit 3) until it has run `n` times, then exits 0; every run appends a line to `count`.
FLAKY = (
  "import sys, pathlib; c = pathlib.Path(sys.argv[1]); n = int(sys.argv[2]); "
  "c.write_text(c.read_text() + 'x' if c.exists() else 'x'); "
  "print('run', len(c.read_text()), flush=True); sys.exit(0 if len(c.read_text()) >= n else 3)"
)


def _run(tmp_path: Path, *opts: str, ok_after: int) -> tuple[int, str, str]:
  count = tmp_path / "count"
  argv = [sys.executable, "-m", "launch.supervise", *opts, f"--log={tmp_path}/vm/role.log",
          f"--ship-to={tmp_path}/bucket/logs", "--backoff-s=0.05", "--",
          sys.executable, "-c", FLAKY, str(count), str(ok_after)]  # fmt: skip
  p = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
  return p.returncode, count.read_text(), (tmp_path / "bucket/logs/role.log").read_text()


def test_a_failing_process_is_restarted_until_it_succeeds_and_its_log_is_shipped(tmp_path):
  rc, count, shipped = _run(tmp_path, "--max-restarts=3", ok_after=3)
  assert rc == 0 and count == "xxx"
  assert [line for line in shipped.splitlines() if line.startswith("run ")] == [
    "run 1", "run 2", "run 3"
  ]  # fmt: skip
  assert "exited 3; restart 1/3" in shipped and "exited 3; restart 2/3" in shipped
  assert shipped == (tmp_path / "vm/role.log").read_text()  # the whole log, not its tail


def test_the_restart_budget_ends_with_the_process_status(tmp_path):
  rc, count, shipped = _run(tmp_path, "--max-restarts=1", ok_after=5)
  assert rc == 3 and count == "xx"
  assert "1 restarts spent, giving up" in shipped


def test_sigkill_is_a_failure_and_sigterm_to_the_wrapper_is_a_stop(tmp_path):
  pid_file, log = tmp_path / "child.pid", tmp_path / "role.log"
  argv = [sys.executable, "-m", "launch.supervise", "--max-restarts=2", "--backoff-s=0",
          f"--log={log}", f"--child-pid-file={pid_file}", "--",
          sys.executable, "-c", "import time; time.sleep(60)"]  # fmt: skip
  sup = subprocess.Popen(argv, cwd=REPO)
  try:

    def child_pid(not_: int | None = None) -> int:
      deadline = time.monotonic() + 30
      while time.monotonic() < deadline:
        if pid_file.exists() and (t := pid_file.read_text().strip()) and int(t) != not_:
          return int(t)
        time.sleep(0.05)
      raise AssertionError(f"no child pid other than {not_} in {pid_file}")

    first = child_pid()
    os.kill(first, signal.SIGKILL)
    second = child_pid(not_=first)  # restarted
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(30) == 0
    text = log.read_text()
    assert "exited -9; restart 1/2" in text and "restart 2/2" not in text
    try:
      os.kill(second, 0)
      raise AssertionError("the child outlived its supervisor's stop")
    except ProcessLookupError:
      pass
  finally:
    if sup.poll() is None:
      sup.kill()


def test_the_command_line_the_backends_write_round_trips():
  cfg = supervise.SuperviseConfig(max_restarts=5, log="/l/x.log", ship_to="/m/logs")
  argv = supervise.command(cfg, "py")
  assert argv == ["py", "-m", "launch.supervise", "--max-restarts=5", "--log=/l/x.log",
                  "--ship-to=/m/logs"]  # fmt: skip
  assert supervise.main(["--max-restarts=1"]) == 2  # no `--`: usage, nothing run


def test_tpu_vm_roles_start_under_the_supervisor_with_their_logs_shipped():
  """Every process `start` launches on a TPU VM or retrieval host is the supervisor's (the pid
  file's), its log shipped to the run dir's logs/HOST/ on the bucket mount; the shell parses."""
  from launch import gcloud
  from launch.spec import load

  spec = load(REPO / "launch/specs/v5p_local_7b_tier.toml")
  scripts = [c.argv[-1].removeprefix("--command=") for c in gcloud.start(spec)
             if c.argv[-1].startswith("--command=")]  # fmt: skip
  assert scripts
  ship = f'--ship-to="{gcloud.shared(spec)}/logs/$(hostname)"'
  for script in scripts:
    n = script.count("-m launch.supervise --log=$HOME/asearcher_run/logs/")
    assert n >= 1 and n == script.count("& echo $! > ~/asearcher_run/pids/"), script
    assert ship in script and "nohup ~/asearcher_venv/bin/python -m launch.supervise" in script
    assert subprocess.run(["bash", "-n", "-c", script], timeout=30).returncode == 0, script
