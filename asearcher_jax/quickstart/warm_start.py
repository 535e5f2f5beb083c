"""`asearcher warm-start`: how the shipped SynthWiki SFT checkpoint is made, end to end.

  world   SynthWiki (seeded), world tokenizer, BM25 index;
  expert  the scripted expert plays the real ASearcher agent against the real retrieval server on
          the train split, with configurable imperfection, writing token-exact trajectories;
  sft     `asearcher sft` on those trajectories (a from-scratch policy, loss on generated tokens);
  eval    greedy accuracy and sampled Avg@k / Pass@k on held-out test questions, with the real
          engine and evaluation harness;
  card    the scores, world digest, data hash and timings are added to the model card, and with
          `ship_to` the model directory is copied where the quickstart loads it from.

Every stage is deterministic from the seeds, so running the card's command again reproduces the
checkpoint's scores within sampling noise.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

from asearcher_jax.agent import AsearcherAgentConfig
from asearcher_jax.data.synthwiki import SynthWikiConfig
from asearcher_jax.model import steps
from asearcher_jax.quickstart.pipeline import (
  QUICKSTART_AGENT,
  QUICKSTART_ENGINE,
  QUICKSTART_WORLD,
  evaluate,
)
from asearcher_jax.quickstart.stages import StageTracker
from asearcher_jax.quickstart.world import (
  RetrievalThread,
  WorldFiles,
  expert_trajectories,
  prepare_world,
)
from asearcher_jax.serving.engine import EngineConfig
from asearcher_jax.training import commands as sft_commands
from asearcher_jax.training.sft import SFTConfig

# The SFT recipe of the shipped warm start (about 11.5M tokens: ~5 epochs of the expert data at
# 2 episodes per train question). 700 steps left the loss still falling steeply (0.31 -> 0.23 ->
# 0.22 at steps 500/600/700) and a flat sampling tail: sampled Avg@4 7.4% vs greedy 32.8%.
WARM_START_SFT = SFTConfig(
  steps=1400, row_len=1024, rows_per_batch=8, eval_every=100, checkpoint_every=100, progress=False
)
WARM_START_OPTIMIZER = steps.OptimizerConfig(
  learning_rate=2e-3,
  warmup_steps=50,
  total_steps=1400,
  end_lr_ratio=0.1,
  weight_decay=0.01,
  grad_clip=1.0,
)
# Files of an exported model directory that the quickstart needs.
_SHIPPED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def evaluate_model_dir(
  model_dir: Path,
  files: WorldFiles,
  out_dir: Path,
  *,
  eval_questions: int | None,
  k: int,
  temperature: float,
  agent: AsearcherAgentConfig = QUICKSTART_AGENT,
  engine: EngineConfig = QUICKSTART_ENGINE,
  seed: int = 0,
) -> dict[str, Any]:
  """Greedy (k = 1) and sampled (Avg@k, Pass@k) scores of a model directory on the test split."""
  from asearcher_jax.serving.commands import build_policy
  from asearcher_jax.serving.driver import Driver, DriverConfig
  from asearcher_jax.serving.engine import Engine

  policy, tokenizer, _ = build_policy(str(model_dir), None, str(model_dir), seed)
  eng = Engine.from_model(policy, tokenizer, engine)
  eng.warmup(modes=("greedy", "sample"))  # compile once, so evaluation times are serving times
  driver = Driver(eng, DriverConfig())
  try:
    with RetrievalThread(files.index) as server:
      common = dict(
        client=driver, tokenizer=tokenizer, questions=files.test,
        retrieval_address=server.address, out_dir=out_dir, policy=str(model_dir.resolve()),
        limit=eval_questions, agent=agent, concurrency=32, seed=seed,
      )  # fmt: skip
      greedy = evaluate(**common, k=1, temperature=0.0)
      sampled = evaluate(**common, k=k, temperature=temperature)
  finally:
    driver.close()
  return {"greedy": greedy, "sampled": sampled, "temperature": temperature}


def warm_start(
  *,
  out_dir: str = "runs/warm_start",
  world: SynthWikiConfig = QUICKSTART_WORLD,
  samples_per_question: int = 1,
  imperfection: float = 0.15,
  model: str = "synthwiki-2m",
  sft: SFTConfig = WARM_START_SFT,
  optimizer: steps.OptimizerConfig = WARM_START_OPTIMIZER,
  eval_questions: int | None = 64,
  k: int = 4,
  temperature: float = 1.0,
  ship_to: str | None = None,
  engine: EngineConfig = QUICKSTART_ENGINE,
  seed: int = 0,
) -> int:
  """Makes (or, rerun on the same out_dir, resumes) the SynthWiki warm start; see module doc.

  Args:
    out_dir: world, expert trajectories, the SFT run (its `model/` is the checkpoint), evals.
    world: the SynthWiki world (the quickstart must use the same one).
    samples_per_question: expert episodes per train question.
    imperfection: the expert's mistake level (`ExpertConfig.imperfect`), room for RL to improve.
    model: the from-scratch policy preset (vocab sized to the world tokenizer).
    sft / optimizer: SFT steps, batch shape and AdamW schedule.
    eval_questions / k / temperature: held-out evaluation (the quickstart's settings).
    ship_to: copy the model directory and its card here (the quickstart's default is
      asearcher_jax/assets/checkpoints/synthwiki_sft).
    engine: the evaluation engine's slots, context and prefill buckets.
    seed: expert and evaluation seed.
  """  # fmt: skip
  t0 = time.time()
  out = Path(out_dir)
  tracker = StageTracker(
    [("world", 3), ("expert", 40), ("sft", 1200), ("eval", 120), ("card", 2)], prefix="warm-start"
  )
  with tracker.stage("world"):
    sw, files = prepare_world(out / "world", world)
  with tracker.stage("expert"):
    data = out / "expert_trajectories.jsonl"
    expert = expert_trajectories(
      sw, files, data, samples_per_question=samples_per_question, imperfection=imperfection,
      seed=seed,
    )  # fmt: skip
  with tracker.stage("sft"):
    sft_commands.sft(
      trajectories=str(data), out_dir=str(out / "sft"), model=model,
      tokenizer_dir=str(files.tokenizer), config=sft, optimizer=optimizer, init_seed=seed,
      name="SynthWiki warm start (asearcher warm-start)",
    )  # fmt: skip
  model_dir = out / "sft" / "model"
  with tracker.stage("eval"):
    scores = evaluate_model_dir(
      model_dir, files, out / "eval", eval_questions=eval_questions, k=k,
      temperature=temperature, engine=engine, seed=seed,
    )  # fmt: skip
  with tracker.stage("card"):
    card = {
      "command": "asearcher warm-start --gin_file gin/experiments/warm_start.gin",
      "world": dataclasses.asdict(world),
      "world_digest": files.digest,
      "expert": {"imperfection": imperfection, "samples_per_question": samples_per_question,
                 **expert},
      "sft_summary": json.loads((out / "sft" / "sft_summary.json").read_text()),
      "greedy_em": scores["greedy"]["avg_em"],
      "sampled_avg_em": scores["sampled"]["avg_em"],
      "sampled_pass_em": scores["sampled"]["pass_em"],
      "eval": scores,
      "stages_s": tracker.timings(),
      "wall_s": round(time.time() - t0, 1),
    }  # fmt: skip
    (out / "warm_start.json").write_text(json.dumps(card, indent=2, default=str) + "\n")
    _write_card(out / "model_card.md", card, out / "sft" / "model_card.md")
    if ship_to:
      ship(model_dir, out, Path(ship_to))
  print(json.dumps({k: card[k] for k in ("greedy_em", "sampled_avg_em", "sampled_pass_em",
                                         "world_digest", "wall_s")}), flush=True)  # fmt: skip
  return 0


def ship(model_dir: Path, out: Path, dest: Path) -> None:
  """Copies the files the quickstart needs (weights, config, tokenizer, card)."""
  dest.mkdir(parents=True, exist_ok=True)
  for name in _SHIPPED:
    if (model_dir / name).exists():
      shutil.copy2(model_dir / name, dest / name)
  for name in ("model_card.md", "warm_start.json"):
    shutil.copy2(out / name, dest / name)
  # The SFT part of the card says how to use the model where it was trained; point it here.
  card = dest / "model_card.md"
  card.write_text(card.read_text().replace(f'model_dir="{model_dir}"', f'model_dir="{dest}"'))


def _pct(x: float) -> str:
  return f"{100 * x:.1f}%"


def _write_card(path: Path, card: dict[str, Any], sft_card: Path) -> None:
  s = card["sft_summary"]
  lines = [
    "# SynthWiki warm start",
    "",
    "A tiny Qwen2-architecture policy trained from scratch by supervised fine-tuning on the "
    "scripted expert's token-exact ASearcher trajectories in the SynthWiki world; the starting "
    "point of `asearcher quickstart`, which improves it with asynchronous RL.",
    "",
    "## Reproduce",
    "",
    "```",
    card["command"],
    "```",
    "",
    f"World: SynthWiki seed {card['world']['seed']}, digest `{card['world_digest']}`. Expert: "
    f"imperfection {card['expert']['imperfection']}, {card['expert']['samples_per_question']} "
    f"episodes per train question ({int(card['expert']['trajectories'])} trajectories, mean "
    f"reward {card['expert']['expert_mean_reward']:.3f}).",
    "",
    "## Held-out scores (test split, questions never seen in training)",
    "",
    f"| greedy EM | sampled Avg@{card['eval']['sampled']['k']} EM | sampled "
    f"Pass@{card['eval']['sampled']['k']} EM | temperature | questions |",
    "|---|---|---|---|---|",
    f"| {_pct(card['greedy_em'])} | {_pct(card['sampled_avg_em'])} | "
    f"{_pct(card['sampled_pass_em'])} | {card['eval']['temperature']} | "
    f"{card['eval']['greedy']['n']} |",
    "",
    f"Wall time of the whole command: {card['wall_s']:.0f} s on this machine (stages: "
    + ", ".join(f"{k} {v:.0f} s" for k, v in card["stages_s"].items())
    + f"). SFT: {s.get('step', '?')} steps.",
    "",
    "---",
    "",
    sft_card.read_text() if sft_card.exists() else "",
  ]
  path.write_text("\n".join(lines))
