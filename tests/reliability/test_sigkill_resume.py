"""`asearcher train` SIGKILLed at >= 10 random points in one run directory, then run to the end.

Whether a checkpoint holds finished calls is timing (generation outpaces training on a CPU), so
the crash loop adds journal kills until two lives have replayed some (CI of 609ed62 had 1 in 10).

Shown, from the run directory alone: episodes in flight at a kill continue from their journals
in the next life (each resumed episode replays every generate call its checkpoint recorded, so
none is generated again; counted), no group is lost or trained twice, and no trained token is
older than eta versions across all the restarts.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from asearcher_jax.rl.audit import audit_run
from harness.crash_loop import (
  CrashLoopConfig,
  cpu_env,
  resume_evidence,
  run_lives,
  train_command,
  write_gin,
)
from tests.reliability.conftest import BYTE_VOCAB

REPO = Path(__file__).resolve().parents[2]
KILLS = int(os.environ.get("ASEARCHER_TEST_KILLS", "10"))
ETA = 3


@pytest.mark.slow
@pytest.mark.timeout(3600)  # ~2 min per life on 2 busy cores
def test_ten_sigkills_resume_from_journals(tmp_path, byte_tok_dir, shipped_index_dir):
  run_dir = tmp_path / "run"
  gin = write_gin(
    tmp_path / "train.gin", vocab=BYTE_VOCAB, run_dir=run_dir, tok_dir=byte_tok_dir,
    index_dir=shipped_index_dir, steps=10_000, eta=ETA,
  )  # fmt: skip
  lives = run_lives(
    train_command(gin),
    run_dir,
    # Journal kills go on past KILLS until two lives have replayed calls (at most 8 more).
    CrashLoopConfig(kills=KILLS, seed=7, min_replay_lives=2),
    env=cpu_env(tmp_path / "jax-cache"),
    cwd=REPO,
  )
  assert sum(life.killed for life in lives) >= KILLS
  for before, life in itertools.pairwise(lives):  # each life resumed where the last one left off
    assert life.restored is None or life.restored >= (before.restored or 0)
  ev = resume_evidence(run_dir, lives)
  print({k: v for k, v in ev.items() if k != "mismatches"})
  print("lives (kind, calls in the checkpoint it resumed from):",
        [(life.kind, sum(life.saved_calls.values())) for life in lives])  # fmt: skip
  # Every resumed episode matched its checkpoint and replayed all of its recorded calls.
  assert ev["mismatches"] == []
  assert ev["replayed_calls"] == ev["saved_calls"] > 0
  assert ev["lives_with_replays"] >= 2
  audit = audit_run(run_dir)
  print(audit.as_dict())
  final = lives[-1].restored or 0
  assert audit.lost == 0 and audit.duplicated == 0 and audit.versions_backwards == 0
  assert audit.committed == final + CrashLoopConfig().final_steps  # B = 1: one group a version
  assert audit.max_staleness <= ETA
