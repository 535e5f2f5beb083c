"""The checkpoint policy's cost in `asearcher plan`: GB a checkpoint and a weight version take
for the recipes' models, seconds at the stated bandwidth, bucket space, and each real recipe's
plan agreeing with the policy it trains with."""

from __future__ import annotations

import gin
import pytest

from asearcher_jax import main as cli
from asearcher_jax.apps import plan as planning
from asearcher_jax.model import presets
from asearcher_jax.rl.plan_checkpoint import CheckpointPlan, checkpoint_cost


@pytest.mark.parametrize(
  ("name", "params_b", "ckpt_gb", "version_gb"),
  [
    ("qwen2.5-7b", 7.6, 91.4, 15.2),
    ("qwen2.5-14b", 14.8, 177.2, 29.5),
    ("qwq-32b", 32.8, 393.2, 65.5),
  ],
)
def test_checkpoint_and_version_sizes_of_the_recipe_models(name, params_b, ckpt_gb, version_gb):
  n = presets.model_config(name=name).num_params()
  assert n / 1e9 == pytest.approx(params_b, abs=0.05)
  c = checkpoint_cost(n, CheckpointPlan(every=10, keep=2), trainer_chips=16, step_s=250.0)
  assert c["checkpoint_gb"] == pytest.approx(ckpt_gb, abs=0.1)  # 12 bytes a parameter
  assert c["weights_version_gb"] == pytest.approx(version_gb, abs=0.1)  # bf16
  # 16 chips = 4 hosts at 1 GB/s each, in parallel.
  assert c["write_gb_s"] == 4.0 and c["checkpoint_write_s"] == pytest.approx(ckpt_gb / 4, abs=0.1)
  assert c["interval_s"] == 2500.0
  assert c["storage_gb"] == pytest.approx(2 * ckpt_gb + 2 * version_gb, abs=0.3)


def test_more_hosts_write_faster_and_bad_policies_name_the_field():
  n = presets.model_config(name="qwen2.5-7b").num_params()
  few = checkpoint_cost(n, CheckpointPlan(), trainer_chips=4, step_s=100.0)
  many = checkpoint_cost(n, CheckpointPlan(), trainer_chips=32, step_s=100.0)
  assert few["checkpoint_write_s"] == pytest.approx(8 * many["checkpoint_write_s"], rel=0.02)
  with pytest.raises(ValueError, match=r"CheckpointPlan\.every must be >= 1"):
    CheckpointPlan(every=0)
  with pytest.raises(ValueError, match=r"CheckpointPlan\.host_write_gb_s must be > 0"):
    CheckpointPlan(host_write_gb_s=0.0)


@pytest.mark.parametrize(
  "name",
  [
    "asearcher_local_qwen2_5_7b",
    pytest.param("asearcher_local_qwen2_5_14b", marks=pytest.mark.slow),  # ~7 s each
    pytest.param("asearcher_web_qwq_32b", marks=pytest.mark.slow),
  ],
)
def test_each_recipes_plan_states_the_checkpoints_it_trains_with(name, capsys):
  """The plan's policy is the trainer's (one macro binds both), and a checkpoint's write takes
  a small part of the interval between two (it is written asynchronously), and the interval
  is at most about an hour unless one step is longer (then every step is checkpointed)."""
  try:
    fn = cli.configure("plan", [f"gin/experiments/{name}.gin"], [])
    train, kept = (
      gin.query_parameter(f"train_config.TrainConfig.{k}").scoped_configurable_fn()
      for k in ("checkpoint_every", "checkpoints_kept")
    )
    assert fn() in (0, 1)
  finally:
    gin.clear_config()
  c = planning.json.loads(capsys.readouterr().out.strip().splitlines()[-1])["checkpoint"]
  assert (c["every_steps"], c["kept"]) == (train, kept) == (c["every_steps"], 2)
  assert c["write_fraction_of_interval"] < 0.05
  # At most ~1 h of training lost to a preemption, or one step where a step takes longer.
  assert c["interval_s"] <= 4000 or c["every_steps"] == 1, c
