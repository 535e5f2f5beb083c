"""The quickstart pipeline at CI size, for real: SynthWiki world, scripted expert over the real
agent and BM25 server, a short `asearcher sft` from scratch, held-out evaluation with the real
engine and harness, then (from the shipped warm start) fully asynchronous RL and the report.

Shown: every stage leaves its artefacts; the warm start's card and shipped copy are complete; the
RL stage trained on accepted groups (from the metrics and the replay log on disk); summary.json
has every field the README promises.
"""

from __future__ import annotations

import dataclasses
import json
import shlex

import pytest

from asearcher_jax.apps import quickstart as pipeline
from asearcher_jax.apps.warm_start import (
  EARLY_ANSWER_OPTIMIZER,
  WARM_START_OPTIMIZER,
  ExpertStage,
  HastyStage,
  SFTStage,
  warm_start,
)
from asearcher_jax.model.sharding import MeshConfig
from asearcher_jax.rl.replay import CONSUMED_LOG
from asearcher_jax.serving.engine import EngineConfig
from asearcher_jax.sft.sft import SFTConfig
from asearcher_jax.synthwiki.wiki import TINY

# One 512-token context and prefill bucket, as much as the test's 4-turn, 512-token agent uses: a
# handful of compiled shapes instead of the quickstart's dozens (the evaluation's warm-up took 22 s
# instead of 65 s with a 2,048-token context and (512, 2,048) buckets; 2026-11-26, 2 cores).
SMALL_ENGINE = EngineConfig(
  max_slots=8, max_seq_len=512, prefill_buckets=(512,), suffix_buckets=(256,)
)
# The SFT on one of the test process's 8 fake devices: the mesh is not what these pipelines test
# (tests/sft and tests/model do), and an 8-way program of these sizes cost this test 64 -> 49 s
# and the long-horizon one 126 -> 96 s (2026-11-29, 2 cores).
ONE_DEVICE = MeshConfig(devices=1)
SUMMARY_KEYS = {
  "avg4_sft", "avg4_rl", "pass4_sft", "pass4_rl", "tool_calls_first_steps",
  "tool_calls_last_steps", "wall_s", "peak_rss_mb",
}  # fmt: skip


@pytest.mark.slow
def test_warm_start_on_a_tiny_world_makes_a_complete_checkpoint(tmp_path):
  ship = tmp_path / "shipped"
  assert warm_start(
    out_dir=str(tmp_path / "ws"), world=TINY,
    expert=ExpertStage(samples_per_question=1, imperfection=0.1),
    sft=SFTStage(
      config=SFTConfig(steps=4, row_len=512, rows_per_batch=8, eval_every=2, checkpoint_every=2,
                       progress=False),
      optimizer=dataclasses.replace(WARM_START_OPTIMIZER, total_steps=4, warmup_steps=1),
      mesh=ONE_DEVICE,
    ),
    hasty=HastyStage(
      early_answer=0.5,
      config=SFTConfig(steps=2, row_len=512, rows_per_batch=8, eval_every=2, checkpoint_every=2,
                       progress=False),
      optimizer=dataclasses.replace(EARLY_ANSWER_OPTIMIZER, total_steps=2, warmup_steps=1),
      mesh=ONE_DEVICE,
    ),
    evaluation=pipeline.QuickstartEval(questions=2, k=2, engine_warmup=False), ship_to=str(ship),
    engine=SMALL_ENGINE,
    # A 6-step model writes to its budgets: 4 turns of 512 tokens, not the quickstart's 16 of 2,048.
    agent=dataclasses.replace(pipeline.QUICKSTART_AGENT, max_turns=4, max_tokens=512),
  ) == 0  # fmt: skip
  ws = tmp_path / "ws"
  assert (ws / "world" / "corpus.jsonl").stat().st_size > 0
  assert len((ws / "expert_trajectories.jsonl").read_text().splitlines()) >= 50
  card = json.loads((ws / "warm_start.json").read_text())
  assert card["sft_summary"]["step"] == 4 and 0.0 <= card["greedy_em"] <= 1.0
  assert card["sft_summary"]["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1}
  assert card["eval"]["greedy"]["n"] == 2 and card["eval"]["sampled"]["k"] == 2
  assert card["expert"]["expert_mean_reward"] > 0.5  # the expert really solves the world
  for name in ("config.json", "model.safetensors", "tokenizer.json", "model_card.md"):
    assert (ship / name).stat().st_size > 0, name
  assert "asearcher warm-start" in (ship / "model_card.md").read_text()
  # The hasty stage fine-tuned the stage-1 model on an expert that answers early, and it is the
  # model that was evaluated and shipped.
  hasty = card["hasty"]
  assert hasty["early_answer"] == 0.5 and hasty["sft_summary"]["step"] == 2
  assert hasty["expert_mean_reward"] < card["expert"]["expert_mean_reward"]
  assert hasty["sft_summary"]["init"].endswith(str(ws / "sft" / "model"))
  shipped = (ship / "model.safetensors").read_bytes()
  assert shipped == (ws / "hasty" / "sft" / "model" / "model.safetensors").read_bytes()
  assert shipped != (ws / "sft" / "model" / "model.safetensors").read_bytes()
  assert "Hasty stage" in (ship / "model_card.md").read_text()


@pytest.mark.slow
def test_quickstart_ci_size_trains_on_accepted_groups_and_reports(tiny_run):
  # The session's tiny run (tests/notebooks/tiny_run.py: the shipped CI sweep's one point, a
  # `quickstart` process with 4 questions, k = 2, 5 s of RL at B = 2, the one-bucket engine),
  # shared with the notebook tests and the sweep's test.
  run_dir = tiny_run / "quickstart"
  summary = json.loads((run_dir / "report" / "summary.json").read_text())
  assert set(summary) >= SUMMARY_KEYS
  assert summary["rl_steps"] >= 1 and summary["eta"] == 4 and summary["k"] == 2
  assert summary["num_test_questions"] == 4
  # The command that made this run: the sweep's point process, its overrides included.
  argv = shlex.split(summary["command"])
  assert argv[:2] == ["asearcher", "quickstart"]
  assert "--gin_param=staleness.StalenessConfig.max_staleness=4" in argv
  assert any(a.startswith("--gin_param=pipeline.quickstart.run_dir=") for a in argv)
  assert set(summary["stages"]) == {"world", "load", "eval_sft", "rl", "eval_rl"}  # report: after
  assert (run_dir / "report" / "training.png").read_bytes()[:4] == b"\x89PNG"
  assert "Avg@4" in (run_dir / "report" / "report.md").read_text()
  # RL trained on accepted groups: B per step, recorded by the metrics and the replay log.
  metrics_log = (run_dir / "rl" / "metrics" / "metrics.jsonl").read_text()
  rows = [json.loads(x) for x in metrics_log.splitlines()]
  assert rows and all(r["ppo/tokens"] > 0 for r in rows)
  # The trainer-sampler agreement of every step, named by the engine path and dtype.
  assert all(sum(k.startswith("agreement/") and k.endswith("/tokens") for k in r) == 1
             for r in rows)  # fmt: skip
  assert rows[-1]["rollout/groups_accepted"] >= 2 * summary["rl_steps"]
  committed = [i for line in (run_dir / "rl" / "replay" / CONSUMED_LOG).read_text().splitlines()
               for i in json.loads(line)["ids"] if not json.loads(line).get("discarded")]  # fmt: skip
  assert len(committed) == 2 * summary["rl_steps"] == len(set(committed))
  # RL drew only questions neither the warm start (train split) nor the evaluation has seen:
  # group ids end in the question id, and the pool is the test split after the evaluated 4.
  test_ids = [json.loads(x)["id"] for x in (run_dir / "world" / "test.jsonl").open()]
  assert {i.rsplit("/", 1)[-1] for i in committed} <= set(test_ids[4:])
  assert list((run_dir / "rl" / "metrics").glob("events.out.tfevents.*"))  # TensorBoard
  assert list((run_dir / "rl" / "checkpoints").iterdir())
  assert len(list((run_dir / "eval").iterdir())) == 2  # SFT and RL evaluations, separately
