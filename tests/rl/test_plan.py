"""The planner's arithmetic (rl/plan_memory.py) and its discrete-event model (rl/plan_sim.py).

The memory formula's agreement with XLA is benchmarks/plan_check.py's job; here: the parts add
up and scale as they must, and the event model reproduces the two bounds it exists for -- the
synchronous barrier and Little's law on the staleness rule's capacity."""

from __future__ import annotations

import dataclasses

import pytest

from asearcher_jax.model import presets
from asearcher_jax.rl import plan_memory as mem
from asearcher_jax.rl import plan_sim


def test_trainer_memory_parts_shard_and_scale():
  m = presets.model_config(
    name="qwen2.5-7b", remat_policy="full", dtype="bfloat16", param_dtype="bfloat16"
  )
  one = mem.trainer_memory(m, mem.TrainerShape(chips=1, row_len=4096, live_blocks=1))
  many = mem.trainer_memory(m, mem.TrainerShape(chips=16, row_len=4096, live_blocks=1))
  p = m.num_params()
  assert one["params"] == p * 4 and one["optimizer"] == 2 * p * 4 and one["grads"] == p * 4
  assert one["compute_copy"] == p * 2  # bf16 matmuls over fp32 masters
  for k in ("params", "optimizer", "grads", "compute_copy"):  # FSDP shards the state...
    assert many[k] == pytest.approx(one[k] / 16)
  # ... not one chip's micro-batch.
  assert many["activations"] == one["activations"] and many["logits"] == one["logits"]
  assert one["total"] == pytest.approx(sum(v for k, v in one.items() if k != "total"))
  # remat keeps one block live instead of all 28; dense attention scores grow ~quadratically,
  # flash / splash (the default "auto") linearly, and the logits are one chunk's either way.
  all_blocks = mem.trainer_memory(m, mem.TrainerShape(row_len=4096, live_blocks=None))
  assert all_blocks["activations"] > 10 * one["activations"]
  longer = mem.trainer_memory(m, mem.TrainerShape(row_len=8192, live_blocks=1))
  assert longer["activations"] == pytest.approx(2 * one["activations"], rel=0.01)
  assert longer["logits"] == one["logits"]
  dense = m.replace(attention="dense")
  d1 = mem.trainer_memory(dense, mem.TrainerShape(row_len=4096, live_blocks=1))
  d2 = mem.trainer_memory(dense, mem.TrainerShape(row_len=8192, live_blocks=1))
  assert d2["activations"] > 2.5 * d1["activations"] and d1["activations"] > one["activations"]


def test_serving_memory_and_fits():
  m = presets.model_config(name="qwen2.5-7b", dtype="bfloat16", param_dtype="bfloat16")
  s = mem.serving_memory(m, mem.ServingShape(chips=4, slots=64, context=32768))
  # 28 layers x 2 x 4 kv heads x 128 x bf16 = 57,344 bytes per token; 64 x 32k tokens / 4 chips
  assert s["kv_cache"] == 64 * 32768 * 57344 / 4
  assert s["params"] == m.num_params() * 2 / 4
  fits = mem.fits(s["total"])
  # 33.9 GB per chip
  assert fits == {"v4": False, "v5e": False, "v5p": True, "v6e": False, "h100": True, "h200": True}
  assert {c.name: c.hbm_gb for c in mem.CHIPS.values()} == {
    "v4": 32.0,
    "v5e": 16.0,
    "v5p": 95.0,
    "v6e": 32.0,
    "h100": 80.0,
    "h200": 141.0,
  }


def test_causal_score_entries():
  assert mem.causal_score_entries(512, 128) == 128 * 128 * (1 + 2 + 3 + 4)
  assert mem.causal_score_entries(100, 128) == 100 * 100  # one block: the full matrix


def test_sync_mode_waits_for_the_slowest_episode_every_step():
  w = plan_sim.Workload(train_step_s=1.0, decode_token_s=0.0)
  s = plan_sim.Schedule(batch_groups=4, group_size=4, eta=0, max_concurrent=4)
  r = plan_sim.simulate(w, s, steps=20, seed=3)
  # Generation and training alternate: idle = barrier / (barrier + train).
  per_step = r["wall_s"] / 20
  assert r["trainer_idle_frac"] == pytest.approx((per_step - 1.0) / per_step, rel=1e-6)
  assert per_step > 1.0 + r["group_s_mean"]  # the max over B groups exceeds the mean group


def test_async_throughput_obeys_littles_law():
  """At most (eta + 1) x B groups are in flight (queued and training ones included), each
  generating for the mean group latency L, so steps per second <= min(1 / T, (eta + 1) / L):
  a slow trainer (capacity ratio (eta + 1) T / L > 1) is never idle, a fast one starves."""
  s = plan_sim.Schedule(batch_groups=8, group_size=4, eta=2)
  rates = {}
  for t in (0.5, 8.0):
    r = plan_sim.simulate(plan_sim.Workload(train_step_s=t, decode_token_s=0.0), s, steps=300)
    rate = 300 / r["wall_s"]
    assert rate <= min(1 / t, (s.eta + 1) / r["group_s_mean"]) * 1.02
    rates[t] = (rate, r)
  slow_rate, slow = rates[8.0]
  # (the variance of group latency costs a few percent even at a capacity ratio of 2.3)
  assert slow["capacity_ratio"] > 1.5 and slow_rate == pytest.approx(1 / 8.0, rel=0.08)
  assert slow["trainer_idle_frac"] < 0.08
  fast_rate, fast = rates[0.5]
  assert fast["capacity_ratio"] < 0.2 and fast["trainer_idle_frac"] > 0.7
  assert fast_rate < 0.5 * (1 / 0.5)


def test_async_beats_sync_when_tools_dominate_and_not_when_training_does():
  s = plan_sim.Schedule()
  slow_tools = plan_sim.async_vs_sync(plan_sim.Workload(train_step_s=2.5), s, seeds=5)
  assert slow_tools["speedup"] > 3
  w = plan_sim.Workload(train_step_s=200.0, tool_s=dataclasses.replace(
    plan_sim.Workload().tool_s, median=0.01, low=0.001, high=0.1))  # fmt: skip
  assert plan_sim.async_vs_sync(w, s, seeds=5)["speedup"] < 1.1
