"""Checkpoint writes that fail with ENOSPC and newest checkpoints that are unreadable.

The trainer runs with a learner-shaped stub (fast, no engine) but the real replay queue,
staleness manager and Orbax checkpointer. Shown: a full disk stops training with one clear
error naming the directory and the step it will resume from, and the rerun trains every group
exactly once; a corrupt newest checkpoint is skipped for the one before it, loudly (an ERROR
log line and the `checkpoint/restore_fallbacks` metric), and no group is trained twice.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from asearcher_jax.checkpoint import CheckpointConfig, Checkpointer
from asearcher_jax.errors import CheckpointError
from asearcher_jax.rl.audit import pending_on_disk, replay_logs
from harness.faults import no_space_on_save
from tests.rl.test_trainer_e2e import run_stub_trainer, stub_group, stub_trainer


def test_enospc_on_save_stops_with_one_clear_error_then_resumes(tmp_path):
  trainer, learner, replay, _, ckpt = stub_trainer(tmp_path, steps=4)
  try:
    for i in range(5):
      replay.push(stub_group(i), timeout=1)
    trainer.restore()
    trainer.step()
    trainer.step()
    with no_space_on_save(ckpt) as failed, pytest.raises(CheckpointError) as err:
      trainer.step()  # g2 trained, its checkpoint cannot be written
    assert failed == [3]
    msg = str(err.value)
    assert "no space left on device" in msg and str(tmp_path / "ckpt") in msg
    assert "resumes from step 2" in msg and "\n" not in msg
  finally:
    ckpt.close()
    replay.close()
  assert learner.seen == ["g0", "g1", "g2"]
  assert pending_on_disk(tmp_path / "replay") == ["g2", "g3", "g4"]  # g2 was never committed

  trainer, learner, replay, _, ckpt = stub_trainer(tmp_path, steps=4)  # after freeing space
  try:
    assert trainer.restore() == 2
    trainer.run()
  finally:
    ckpt.close()
    replay.close()
  assert learner.seen == ["g2", "g3"]
  assert replay_logs(tmp_path / "replay")[1] == ["g0", "g1", "g2", "g3"]


def corrupt(step_dir: Path, how: str) -> None:
  if how == "meta":
    (step_dir / "meta" / "metadata").write_bytes(b'{"version": 3, "uncomm')
  else:  # the array data: every chunk file cut to nothing
    for f in (step_dir / "train_state").rglob("*"):
      if f.is_file() and f.parent.name == "d":
        f.write_bytes(b"")


@pytest.mark.parametrize("how", ["meta", "arrays"])
def test_corrupt_latest_checkpoint_falls_back_loudly(tmp_path, caplog, how):
  run_stub_trainer(tmp_path, steps=3, groups=5)
  assert replay_logs(tmp_path / "replay")[1] == ["g0", "g1", "g2"]
  corrupt(tmp_path / "ckpt" / "3", how)

  trainer, learner, replay, _, ckpt = stub_trainer(tmp_path, steps=4)
  with caplog.at_level(logging.ERROR, logger="asearcher_jax.checkpoint"):
    try:
      assert trainer.restore() == 2  # step 3 skipped
      assert float(learner.state["w"][0]) == 2.0
      trainer.run()  # to version 4: two steps
    finally:
      ckpt.close()
      replay.close()
  assert [r.levelno for r in caplog.records if "unreadable" in r.message] == [logging.ERROR]
  assert "falling back to step 2" in caplog.text
  assert [m["checkpoint/restore_fallbacks"] for m in trainer.history] == [1.0, 1.0]
  assert (tmp_path / "ckpt" / "3.unreadable").is_dir()  # kept for inspection
  # g2's update is lost with checkpoint 3, but g2 itself was committed: it is not trained again.
  assert learner.seen == ["g3", "g4"]
  _, committed, _ = replay_logs(tmp_path / "replay")
  assert committed == ["g0", "g1", "g2", "g3", "g4"]


def test_no_readable_checkpoint_is_one_error(tmp_path):
  with Checkpointer(CheckpointConfig(directory=str(tmp_path / "c"), async_save=False)) as ckpt:
    ckpt.save(1, {"meta": {"version": 1}}, force=True)
    corrupt(tmp_path / "c" / "1", "meta")
    with pytest.raises(CheckpointError, match="no readable checkpoint"):
      ckpt.restore_latest({"meta": None})
