"""A tiny but real run directory for the notebooks and views: the quickstart pipeline at CI size
(SynthWiki world, the shipped warm start in the real engine, held-out evaluation before and after
one step of asynchronous RL, the report) plus a synthesis run over the toy world with the
scripted model behind a loopback HTTP server.

Layout: <root>/quickstart/{world,eval,rl,report} and <root>/synth/{questions,progress,calls}.jsonl.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from asearcher_jax.apps import quickstart as pipeline
from asearcher_jax.serving.engine import EngineConfig
from asearcher_jax.testing.synth_scripted import toy_synthesis

# One prefill bucket: a handful of compiled shapes instead of the quickstart's dozens.
ENGINE = EngineConfig(max_slots=8, max_seq_len=2048, prefill_buckets=(2048,))
T = 60  # seconds: bound on every await of the synthesis run


def make_quickstart(root: Path) -> Path:
  run_dir = root / "quickstart"
  assert pipeline.quickstart(
    run_dir=str(run_dir), evaluation=pipeline.QuickstartEval(questions=4, k=2),
    rl=pipeline.QuickstartRL(seconds=5.0, batch_groups=2, max_concurrent=4, batch_timeout_s=600.0),
    engine=ENGINE,
  ) == 0  # fmt: skip
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
