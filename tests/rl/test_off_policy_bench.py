"""The off-policy benchmark at a tiny scale: its grid runs end to end through the real engine
and learner, the staleness it imposes shows in the trained tokens, and on-policy (eta = 0) every
correction is the same run."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "off_policy.py"


@pytest.mark.slow
def test_off_policy_benchmark_grid_and_its_json(monkeypatch):
  spec = importlib.util.spec_from_file_location("off_policy_bench", BENCH)
  bench = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = bench
  spec.loader.exec_module(bench)
  for name, value in dict(STEPS=3, SEEDS=(0,), ETAS=(0, 2), HELD_OUT=4).items():
    monkeypatch.setattr(bench, name, value)
  result = asyncio.run(bench.main())
  runs = {(r["eta"], r["correction"]): r for r in result["runs"]}
  assert set(runs) == {(e, c) for e in (0, 2) for c in ("decoupled", "tis_token", "icepop")}
  on_policy = [runs[0, c] for c in ("decoupled", "tis_token", "icepop")]
  assert len({r["avg4_heldout"] for r in on_policy}) == 1  # w = 1: the corrections coincide
  assert all(r["staleness_max"] == 0 and r["agreement"]["tokens"] > 0 for r in on_policy)
  assert all(0 < runs[2, c]["staleness_max"] <= 2 for c in ("decoupled", "icepop"))
  assert all(r["agreement"]["abs_max"] <= 1e-4 for r in result["runs"])
  assert [s["eta"] for s in result["summary"]] == [0, 0, 0, 2, 2, 2]
  assert 0 <= result["avg4_init"] <= 1
