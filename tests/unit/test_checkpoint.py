"""Orbax wrapper: named items, keep-N, async save, restore onto another sharding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from asearcher_jax.checkpoint import CheckpointConfig, Checkpointer, abstract_like
from asearcher_jax.errors import CheckpointError
from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model import steps, transformer
from tests.model.test_model import small_cfg


def _state(seed=0):
  cfg = small_cfg(hidden_size=64, intermediate_size=96)
  graphdef, params = nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(seed)))
  opt = steps.make_optimizer(steps.OptimizerConfig(learning_rate=1e-3))
  return graphdef, opt, steps.init_train_state(params, opt)


def _equal(a, b):
  return all(
    np.array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def test_save_restore_named_items_and_keep_n(tmp_path):
  _, _, state = _state()
  cfg = CheckpointConfig(directory=str(tmp_path / "ckpt"), max_to_keep=2)
  with Checkpointer(cfg) as ckpt:
    for step in (1, 2, 3):
      assert ckpt.save(step, {"train_state": state, "meta": {"version": step, "cursor": [step, 7]}})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3]  # keep-N dropped step 1
    step, items = ckpt.restore({"train_state": abstract_like(state), "meta": None})
  assert step == 3
  assert items["meta"] == {"version": 3, "cursor": [3, 7]}
  assert _equal(items["train_state"], state)
  assert isinstance(items["train_state"], steps.TrainState)


def test_restore_onto_a_different_sharding(tmp_path):
  if jax.device_count() < 8:
    pytest.skip("needs 8 fake devices")
  _, _, state = _state(1)
  with Checkpointer(CheckpointConfig(directory=str(tmp_path))) as ckpt:
    ckpt.save(5, {"params": state.params})
  mesh = sharding_lib.make_mesh(fsdp=4, tensor=2)
  target = abstract_like(state.params, sharding_lib.param_shardings(state.params, mesh))
  with Checkpointer(CheckpointConfig(directory=str(tmp_path))) as ckpt:
    step, items = ckpt.restore({"params": target})
  params = items["params"]
  kernel = params["layers"][0]["mlp"]["up_proj"]["kernel"].get_value()
  assert isinstance(kernel.sharding, NamedSharding)
  assert kernel.sharding.spec == PartitionSpec("fsdp", "tensor")
  assert step == 5 and _equal(params, state.params)


@pytest.mark.slow  # ~11 s
def test_training_resumes_identically_after_restore(tmp_path):
  graphdef, opt, state = _state(2)
  batch = {
    "tokens": jnp.asarray(np.arange(32).reshape(2, 16) % 101, jnp.int32),
    "positions": jnp.asarray(np.tile(np.arange(16), (2, 1)), jnp.int32),
    "segment_ids": jnp.ones((2, 16), jnp.int32),
    "loss_mask": jnp.ones((2, 16), jnp.float32),
  }
  step_fn = steps.compile_train_step(graphdef, opt, steps.nll_loss, state)
  state, _ = step_fn(state, batch)
  with Checkpointer(CheckpointConfig(directory=str(tmp_path), async_save=False)) as ckpt:
    ckpt.save(1, {"train_state": state})
    _, items = ckpt.restore({"train_state": abstract_like(state)})
  resumed = items["train_state"]
  a, _ = step_fn(state, batch)
  b, _ = step_fn(resumed, batch)
  assert _equal(a, b)  # same optimizer moments and step count


def test_missing_checkpoint_errors(tmp_path):
  with Checkpointer(CheckpointConfig(directory=str(tmp_path))) as ckpt:
    with pytest.raises(CheckpointError, match="no checkpoint in"):
      ckpt.restore({"meta": None})
    ckpt.save(1, {"meta": {"v": 1}})
    ckpt.wait()
    with pytest.raises(CheckpointError, match="no checkpoint for step 9"):
      ckpt.restore({"meta": None}, step=9)
  with pytest.raises(ValueError, match="max_to_keep"):
    CheckpointConfig(directory=str(tmp_path), max_to_keep=0)
