"""The evaluation recipes of gin/experiments/eval_*.gin: each is a configuration `asearcher eval`
accepts and runs end to end on CPU under gin/overlays/eval_tiny.gin; the 7B recipe with all of its
budgets checked (64 calls, 4,096 tokens a call, a 32,768-token context, k = 4, temperature 0.6, the
judge's sampling), the policy and the judge being the local stand-in server: Avg@4 and Pass@4 are
written, and the judge's verdict on every prediction."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asearcher_jax.data.qa import load_dataset
from asearcher_jax.testing.standin_server import StandinServer

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "gin" / "experiments").glob("eval_*.gin"))


def _eval(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-m", "asearcher_jax.main", "eval", *args],
    cwd=REPO, capture_output=True, text=True, timeout=timeout,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )  # fmt: skip


def test_every_real_model_has_an_evaluation_recipe():
  names = {p.stem for p in RECIPES}
  assert names >= {
    "eval_asearcher_local_qwen2_5_7b", "eval_asearcher_local_qwen2_5_14b",
    "eval_asearcher_web_qwq_32b", "eval_search_r1_qwen2_5_7b",
  }  # fmt: skip
  for recipe in RECIPES:
    head = recipe.read_text().split("from __gin__", 1)[0]
    for field in ("# Run:", "# Requires:", "# Hardware:", "# Target:", "# CPU smoke:"):
      assert field in head, f"{recipe.name}: no {field!r} in its header"


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_evaluation_recipe_and_its_cpu_overlay_check(recipe):
  """The recipe alone configures, and its preflight refuses it on this host in one line naming
  an input path that only a pod has (the model, the test sets); with the CPU overlay it passes."""
  alone = _eval(f"--gin_file={recipe.relative_to(REPO)}", "--check", timeout=300)
  assert alone.returncode == 2 and alone.stderr.count("\n") == 1, alone.stderr
  assert "does not exist on this host" in alone.stderr and "/mnt/asearcher/" in alone.stderr
  files = [recipe, REPO / "gin/overlays/eval_tiny.gin"]
  proc = _eval(*(f"--gin_file={f.relative_to(REPO)}" for f in files), "--check", timeout=300)
  assert proc.returncode == 0 and "configuration ok" in proc.stdout + proc.stderr, proc.stderr


@pytest.mark.slow
async def test_eval_7b_recipe_budgets_on_the_tiny_standin_write_avg4_pass4_and_verdicts(
  tmp_path, retrieval_server
):
  examples = [e for d in ("bamboogle", "nq17") for e in load_dataset(d, limit=3)]
  standin = StandinServer(examples, accuracy=0.5)
  port = await asyncio.wait_for(standin.start(), 10)
  url = f"http://127.0.0.1:{port}/v1"
  try:
    proc = await asyncio.to_thread(
      _eval,
      "--gin_file=gin/experiments/eval_asearcher_local_qwen2_5_7b.gin",
      "--gin_file=gin/overlays/eval_tiny.gin",
      f"--gin_param=commands.Generation.server_url='{url}'",
      f"--gin_param=judge.JudgeConfig.base_url='{url}'",
      f"--gin_param=commands.EvalTools.retrieval_addresses=['127.0.0.1:{retrieval_server.port}']",
      f"--gin_param=runner.RunnerConfig.output_dir='{tmp_path}'",
      "--gin_param=runner.RunnerConfig.progress=False",
    )
  finally:
    await standin.stop()
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "eval: 24 results (24 computed, 0 resumed, 24 judged)" in proc.stdout
  run_dir = Path(json.loads(proc.stdout.strip().splitlines()[-1])["run_dir"])
  config = json.loads((run_dir / "config.json").read_text())
  agent = config["agent_config"]
  assert (agent["max_turns"], agent["max_new_tokens"], agent["max_tokens"]) == (64, 4096, 32768)
  assert agent["prompt"] == "eval" and config["sampling"]["temperature"] == 0.6
  summary = json.loads((run_dir / "summary.json").read_text())
  for name in ("bamboogle", "nq17"):
    d = summary["datasets"][name]
    assert (d["n"], d["k"]) == (3, 4)
    avg, best = d["avg@k"], d["pass@k"]
    # The stand-in answers right about half the time: Pass@4 above Avg@4, both strictly inside.
    assert 0 < avg["em"] < best["em"] <= 1 and 0 < avg["judge"] < best["judge"] <= 1
    assert d["judge_judged"] == 12 and d["judge_failed"] == 0
  snaps = [json.loads(p.read_text()) for p in run_dir.glob("*/run*/*.json")]
  assert len(snaps) == 24
  for s in snaps:
    (verdict,) = s["judge"].values()
    assert verdict["status"] == "success"
    # The stand-in's judge agrees with exact match on its own answers.
    assert (verdict["judgement"] == "correct") == (s["scores"]["em"] == 1.0)
    assert s["stats"]["searches"] == 1 and s["finish_reason"] == "answer"
  # Verdicts are cached: at most one request a prediction, at least one a distinct prediction of
  # a question (two identical ones judged at once may both ask).
  distinct = len({(s["dataset"], s["qid"], s["pred"]) for s in snaps})
  assert distinct <= standin.requests["chat"] <= 24


@pytest.mark.slow
@pytest.mark.parametrize(
  "recipe",
  [r for r in RECIPES if r.stem != "eval_asearcher_local_qwen2_5_7b"],
  ids=lambda p: p.stem,
)
async def test_every_eval_recipe_runs_on_the_tiny_standin(recipe, tmp_path, retrieval_server):
  """The 14B, QwQ-32B (the reasoning agent, its web tools swapped for local ones) and Search-R1
  evaluation recipes, each with its own agent and budgets, end to end on the stand-in."""
  examples = [e for d in ("bamboogle", "nq17") for e in load_dataset(d, limit=3)]
  standin = StandinServer(examples, accuracy=0.5)
  port = await asyncio.wait_for(standin.start(), 10)
  url = f"http://127.0.0.1:{port}/v1"
  try:
    proc = await asyncio.to_thread(
      _eval,
      f"--gin_file={recipe.relative_to(REPO)}",
      "--gin_file=gin/overlays/eval_tiny.gin",
      f"--gin_param=commands.Generation.server_url='{url}'",
      f"--gin_param=judge.JudgeConfig.base_url='{url}'",
      f"--gin_param=commands.EvalTools.retrieval_addresses=['127.0.0.1:{retrieval_server.port}']",
      f"--gin_param=runner.RunnerConfig.output_dir='{tmp_path}'",
      "--gin_param=runner.RunnerConfig.progress=False",
    )
  finally:
    await standin.stop()
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "eval: 24 results (24 computed, 0 resumed, 24 judged)" in proc.stdout
  run_dir = Path(json.loads(proc.stdout.strip().splitlines()[-1])["run_dir"])
  summary = json.loads((run_dir / "summary.json").read_text())
  for name in ("bamboogle", "nq17"):
    d = summary["datasets"][name]
    assert (d["n"], d["k"], d["judge_judged"]) == (3, 4, 12)
    # Each agent searched, reached its answer and was scored: Pass@4 above Avg@4.
    assert d["mean_tool_calls"] >= 1 and 0 < d["avg@k"]["judge"] < d["pass@k"]["judge"] <= 1
