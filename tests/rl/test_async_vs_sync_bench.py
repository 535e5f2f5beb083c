"""The async-vs-sync benchmark at a tiny scale: it runs both modes end to end through the real
trainer, and its JSON carries what the issue asks for, with the staleness bound visible in the
token versions (eta = 0: none; eta = 4: at most 4)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "async_vs_sync.py"


def load_bench():
  spec = importlib.util.spec_from_file_location("async_vs_sync_bench", BENCH)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod  # dataclasses resolve string annotations through it
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.slow
def test_benchmark_runs_both_modes_and_reports(capsys):
  bench = load_bench()
  result = bench.main([
    "--steps", "3", "--batch-groups", "2", "--group-size", "2", "--minibatches", "1",
    "--async-concurrent", "4", "--slots", "4", "--k-max", "3", "--tool-median-s", "0.05",
    "--no-warmup",
  ])  # fmt: skip
  last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert last == json.loads(json.dumps(result))  # the last printed line is the result
  assert {"speedup", "trainer_idle_async", "occupancy_async"} <= set(last)
  sync, asyn = last["sync"], last["async"]
  assert sync["steps"] == asyn["steps"] == 3
  assert sync["staleness_max"] == 0 == sync["staleness_head_max"]
  assert asyn["staleness_max"] <= 4 and asyn["staleness_head_max"] <= 4
  assert last["speedup"] > 0 and 0 <= last["trainer_idle_async"] <= 1
  assert 0 <= last["occupancy_async"] <= 1
  for mode in (sync, asyn):
    assert mode["trained_tokens"] > 0 and mode["tool_calls"] > 0
    # Group latency and the staleness rule's capacity, from the trainer's per-step metrics.
    assert 0 < mode["group_s_mean"] <= mode["group_s_max"]
  # With --no-warmup the first mode compiles inside its engine calls; busy time is net of it.
  assert sync["engine"]["compile_s"] > 0
  for mode in (sync, asyn):
    e = mode["engine"]
    net = e["busy_s_per_trained_token"] * mode["trained_tokens"]
    assert net > 0
    assert net == pytest.approx(
      e["prefill_s"] + e["update_s"] + e["decode_s"] - e["compile_s"], abs=0.05
    )
  assert last["capacity_ratio_async"] == pytest.approx(
    5 * asyn["train_s_mean"] / asyn["group_s_mean"], rel=0.02
  )
  # The learner's step timed again on the same batches with the engine idle (steps 2 and 3).
  for mode in (sync, asyn):
    alone = mode["learner_alone"]
    assert alone["steps"] == 2 and alone["train_s_alone"] > 0 and alone["train_s_in_run"] > 0
    assert alone["in_run_vs_alone"] == pytest.approx(
      alone["train_s_in_run"] / alone["train_s_alone"], rel=0.05
    )
    assert alone["prepare_s_alone"] >= 0 and alone["device_s_alone"] > 0
    assert alone["prepare_s_in_run"] + alone["device_s_in_run"] <= alone["train_s_in_run"] + 0.01
  assert last["learner_in_run_vs_alone_async"] == asyn["learner_alone"]["in_run_vs_alone"]


@pytest.mark.slow
def test_benchmark_with_the_engine_in_its_own_process(capsys):
  """--engine process: async mode generates on a `serve-model` child process over HTTP and
  hands it each new version through the weights directory; the bound still holds, measured
  from the versions the server stamped on the tokens, and versions past 0 reached it."""
  cpus_before = os.sched_getaffinity(0)
  bench = load_bench()
  core = min(os.sched_getaffinity(0))  # a core this process may use (CI may not give it core 0)
  result = bench.main([
    "--steps", "3", "--batch-groups", "2", "--group-size", "2", "--minibatches", "1",
    "--async-concurrent", "4", "--slots", "4", "--k-max", "3", "--tool-median-s", "0.05",
    "--engine", "process", "--engine-cpus", str(core), "--no-warmup",
  ])  # fmt: skip
  assert result["engine"] == "process" and result["engine_cpus"] == [core]
  assert os.sched_getaffinity(0) == cpus_before  # the trainer's pin was undone
  asyn = result["async"]
  assert asyn["steps"] == 3 and asyn["trained_tokens"] > 0 and asyn["tool_calls"] > 0
  assert asyn["staleness_max"] <= 4 and asyn["staleness_head_max"] <= 4
  # The served driver's own figures: it decoded, and it loaded the last published version.
  assert asyn["engine"]["decode_steps"] > 0
  assert asyn["engine"]["served"]["version"] == 3
  assert "Traceback" not in capsys.readouterr().out


def test_cpu_lists_parse():
  assert load_bench().parse_cpus("0-3, 6") == (0, 1, 2, 3, 6)
  assert load_bench().parse_cpus("") == ()
