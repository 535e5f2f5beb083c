"""`python -m launch.supervise [options] -- CMD ...`: one role's process, restarted when it dies.

A TPU VM has no scheduler to bring a dead process back (a preempted or crashed trainer, an
out-of-memory serve-model), and its disk goes at `down`. This wrapper runs CMD with its output
appended to `--log` on the VM's own disk, copies that log to `--ship-to` (the run dir on the
bucket mount) every `--ship-every-s` and when CMD ends, and restarts CMD when it exits non-zero
or is killed by a signal, after a backoff that doubles up to `--max-backoff-s`, at most
`--max-restarts` times; then it exits with CMD's status. CMD exiting 0 ends it with 0. SIGTERM or
SIGINT to the wrapper is passed to CMD and ends the wrapper when CMD has exited (no restart), so
`launch stop` signalling the pid file's process stops the role. The trainer resumes from its last
checkpoint on restart (Orbax's latest step, the replay journal's in-flight episodes): nothing
here knows which role it runs. Standard library only: it starts before the role's imports.

The local backend wraps a role the same way when its spec asks for restarts (launch/local.py),
which is how the tests kill a trainer and see it come back.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path


@dataclasses.dataclass(frozen=True, kw_only=True)
class SuperviseConfig:
  """How one role's process is restarted and where its log goes."""

  # Restarts after a failed exit before giving up (the budget covers the whole run).
  max_restarts: int = 3
  # Seconds before the first restart; doubled after each, capped at max_backoff_s.
  backoff_s: float = 10.0
  max_backoff_s: float = 300.0
  # CMD's stdout and stderr, appended (a VM's own disk; None: the wrapper's own output).
  log: str | None = None
  # A directory the log is copied into (the run dir on the bucket mount; None: not shipped).
  ship_to: str | None = None
  # Seconds between copies of the log while CMD runs.
  ship_every_s: float = 60.0
  # A file holding CMD's current pid (rewritten at each restart), for tools and tests.
  child_pid_file: str | None = None


def _say(log, message: str) -> None:
  line = f"supervise: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {message}\n"
  log.write(line)
  log.flush()


def _ship(cfg: SuperviseConfig) -> None:
  """The whole log copied over the shipped one (a bucket object is replaced, never appended)."""
  if cfg.log is None or cfg.ship_to is None or not Path(cfg.log).exists():
    return
  try:
    Path(cfg.ship_to).mkdir(parents=True, exist_ok=True)
    tmp = Path(cfg.ship_to) / f".{Path(cfg.log).name}.tmp"
    shutil.copyfile(cfg.log, tmp)
    os.replace(tmp, Path(cfg.ship_to) / Path(cfg.log).name)
  except OSError as e:  # a bucket mount hiccup must not take the role down
    print(f"supervise: shipping {cfg.log} to {cfg.ship_to} failed: {e}", file=sys.stderr)


def supervise(argv: Sequence[str], cfg: SuperviseConfig) -> int:
  """Runs `argv` under `cfg`'s restart policy; returns the exit status the wrapper ends with."""
  if not argv:
    raise ValueError("supervise: no command to run (give it after --)")
  stopping = False
  child: subprocess.Popen | None = None

  def on_signal(signum, _frame):
    nonlocal stopping
    stopping = True
    if child is not None and child.poll() is None:
      child.send_signal(signum)

  signal.signal(signal.SIGTERM, on_signal)
  signal.signal(signal.SIGINT, on_signal)
  if cfg.log is not None:
    Path(cfg.log).parent.mkdir(parents=True, exist_ok=True)
  log = open(cfg.log, "a") if cfg.log is not None else sys.stdout  # noqa: SIM115
  restarts, backoff = 0, cfg.backoff_s
  try:
    while True:
      _say(log, f"starting (restart {restarts}/{cfg.max_restarts}): {' '.join(argv)}")
      child = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT)
      if cfg.child_pid_file is not None:
        Path(cfg.child_pid_file).write_text(f"{child.pid}\n")
      next_ship = time.monotonic() + cfg.ship_every_s
      while (code := child.poll()) is None:
        time.sleep(0.2)
        if time.monotonic() >= next_ship:
          _ship(cfg)
          next_ship = time.monotonic() + cfg.ship_every_s
      if code == 0 or stopping:
        _say(log, f"exited {code}{' after a stop' if stopping and code else ''}; done")
        return code if not stopping else 0
      if restarts >= cfg.max_restarts:
        _say(log, f"exited {code}; {cfg.max_restarts} restarts spent, giving up")
        return code if code > 0 else 128 - code
      restarts += 1
      _say(log, f"exited {code}; restart {restarts}/{cfg.max_restarts} in {backoff:g} s")
      _ship(cfg)
      deadline = time.monotonic() + backoff
      while time.monotonic() < deadline and not stopping:
        time.sleep(0.1)
      if stopping:
        _say(log, "stopped while waiting to restart; done")
        return 0
      backoff = min(backoff * 2, cfg.max_backoff_s)
  finally:
    if log is not sys.stdout:
      log.close()
    _ship(cfg)


def command(cfg: SuperviseConfig, python: str = "python") -> list[str]:
  """The wrapper's own argv (before `--` and the role's argv), as the backends write it."""
  defaults = SuperviseConfig()
  out = [python, "-m", "launch.supervise"]
  for f in dataclasses.fields(cfg):
    v = getattr(cfg, f.name)
    if v is not None and v != getattr(defaults, f.name):
      out.append(f"--{f.name.replace('_', '-')}={v:g}" if isinstance(v, float) else
                 f"--{f.name.replace('_', '-')}={v}")  # fmt: skip
  return out


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if "--" not in argv:
    print("usage: python -m launch.supervise [options] -- CMD ...", file=sys.stderr)
    return 2
  cut = argv.index("--")
  p = argparse.ArgumentParser(prog="python -m launch.supervise", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
  d = SuperviseConfig()
  p.add_argument("--max-restarts", type=int, default=d.max_restarts)
  p.add_argument("--backoff-s", type=float, default=d.backoff_s)
  p.add_argument("--max-backoff-s", type=float, default=d.max_backoff_s)
  p.add_argument("--log")
  p.add_argument("--ship-to")
  p.add_argument("--ship-every-s", type=float, default=d.ship_every_s)
  p.add_argument("--child-pid-file")
  a = p.parse_args(argv[:cut])
  if a.max_restarts < 0 or a.backoff_s < 0 or a.ship_every_s <= 0:
    p.error("--max-restarts and --backoff-s must be >= 0, --ship-every-s > 0")
  if not argv[cut + 1 :]:
    p.error("no command after --")
  cfg = SuperviseConfig(**{k: v for k, v in vars(a).items()})
  return supervise(argv[cut + 1 :], cfg)


if __name__ == "__main__":
  sys.exit(main())
