"""The planner's serving model (rl/plan_memory.py): live sequences from a page budget, decode steps
bound by weights plus KV reads, prefill with group prompt sharing, and the rates plan_sim gets."""

from __future__ import annotations

import math

import pytest

from asearcher_jax.model import presets
from asearcher_jax.rl import plan_memory as mem
from asearcher_jax.rl import plan_sim

QWEN7B = presets.model_config(name="qwen2.5-7b", dtype="bfloat16", param_dtype="bfloat16")


def test_capped_lognormal_moments_and_the_live_context():
  free = mem.LengthDistribution(median=1000.0, sigma=0.5, cap=1e12)
  assert mem.mean_length(free) == pytest.approx(1000 * math.exp(0.125), rel=1e-9)
  # E[L^2] / (2 E[L]) = median x exp(3 sigma^2 / 2) / 2 for an uncapped log-normal
  assert mem.live_context(free) == pytest.approx(500 * math.exp(1.5 * 0.25), rel=1e-9)
  capped = mem.LengthDistribution(median=1000.0, sigma=0.5, cap=1500.0)
  assert mem.mean_length(capped) < mem.mean_length(free)
  assert mem.live_context(capped) <= 1500 / 2  # min(L, c)^2 <= c min(L, c)
  point = mem.LengthDistribution(median=800.0, sigma=0.0, cap=32768.0)
  assert mem.live_context(point) == pytest.approx(400.0)  # half-way through its life
  assert mem.length_quantile(point, 0.99) == pytest.approx(800.0)
  with pytest.raises(ValueError, match="LengthDistribution"):
    mem.LengthDistribution(median=0.0)


def test_live_sequences_from_the_page_budget():
  d = mem.LengthDistribution(median=800.0, sigma=0.0, cap=32768.0)
  paged = mem.ServingShape(slots=1024, pages=100 * (400 // 16) + 50, page_size=16)
  assert mem.live_sequences(paged, d) == pytest.approx(100.0)  # 25.5 pages each
  assert mem.pages_for(100, d, 16) == paged.pages
  assert mem.live_sequences(mem.ServingShape(slots=32, pages=10**6), d) == 32.0  # slots bound
  assert mem.live_sequences(mem.ServingShape(slots=32), d) == 32.0  # fixed: its slots
  # At equal KV memory (32 slots x 32k), the paged layout holds ~80x more of these sequences.
  same_memory = mem.ServingShape(slots=4096, pages=32 * 32768 // 16, page_size=16)
  assert mem.live_sequences(same_memory, d) > 80 * 32


def test_kv_heads_split_or_duplicated_to_the_chips():
  assert mem.kv_heads_per_chip(QWEN7B, 1) == 4
  assert mem.kv_heads_per_chip(QWEN7B, 2) == 2
  assert mem.kv_heads_per_chip(QWEN7B, 4) == 1
  assert mem.kv_heads_per_chip(QWEN7B, 8) == 1  # duplicated: one copy a chip, not all four
  assert mem.kv_heads_per_chip(QWEN7B.replace(num_kv_heads=2, num_heads=28), 3) == 2  # replicated
  per_head = 28 * 2 * 128 * 2
  assert mem.kv_bytes_per_token(QWEN7B, 8) == per_head
  s = mem.serving_memory(QWEN7B, mem.ServingShape(chips=8, slots=256, pages=1000, page_size=64))
  assert s["kv_cache"] == 1000 * 64 * per_head


def test_decode_step_is_weights_plus_kv_reads_or_compute_plus_overhead():
  m = QWEN7B
  r = mem.Rates(bytes_s=1e12, flops_s=1e15, call_overhead_s=0.001)
  weights_s = m.num_params() * 2 / 1e12
  one = mem.decode_step_s(m, batch=1, context=0, rates=r, chips=4)
  assert one == pytest.approx(weights_s + 0.001)
  kv = 4 * 28 * 2 * 128 * 2  # bytes per position over the replica's four chips
  big = mem.decode_step_s(m, batch=256, context=8000, rates=r, chips=4)
  assert big == pytest.approx(weights_s + 256 * 8000 * kv / 1e12 + 0.001, rel=1e-9)
  # doubling the live positions adds their reads again
  bigger = mem.decode_step_s(m, batch=256, context=16000, rates=r, chips=4)
  assert bigger - big == pytest.approx(256 * 8000 * kv / 1e12, rel=1e-9)
  # duplicated KV heads (TP 8 over 4 heads) are read by every chip holding a copy
  assert mem.decode_step_s(m, batch=256, context=8000, rates=r, chips=8) > big
  # a slow FLOP rate makes the step compute-bound, and prefill riding in it adds FLOPs
  slow = mem.Rates(bytes_s=1e12, flops_s=1e12)
  cb = mem.decode_step_s(m, batch=64, context=1000, rates=slow, chips=4)
  assert cb > weights_s and cb == pytest.approx(
    (2 * m.num_params() * 64 + 4 * 28 * 28 * 128 * 64 * 1000) / 1e12
  )
  assert mem.decode_step_s(m, batch=64, context=1000, rates=slow, chips=4, prefill_tokens=64) > cb
  assert mem.prefill_s(m, 1000, slow) == pytest.approx(2 * m.num_params() * 1000 / 1e12)


def _rates(shape: mem.ServingShape, in_flight: float, dist: mem.LengthDistribution) -> dict:
  return mem.serving_rates(
    QWEN7B, shape, dist, mem.chip_rates(shape, "v5p"), in_flight=in_flight,
    calls_per_episode=7.0, tokens_per_call=300.0, searches_per_episode=3.0, group_size=16,
  )  # fmt: skip


def test_serving_rates_capacity_queueing_and_prompt_sharing():
  d = mem.LengthDistribution(median=6000.0, sigma=0.8, cap=32768.0)
  paged = mem.ServingShape(chips=4, slots=512, pages=mem.pages_for(512, d, 64), page_size=64,
                           replicas=2)  # fmt: skip
  r = _rates(paged, 2048, d)
  assert (
    r["live_capacity"] == pytest.approx(512, rel=1e-3) and r["decode_batch"] == r["live_capacity"]
  )
  # 1,024 episodes a replica, 512 decoding: each gets a token every other step
  assert r["decode_token_s"] == pytest.approx(r["step_s"] * 1024 / r["live_capacity"])
  light = _rates(paged, 64, d)
  assert light["decode_batch"] == 32 and light["decode_token_s"] == light["step_s"]
  assert light["step_s"] < r["step_s"]
  # the fixed engine reads every slot over the window of the longest
  fixed = mem.ServingShape(chips=4, slots=64, context=32768, replicas=2, share_prompt=False)
  f = _rates(fixed, 2048, d)
  assert f["context"] == 32768 and f["live_capacity"] == 64
  assert f["decode_token_s"] > 4 * r["decode_token_s"]
  assert r["prefill_tokens_per_episode"] == 1024 / 16 + 3 * 512
  assert f["prefill_tokens_per_episode"] == 1024 + 3 * 512


def test_lognormal_mean_is_the_clipped_mean():
  assert plan_sim.LogNormal(median=5.0, sigma=0.0, low=1, high=9).mean() == pytest.approx(5.0)
  clipped = plan_sim.LogNormal(median=300.0, sigma=0.8, low=16, high=1024)
  free = 300 * math.exp(0.32)
  assert 0.85 * free < clipped.mean() < free
