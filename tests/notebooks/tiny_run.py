"""A tiny but real run directory for the notebooks and views: the quickstart pipeline at CI size
(SynthWiki world, the shipped warm start in the real engine, held-out evaluation before and after
one step of asynchronous RL, the report) plus a synthesis run over the toy world with the
scripted model behind a loopback HTTP server.

The quickstart is built as the one point of the shipped sweep `gin/sweeps/quickstart_ci.gin`
(`asearcher sweep` in its own process, one CPU device as from a shell), so that the sweep's test
reads the same build instead of running a second CI-size quickstart.

Layout: <root>/quickstart/{world,eval,rl,report}, <root>/synth/{questions,progress,calls}.jsonl,
and <root>/sweep/ (results.jsonl; its one point, a link to ../quickstart) with the sweep's
output in <root>/sweep_stdout.txt.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from asearcher_jax.testing.synth_scripted import toy_synthesis

REPO = Path(__file__).resolve().parents[2]
T = 60  # seconds: bound on every await of the synthesis run
# The shipped CI-size sweep (4 questions x k 2, 5 s of RL at B 2, prefill buckets 512 and 2,048:
# gin/overlays/quickstart_ci.gin), its grid cut to one point.
SWEEP = "gin/sweeps/quickstart_ci.gin"
GRID = '{"staleness.StalenessConfig.max_staleness": ("4",)}'
POINT = "p00-max_staleness=4"


def make_quickstart(root: Path) -> Path:
  sweep_root = root / "sweep"
  argv = [sys.executable, "-m", "asearcher_jax.main", "sweep", SWEEP,
          f'--gin_param=sweeping.sweep.root="{sweep_root}"', f"--gin_param=sweeping.sweep.grid={GRID}"]  # fmt: skip
  env = {**os.environ, "XLA_FLAGS": ""}  # one CPU device, as from a shell
  r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
  (root / "sweep_stdout.txt").write_text(r.stdout)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  # The run directory proper at <root>/quickstart (what the views walk; a walk does not follow
  # links), the sweep's point a link to it.
  run_dir = root / "quickstart"
  (sweep_root / POINT).rename(run_dir)
  (sweep_root / POINT).symlink_to(Path("..") / "quickstart")
  return run_dir


def make_synthesis(root: Path) -> Path:
  out = root / "synth"
  summary = asyncio.run(toy_synthesis(str(out), seeds=12, timeout_s=T))
  assert summary["written"] >= 1, summary
  return out


def make_tiny_run(root: Path) -> dict[str, float]:
  """Builds both; returns the seconds each took."""
  t0 = time.perf_counter()
  make_synthesis(root)
  t1 = time.perf_counter()
  make_quickstart(root)
  return {"synthesis_s": t1 - t0, "quickstart_s": time.perf_counter() - t1}


if __name__ == "__main__":
  print(json.dumps(make_tiny_run(Path(sys.argv[1]))))
