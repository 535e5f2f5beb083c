"""Checkpoints on a bucket (a local GCS emulator, tests/gcs_emulator.py): Orbax writes arrays
through tensorstore's GCS driver and its metadata through epath, as on a pod."""

from __future__ import annotations

from etils import epath

from asearcher_jax.checkpoint import CheckpointConfig, Checkpointer, abstract_like
from asearcher_jax.model import steps
from tests.unit.test_checkpoint import _equal, _state


def test_a_checkpoint_saved_to_a_bucket_restores_equal(gcs_bucket):
  _, _, state = _state(3)
  directory = f"{gcs_bucket}/run/checkpoints"
  cfg = CheckpointConfig(directory=directory, max_to_keep=2)
  with Checkpointer(cfg) as ckpt:
    for step in (1, 2, 3):
      ckpt.save(step, {"train_state": state, "meta": {"version": step, "cursor": [step, 1]}})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3]
  assert not (epath.Path(directory) / "1").exists()  # keep-N deleted it from the bucket
  with Checkpointer(cfg) as again:  # a restarted trainer: a new manager over the same bucket
    step, items = again.restore({"train_state": abstract_like(state), "meta": None})
    params = again.restore_part("train_state", "params", abstract_like(state.params), 3)
  assert step == 3 and items["meta"] == {"version": 3, "cursor": [3, 1]}
  assert isinstance(items["train_state"], steps.TrainState)
  assert _equal(items["train_state"], state) and _equal(params, state.params)
