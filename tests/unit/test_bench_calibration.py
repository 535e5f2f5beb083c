"""The serving benchmarks' pieces that decide their figures: plan_serving's rate fit (two engine
steps that are not the checked points give the weights' and the KV's rate) and the long-tail
workload paged_kv.py runs a prefix of (decode.py's)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from asearcher_jax.rl import plan_memory as mem

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str):
  sys.path.insert(0, str(BENCH))  # plan_serving and paged_kv import their neighbours
  spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCH / f"{name}.py")
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod
  spec.loader.exec_module(mod)
  return mod


def test_the_fit_recovers_the_rates_and_predicts_the_checked_points():
  ps = load("plan_serving")
  true = mem.Rates(bytes_s=9e9, flops_s=1e15, call_overhead_s=6e-4, kv_bytes_s=3e9)

  def step(batch: int, context: int) -> float:
    return mem.decode_step_s(
      ps.MODEL, batch=batch, context=context, rates=true, chips=1, kv_dtype=ps.KV_DTYPE
    )

  assert not set(ps.CALIB) & set(ps.POINTS)  # calibrated on other points than it checks
  fit = ps.fit_rates(true.call_overhead_s, {c: step(*c) for c in ps.CALIB}, true.flops_s)
  assert fit.bytes_s == pytest.approx(true.bytes_s, rel=1e-6)
  assert fit.kv_bytes_s == pytest.approx(true.kv_bytes_s, rel=1e-6)
  for batch, context in ps.POINTS:
    planned = mem.decode_step_s(
      ps.MODEL, batch=batch, context=context, rates=fit, chips=1, kv_dtype=ps.KV_DTYPE
    )
    assert planned == pytest.approx(step(batch, context), rel=1e-6)
  # A KV-bound step slower than the weights-bound one by less than its bytes explain still
  # gives positive, finite rates (the floor), not a division by zero or a negative rate.
  lo, hi = sorted(ps.CALIB, key=lambda c: ps.kv_bytes(*c))
  noisy = ps.fit_rates(1.0, {lo: 0.5, hi: 0.6}, true.flops_s)
  assert 0 < noisy.bytes_s < float("inf") and 0 < noisy.kv_bytes_s < float("inf")


def test_the_long_tail_is_a_prefix_of_decode_pys_workload():
  decode = load("decode")
  prompts, lengths = decode.longtail_workload()
  assert len(prompts) == len(lengths) == decode.LONGTAIL_REQUESTS
  assert lengths.min() >= 4 and lengths.max() <= 400 and lengths.max() >= 40 * lengths.min()
  head_p, head_l = decode.longtail_workload(256)
  assert head_p == prompts[:256]
  np.testing.assert_array_equal(head_l, lengths[:256])
  # decode.py's own figure came from this exact draw: the first lengths, seed 1
  rng = np.random.default_rng(1)
  want = np.clip(np.round(np.exp(rng.normal(np.log(20), 1.2, 512))), 4, 400).astype(int)
  np.testing.assert_array_equal(lengths, want)
