"""`python -m launch ACTION --spec SPEC.toml [--dry-run]`: one run's whole life.

  up      queued resources for the trainer slice and every serving slice (waits for ACTIVE)
  setup   the same bootstrap on every worker (launch/bootstrap.sh: Python, the pinned
          requirements + jax[tpu], this package at --commit, the bucket mounted); refuses a
          working tree with uncommitted or untracked (not ignored) files, which the commit's
          archive would leave out, unless --allow-dirty (--dry-run ships nothing, so it only
          prints)
  start   retrieval server, serve-model on every serving host, the trainer on every trainer
          worker (jax.distributed environment), servers found through address files
  status  queued-resource states and which launched processes are alive
  logs    the tail of every process's log
  fetch   gcloud: the run's metrics and operative config from the bucket into --to DIR (the
          local backend's run dir is already on this machine)
  rehearse  every role of the spec built from its own command line and compiled ahead of
          time for its slice on this host (`asearcher rehearse`: libtpu's compiler, no TPU):
          one JSON line, per role the programs its warm-up compiles, the largest one's HBM a
          chip, whether all fit and the compile seconds; exit 1 when a role does not fit.
          --programs all (default: the cold start), largest (the fit, in minutes) or arguments
  check   what `start --dry-run` checks, for many runs in one process: JSON lines on stdin
          ({"run_dir": D, "gin_params": [...]}, added to --run_dir and --gin_param as start
          takes them), one answer each on stdout (null, or the line `start` would end with);
          a sweep checks its launched points so
  stop    SIGTERM to every launched process
  down    delete the queued resources (and their nodes)

--run_dir gives the run its own directory (a sweep point runs each of its points this way:
asearcher_jax/apps/sweep_launch.py). Backends: "gcloud" (launch/gcloud.py; --dry-run prints every gcloud/ssh command and runs
nothing), "gke" (launch/gke.py: JobSets on a GKE cluster from the spec's [gke] table;
`start --dry-run` prints the manifests) and "local" (launch/local.py: the same roles as
processes on this machine). A spec
mistake is one line on stderr and exit status 2, before anything starts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from launch import gcloud, roles
from launch.spec import SpecError


def _parse(argv: Sequence[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m launch", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
  p.add_argument("action", choices=(*gcloud.ACTIONS, "fetch", "check", "rehearse"))
  p.add_argument("--spec", required=True, help="cluster spec (TOML; launch/specs/*.toml)")
  p.add_argument("--backend", choices=("gcloud", "local", "gke"), default="gcloud")
  p.add_argument("--experiment", help="gin experiment (overrides the spec's)")
  p.add_argument("--gin_param", action="append", default=[], help="extra binding, every role")
  p.add_argument(
    "--run_dir",
    help="the run's directory (overrides the spec's; gcloud: a path "
    "under the bucket instead of runs/NAME), e.g. a sweep point's own",
  )
  p.add_argument("--to", help="fetch: the local directory the run's metrics are copied into")
  p.add_argument("--commit", help="commit to install on the workers (default: HEAD's hash)")
  p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
  p.add_argument(
    "--allow-dirty", action="store_true",
    help="setup: ship the commit although the working tree has uncommitted or untracked files",
  )  # fmt: skip
  p.add_argument("--lines", type=int, default=50, help="logs: lines per log")
  p.add_argument(
    "--programs", choices=("all", "largest", "arguments"), default="all",
    help="rehearse: what to compile per role (all: the cold start; largest: the fit)",
  )  # fmt: skip
  p.add_argument(
    "--fit", choices=("arguments", "largest", "all", "off"), default="arguments",
    help="start: refuse a spec whose role does not fit its slice, rehearsed this far first "
    "(arguments: weights, caches and train state per chip, seconds; largest: the largest "
    "programs compiled, minutes); off: no check",
  )  # fmt: skip
  a = p.parse_args(argv)
  if a.lines < 1:
    p.error(f"--lines must be >= 1, got {a.lines}")
  return a


def _head() -> str:
  return subprocess.run(["git", "-C", str(gcloud.REPO), "rev-parse", "HEAD"], check=True,
                        capture_output=True, text=True, timeout=30).stdout.strip()  # fmt: skip


def _layout(
  a: argparse.Namespace, run_dir: str | None, gin_params: tuple[str, ...]
) -> roles.Layout:
  """The layout `start` would run with (SpecError for what `start` rejects before starting)."""
  if a.backend == "local":
    from launch import local

    return local.point_layout(local.load(a.spec, a.experiment), run_dir, gin_params)
  from launch import spec as spec_lib

  if a.backend == "gke":
    from launch import gke

    spec, cfg = gke.load_gke(a.spec, a.experiment)
    return gke.layout(spec_lib.with_run_dir(spec, run_dir), cfg, gin_params)
  spec = spec_lib.with_run_dir(spec_lib.load(a.spec, a.experiment), run_dir)
  gcloud.plan(spec, "start", gin_params=gin_params)  # its own checks (hosts, ports)
  return gcloud.layout(spec, gin_params)


def _read_points(lines) -> list[tuple[str | None, tuple[str, ...]]]:
  points = []
  for n, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      d = json.loads(line)
      run_dir, params = d.get("run_dir"), d.get("gin_params", [])
    except (json.JSONDecodeError, AttributeError):
      run_dir, params = 0, None
    if not (run_dir is None or isinstance(run_dir, str)) or not (
      isinstance(params, list) and all(isinstance(x, str) for x in params)
    ):
      raise SpecError(
        f'stdin line {n}: want {{"run_dir": "DIR", "gin_params": ["BINDING", ...]}}, '
        f"got {line.strip()[:200]!r}"
      )
    points.append((run_dir, tuple(params)))
  return points


def check(a: argparse.Namespace, lines) -> list[str | None]:
  """`check`: each point's answer, every role of every point checked in one `asearcher
  --check-each` process (one launcher process and one checker for a whole sweep, instead of
  both per point)."""
  answers: list[str | None] = []
  layouts: dict[int, roles.Layout] = {}
  for i, (run_dir, params) in enumerate(_read_points(lines)):
    answers.append(None)
    try:  # --run_dir and --gin_param as for start: a point's own run dir wins, bindings add up
      layouts[i] = _layout(a, run_dir or a.run_dir, (*a.gin_param, *params))
    except SpecError as e:
      answers[i] = f"launch start: spec error: {e}"
  for i, message in zip(layouts, roles.check_layouts(list(layouts.values())), strict=True):
    if message:
      answers[i] = f"launch start: spec error: {message}"
  return answers


def rehearse(spec, gin_params: tuple[str, ...], programs: str) -> int:
  """`rehearse`: every role's report and whether all fit, one JSON line; 0 when all fit."""
  lay = gcloud.layout(spec, gin_params)
  roles.check_roles(lay)
  reports = roles.rehearse_roles(lay, gcloud.topologies(spec), programs)
  all_fit = roles.refusal(reports) is None
  print(json.dumps({"spec": spec.source, "experiment": spec.experiment, "roles": reports,
                    "all_fit": all_fit}), flush=True)  # fmt: skip
  return 0 if all_fit else 1


def main(argv: Sequence[str] | None = None) -> int:
  a = _parse(sys.argv[1:] if argv is None else argv)
  if a.action == "check":
    try:
      answers = check(a, sys.stdin)
    except SpecError as e:
      print(f"launch check: {e}", file=sys.stderr)
      return 2
    print("".join(json.dumps(m) + "\n" for m in answers), end="", flush=True)
    return 0
  try:
    if a.backend == "local":
      from launch import local

      return local.main(a)
    if a.backend == "gke" and a.action != "fetch" and a.action != "rehearse":
      from launch import gke

      return gke.main(a)
    from launch import spec as spec_lib

    spec = spec_lib.with_run_dir(spec_lib.load(a.spec, a.experiment), a.run_dir)
    if a.action == "rehearse":
      return rehearse(spec, tuple(a.gin_param), a.programs)
    if a.action == "setup" and not (a.allow_dirty or a.dry_run):  # a dry run ships nothing
      dirty = gcloud.dirty_files(gcloud.REPO)
      if dirty:
        shown = ", ".join(dirty[:5]) + (f" and {len(dirty) - 5} more" if len(dirty) > 5 else "")
        print(f"launch setup: {len(dirty)} uncommitted or untracked file(s) in {gcloud.REPO} "
              f"({shown}) would not be shipped (setup ships `git archive` of a commit): commit "
              "them or pass --allow-dirty", file=sys.stderr)  # fmt: skip
        return 2
    commit = a.commit or (_head() if a.action == "setup" else "HEAD")
    if a.action == "logs":
      commands = gcloud.logs(spec, a.lines)
    elif a.action == "fetch":
      if not a.to:
        raise SpecError("fetch needs --to DIR")
      commands = gcloud.fetch(spec, a.to)
      if not a.dry_run:
        Path(a.to, "metrics").mkdir(parents=True, exist_ok=True)
    else:
      if a.action == "start":
        lay = gcloud.layout(spec, tuple(a.gin_param))
        roles.check_roles(lay)
        if a.fit != "off":  # a role too big for its slice: refused before any cloud command
          message = roles.refusal(roles.rehearse_roles(lay, gcloud.topologies(spec), a.fit))
          if message:
            raise SpecError(message)
      commands = gcloud.plan(spec, a.action, commit=commit, gin_params=tuple(a.gin_param))
  except SpecError as e:
    print(f"launch {a.action}: spec error: {e}", file=sys.stderr)
    return 2
  except subprocess.CalledProcessError as e:  # a gke action's command
    print(f"launch {a.action}: {' '.join(e.cmd[:6])} ... failed ({e.returncode})", file=sys.stderr)
    return 1
  try:
    return gcloud.run(commands, dry_run=a.dry_run)
  except subprocess.CalledProcessError as e:
    print(f"launch {a.action}: {' '.join(e.cmd[:6])} ... failed ({e.returncode}): "
          f"{(e.stderr or '').strip()[:500]}", file=sys.stderr)  # fmt: skip
    return 1
