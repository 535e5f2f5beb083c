"""Does every role of every shipped real-model launch spec fit its slice, as launched?

For each launch spec of a real-model recipe (launch/specs/*.toml but the local_* ones), `python -m
launch rehearse` builds every role from the very command line the launcher gives it (the same gin
files and parameters; the model config read from config.json as `train` and `serve-model` read
it, from the copy the package ships) and compiles ahead of time, for the role's own slice, the
programs the role compiles before its first step or first request (apps/rehearsal.py): the
serving replica's whole engine warm-up (`AotEngine`: prefill buckets, suffix extends, decode,
on the replica's tensor-parallel mesh), the trainer's optimizer step and proximal pass; the
retrieval server is a CPU role. Per role: topology, mesh, programs compiled and programs the
warm-up dispatches (equal unless a compile failed), HBM per chip of the largest, fits, compile
seconds summed (the cold start a fresh VM pays; libtpu 0.0.42.1 on this host's CPUs). Per spec:
all_fit.

Programs: POD_REHEARSAL_PROGRAMS = "largest" (default: the largest program of each engine step
and the trainer's two programs, what decides the fit: ~10 minutes a spec here) or "all" (every
warm-up program: the cold start, hours on 2 cores for a 7B replica) or "arguments" (no compile:
weights, caches and train state per chip, seconds). Each role runs in its own process; a role
whose compiles need more memory than this host has (a 14B or 32B replica's 32k-token programs:
more than 24 GB) is reported with `compile_error` and its compile-free figures;
POD_REHEARSAL_PROGRAMS_SERVING (or _TRAINER, _RETRIEVAL) sets one role's mode. POD_REHEARSAL_SPECS: comma-separated spec
names to limit the run. The last line is one JSON object.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # launch/ (not installed: the repository's own)
# gke_* specs run their TPU-VM twin's roles (same slices and argv but the retrieval addresses).
SPECS = sorted(p for p in (REPO / "launch" / "specs").glob("*.toml")
               if not p.stem.startswith(("local_", "gke_")))  # fmt: skip
TIMEOUT_S = float(os.environ.get("POD_REHEARSAL_TIMEOUT_S", 7200))
KEEP = (
  "topology", "mesh", "chips", "programs_warmed", "programs_compiled", "hbm_gib_per_chip_max",
  "hbm_gib_per_chip", "largest_program", "fits", "compile_s_total", "kv_heads_per_chip",
  "mesh_is_slice", "remat_policy", "error", "compile_error", "programs",
  "arguments_gib_per_chip", "program_reports",
)  # fmt: skip


def rehearse_role(job: dict) -> dict:
  """One role rehearsed in its own process (`asearcher rehearse --each`), its report, or the
  reason it has none."""
  cmd = [sys.executable, "-m", "asearcher_jax.main", "rehearse", "--each"]
  try:
    r = subprocess.run(cmd, cwd=REPO, input=json.dumps(job) + "\n", capture_output=True,
                       text=True, timeout=TIMEOUT_S)  # fmt: skip
  except subprocess.TimeoutExpired:
    return {"error": f"did not finish in {TIMEOUT_S:.0f} s", "fits": None}
  lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
  if lines:
    return json.loads(lines[-1])
  if r.returncode < 0:
    return {"error": f"killed by signal {-r.returncode} (this host's memory)", "fits": None}
  return {"error": (r.stderr.strip().splitlines() or ["no report"])[-1], "fits": None}


def rehearse(spec_path: Path, programs: str) -> dict:
  """Every role of a spec as `python -m launch rehearse` rehearses it, one process a role; a
  role whose compiles do not fit this host's memory (a 14B or 32B model's 32k-token programs
  need more than 24 GB to compile) is rehearsed again without compiling (`arguments`), and says
  so."""
  from launch import gcloud, roles
  from launch import spec as spec_lib

  t0 = time.perf_counter()
  spec = spec_lib.load(str(spec_path))
  layout = gcloud.layout(spec)
  topologies = gcloud.topologies(spec)
  out: dict = {}
  for role, argv in roles.role_argvs(layout).items():
    mode = os.environ.get(f"POD_REHEARSAL_PROGRAMS_{role.upper()}", programs)
    job = {"topology": topologies[role], "programs": mode, "argv": argv}
    report = rehearse_role(job)
    if report.get("fits") is None and mode != "arguments":  # killed: the compile-free figure
      fallback = rehearse_role({**job, "programs": "arguments"})
      report = {**fallback, "compile_error": report["error"]}
    out[role] = {k: v for k, v in report.items() if k in KEEP}
  return {
    "experiment": spec.experiment,
    "roles": out,
    "all_fit": roles.refusal(out) is None,
    "wall_s": round(time.perf_counter() - t0, 1),
  }


def main() -> None:
  programs = os.environ.get("POD_REHEARSAL_PROGRAMS", "largest")
  only = {s for s in os.environ.get("POD_REHEARSAL_SPECS", "").split(",") if s}
  out: dict = {
    "date": datetime.date.today().isoformat(),
    "programs": programs,
    "cores": os.cpu_count(),
    "specs": {},
  }
  for spec in SPECS:
    if only and spec.stem not in only:
      continue
    result = rehearse(spec, programs)
    out["specs"][spec.stem] = result
    print(f"{spec.stem}: all_fit={result.get('all_fit')} ({result.get('wall_s')} s)", flush=True)
    for role, r in result.get("roles", {}).items():
      print(f"  {role:9} {r.get('topology'):7} mesh={r.get('mesh')} programs "
            f"{r.get('programs_compiled')}/{r.get('programs_warmed')} max "
            f"{r.get('hbm_gib_per_chip_max')} GiB/chip fits={r.get('fits')} compile "
            f"{r.get('compile_s_total')} s", flush=True)  # fmt: skip
  print(json.dumps(out))


if __name__ == "__main__":
  main()
