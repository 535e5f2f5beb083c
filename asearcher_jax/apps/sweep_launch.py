"""One sweep point run through `launch/` (`sweeping.sweep.launch`, `sweeping.Launch`): the point's bindings go to
every role of a launched run with its own run directory, the sweep waits for the trainer's end,
stops the run and reads the trainer's summary back, so a point on a pod lands in the same table
as a local one.

Before the first point starts, one `python -m launch check` process checks every point (`check`
below). Then per point, each a `python -m launch ACTION --backend B --spec S --run_dir D` process
(the library never imports the top-level `launch` package; .importlinter forbids it):
  start   with the point's bindings as --gin_param
  wait    local: until the supervisor writes supervisor.done (the run's exit code) under D;
          gcloud: `status` every POLL_S["gcloud"] seconds until no trainer process is alive
          (gcloud cannot report the trainer's exit code: a point without a summary failed;
          STATUS_FAILURES failed `status` calls in a row, e.g. a preempted slice, fail it)
  stop    always, also after a failed start or a timeout (nothing is left running)
  logs    `--lines 5`: the trainer's last JSON line is its summary
  fetch   gcloud: the run's metrics (TensorBoard files too), episodes and operative config from
          the bucket into the point's dir
Every launch call and the wait have timeouts. The run directory D is the point's own directory
with the local backend (the trainer's metrics land in D/train/metrics), and
sweeps/<sweep root's name>/<point> under the spec's bucket with gcloud.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from asearcher_jax.errors import ConfigValueError

# The repository root: `python -m launch` runs from here (the launcher sits next to the package).
REPO = Path(__file__).resolve().parents[2]
# Longest single launch action (gcloud `start` is a few ssh commands; `up` is not a sweep's job).
CALL_TIMEOUT_S = 900.0
# How often the wait looks at the run.
POLL_S = {"local": 1.0, "gcloud": 60.0}
# Consecutive failed `status` calls (gcloud) after which a point is given up (its slices gone).
STATUS_FAILURES = 3
# Lines of each log `logs` returns: the trainer's summary is its last JSON line.
LOG_LINES = 5
_TRAINER_ALIVE = re.compile(r"\btrainer(-\d+)? \d+ alive\b")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchPoint:
  """What `launch` needs to run one sweep point."""

  # The launch TOML spec (absolute, so the launcher's working directory does not matter).
  spec: str
  # "local" (processes on this machine) or "gcloud" (the spec's TPU slices, already `up`).
  backend: str
  # The point's run directory as the launcher takes it (--run_dir).
  run_dir: str
  # The sweep's and the point's bindings, passed to every role.
  gin_params: tuple[str, ...]
  # The point's directory on this machine (gcloud: `fetch` copies the run's metrics into it).
  local_dir: str


def launch_point(spec: str, backend: str, root: Path, name: str, params: list[str]) -> LaunchPoint:
  if backend not in POLL_S:
    raise ConfigValueError(f"sweeping.Launch.backend: {backend!r} is not one of {list(POLL_S)}")
  if not Path(spec).is_file():
    raise ConfigValueError(f"sweeping.Launch.spec: no such file {spec!r}")
  run_dir = str((root / name).resolve()) if backend == "local" else f"sweeps/{root.name}/{name}"
  return LaunchPoint(spec=str(Path(spec).resolve()), backend=backend, run_dir=run_dir,
                     gin_params=tuple(params), local_dir=str(root / name))  # fmt: skip


def argv(p: LaunchPoint, action: str) -> list[str]:
  """`python -m launch ACTION ...` for point `p`."""
  out = [sys.executable, "-m", "launch", action, "--backend", p.backend, "--spec", p.spec,
         "--run_dir", p.run_dir]  # fmt: skip
  if action == "start":
    out += [f"--gin_param={b}" for b in p.gin_params]
  if action == "logs":
    out += ["--lines", str(LOG_LINES)]
  if action == "fetch":
    out += ["--to", p.local_dir]
  return out


def check(points: list[LaunchPoint], names: list[str]) -> None:
  """What each point's `launch start --dry-run` checks, before the first point starts: the spec,
  and every role's configuration with the point's bindings. One `python -m launch check` process
  for all the points of a spec and backend (it checks every role of every point in one
  `asearcher --check-each`), so a typo in the grid's last point or a spec the launcher rejects
  costs seconds for the whole sweep, not the earlier points' runs. The first mistake is one
  config error naming the point."""
  groups: dict[tuple[str, str], list[int]] = {}
  for i, p in enumerate(points):
    groups.setdefault((p.spec, p.backend), []).append(i)
  answers: dict[int, str | None] = {}
  for (spec, backend), members in groups.items():
    cmd = [sys.executable, "-m", "launch", "check", "--backend", backend, "--spec", spec]
    lines = "".join(
      json.dumps({"run_dir": points[i].run_dir, "gin_params": list(points[i].gin_params)}) + "\n"
      for i in members
    )
    try:
      r = subprocess.run(cmd, input=lines, capture_output=True, text=True, cwd=REPO,
                         timeout=CALL_TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired:
      raise ConfigValueError(
        f"sweep: launch check of {len(members)} points took over {CALL_TIMEOUT_S:.0f} s"
      ) from None
    got = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    if r.returncode or len(got) != len(members):
      last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
      raise ConfigValueError(f"sweep: {shlex.join(cmd[1:])}: {last}")
    answers.update(zip(members, got, strict=True))
  bad = [(names[i], answers[i]) for i in range(len(points)) if answers[i]]
  if bad:
    more = f" (and {len(bad) - 1} more points)" if len(bad) > 1 else ""
    raise ConfigValueError(f"sweep: {bad[0][0]}: {bad[0][1]}{more}")


def plan(p: LaunchPoint, timeout_s: float) -> list[str]:
  """The point's commands as a dry run prints them (the wait as a comment)."""
  if p.backend == "local":
    wait = f"# wait for {p.run_dir}/supervisor.done (at most {timeout_s:g} s)"
  else:
    wait = (f"{shlex.join(argv(p, 'status'))}  # every {POLL_S['gcloud']:g} s until no trainer "
            f"process is alive (at most {timeout_s:g} s)")  # fmt: skip
  out = [shlex.join(argv(p, a)) for a in ("start", "stop", "logs")]
  return [out[0], wait, *out[1:]] + (
    [shlex.join(argv(p, "fetch"))] if p.backend == "gcloud" else []
  )


def _call(p: LaunchPoint, action: str, log) -> tuple[int, str]:
  """Runs one launch action (its stderr into `log`); (exit status, stdout); 124 on a timeout."""
  log.write(f"$ {shlex.join(argv(p, action))}\n")
  log.flush()
  try:
    r = subprocess.run(argv(p, action), stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO,
                       timeout=CALL_TIMEOUT_S)  # fmt: skip
  except subprocess.TimeoutExpired:
    return 124, ""
  log.write(r.stdout)
  return r.returncode, r.stdout


def _wait(p: LaunchPoint, log, deadline: float) -> str | None:
  """Until the run's trainer ended; None, or why the point failed."""
  done, failures = Path(p.run_dir) / "supervisor.done", 0
  while time.monotonic() < deadline:
    if p.backend == "local":
      if done.exists():
        code = done.read_text().strip()
        return None if code == "0" else f"exit {code} (see {Path(p.run_dir) / 'logs'})"
      pid_file = Path(p.run_dir) / "supervisor.pid"
      if not pid_file.exists():
        return "launch start left no supervisor"
      if not pid_alive(int(pid_file.read_text())) and not done.exists():
        return f"the supervisor died without writing {done}"
    else:
      rc, out = _call(p, "status", log)
      if rc == 0 and not _TRAINER_ALIVE.search(out):
        return None
      failures = failures + 1 if rc else 0
      if failures == STATUS_FAILURES:  # a slice preempted or gone, not a passing ssh hiccup
        return f"launch status failed {failures} times in a row (see {p.local_dir}/sweep.log)"
    time.sleep(POLL_S[p.backend])
  return "timed out"


def pid_alive(pid: int) -> bool:
  """Whether process `pid` runs (a zombie counts as gone). Also the launcher's check (launch/local.py)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  try:
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
  except OSError:
    return False


def _summary(logs: str) -> dict | None:
  """The last JSON line in the first trainer log of `launch logs` output (its summary; a few
  shutdown log lines may follow it)."""
  found, trainer = None, False
  for line in logs.splitlines():
    if line.startswith("==> "):
      if found is not None:
        break
      trainer = "trainer" in line
    elif trainer and line.startswith("{"):
      with contextlib.suppress(json.JSONDecodeError):
        found = json.loads(line)
  return found


def run(p: LaunchPoint, point_dir: Path, timeout_s: float) -> tuple[dict | None, str]:
  """start, wait, stop, logs; (summary, status) as `sweep.run_point` returns them."""
  if (point_dir / "summary.json").exists():
    return json.loads((point_dir / "summary.json").read_text()), "done before"
  point_dir.mkdir(parents=True, exist_ok=True)
  (point_dir / "command.json").write_text(json.dumps(plan(p, timeout_s), indent=1) + "\n")
  t0 = time.monotonic()
  with open(point_dir / "sweep.log", "a") as log:
    try:
      rc, _ = _call(p, "start", log)
      why = (f"launch start failed ({rc}; see {point_dir / 'sweep.log'})" if rc else
             _wait(p, log, t0 + timeout_s))  # fmt: skip
      if why == "timed out":
        why = f"timed out after {timeout_s:.0f} s"
    finally:
      stop_rc, _ = _call(p, "stop", log)
    if why is None and stop_rc:
      why = f"launch stop failed ({stop_rc}; see {point_dir / 'sweep.log'})"
    if why is not None:
      return None, why
    rc, out = _call(p, "logs", log)
  summary = _summary(out) if rc == 0 else None
  if summary is None:
    return None, f"no summary (the trainer's log ends without one; see {point_dir / 'sweep.log'})"
  if p.backend == "gcloud":  # metrics for the table and curves; a failed copy only loses them
    _call(p, "fetch", log)
  summary.setdefault("sweep_wall_s", round(time.monotonic() - t0, 1))
  (point_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  return summary, "ran"
