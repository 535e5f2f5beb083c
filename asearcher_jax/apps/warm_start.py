"""`asearcher warm-start`: how the shipped SynthWiki SFT checkpoint is made, end to end.

  world   SynthWiki (seeded), world tokenizer, BM25 index;
  expert  the scripted expert plays the real ASearcher agent against the real retrieval server on
          the train split, with configurable imperfection, writing token-exact trajectories;
  sft     `asearcher sft` on those trajectories (a from-scratch policy, loss on generated tokens);
  hasty   (with `HastyStage.early_answer` > 0) the same expert, careful in every way but one: at
          each act turn before its chain is resolved it answers with a guess with probability
          `early_answer`;
          a short `asearcher sft` from the stage-1 model on its trajectories;
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
from asearcher_jax.apps import invocation
from asearcher_jax.apps import sft as sft_commands
from asearcher_jax.apps.quickstart import (
  QUICKSTART_AGENT,
  QUICKSTART_ENGINE,
  QUICKSTART_WORLD,
  QuickstartEval,
  evaluate,
)
from asearcher_jax.apps.stages import StageTracker
from asearcher_jax.apps.world import (
  RetrievalThread,
  WorldFiles,
  expert_trajectories,
  prepare_world,
)
from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model import steps
from asearcher_jax.model.loading import PolicyConfig
from asearcher_jax.serving.engine import EngineConfig
from asearcher_jax.sft.sft import SFTConfig
from asearcher_jax.synthwiki.wiki import SynthWiki, SynthWikiConfig

# The command that makes the shipped warm start (its card's default "Reproduce" line).
COMMAND = "asearcher warm-start --gin_file gin/experiments/warm_start.gin"
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
# The "hasty" stage. ASearcher's RL starts from models that can search but stop too early, and its
# headline effect is longer search. Stage 1 teaches the protocol and the copy skill from a mostly
# careful expert; this stage fine-tunes that model briefly on an expert that makes one kind of
# mistake only, answering before its chain is resolved. The result reads and copies like stage 1
# but often answers without searching: one consistent behaviour, with a clear reward signal, for
# RL to fix (measured: stage 1 alone left RL mostly sampling noise in copied names to remove).
EARLY_ANSWER_SFT = SFTConfig(
  steps=200, row_len=1024, rows_per_batch=8, eval_every=50, checkpoint_every=100, progress=False
)
EARLY_ANSWER_OPTIMIZER = steps.OptimizerConfig(
  learning_rate=5e-4,
  warmup_steps=10,
  total_steps=200,
  end_lr_ratio=0.2,
  weight_decay=0.01,
  grad_clip=1.0,
)
# Files of an exported model directory that the quickstart needs.
_SHIPPED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertStage:
  """The stage-1 data: the scripted expert on the train split."""

  # Expert episodes per train question.
  samples_per_question: int = 1
  # The expert's mistake level (`ExpertConfig.imperfect`): room for RL to improve.
  imperfection: float = 0.15


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTStage:
  """Stage 1: `asearcher sft` from scratch on the expert's trajectories."""

  # The from-scratch preset (its vocabulary sized to the world tokenizer).
  scratch: sft_commands.ScratchModel = sft_commands.ScratchModel()
  # Steps, batch shape and cadence.
  config: SFTConfig = WARM_START_SFT
  # The AdamW schedule.
  optimizer: steps.OptimizerConfig = WARM_START_OPTIMIZER
  # The SFT's (data, fsdp, tensor) mesh (default: every device on fsdp).
  mesh: sharding_lib.MeshConfig = sharding_lib.MeshConfig()

  def run(
    self, trajectories: str | list[str], out_dir: Path, *, policy: PolicyConfig, name: str
  ) -> Path:
    """Trains this SFT on `trajectories` in `out_dir` (resuming from its checkpoints) from
    `policy`; returns the exported model's directory."""
    sft_commands.train_sft(
      trajectories=trajectories, out_dir=str(out_dir), policy=policy, scratch=self.scratch,
      config=self.config, optimizer=self.optimizer, mesh=self.mesh,
      precision=steps.PrecisionConfig(), export_dtype=None, name=name,
    )  # fmt: skip
    return out_dir / "model"


@dataclasses.dataclass(frozen=True, kw_only=True)
class HastyStage:
  """The hasty stage (see EARLY_ANSWER_SFT): a short SFT from the stage-1 model on an expert that
  answers early (one episode per train question, expert seed + 1)."""

  # The expert's probability of answering with a guess at each act turn before its chain is
  # resolved; 0 skips the stage.
  early_answer: float = 0.5
  # Steps, batch shape and cadence.
  config: SFTConfig = EARLY_ANSWER_SFT
  # The AdamW schedule.
  optimizer: steps.OptimizerConfig = EARLY_ANSWER_OPTIMIZER
  # The SFT's (data, fsdp, tensor) mesh (default: every device on fsdp).
  mesh: sharding_lib.MeshConfig = sharding_lib.MeshConfig()


def evaluate_model_dir(
  model_dir: Path,
  files: WorldFiles,
  out_dir: Path,
  *,
  evaluation: QuickstartEval = QuickstartEval(),
  temperature: float,
  agent: AsearcherAgentConfig = QUICKSTART_AGENT,
  engine: EngineConfig = QUICKSTART_ENGINE,
  policy_name: str | None = None,
  greedy: bool = True,
) -> dict[str, Any]:
  """Greedy (k = 1; skipped with greedy=False) and sampled (Avg@k, Pass@k) scores of a model
  directory on the test split. `policy_name` names the weights in the evaluation's identity (default:
  the directory), so a pipeline evaluating the same weights under the same name resumes from
  these snapshots instead of running them again."""
  from asearcher_jax.model.loading import load_policy
  from asearcher_jax.serving.driver import Driver, DriverConfig
  from asearcher_jax.serving.engine import Engine

  ev = evaluation
  policy, tokenizer, _ = load_policy(str(model_dir), None, str(model_dir), ev.seed)
  eng = Engine.from_model(policy, tokenizer, engine)
  if ev.engine_warmup:  # compile once, so evaluation times are serving times
    eng.warmup(modes=("greedy", "sample"))
  driver = Driver(eng, DriverConfig())
  try:
    with RetrievalThread(files.index) as server:
      common = dict(
        client=driver, tokenizer=tokenizer, questions=files.test,
        retrieval_address=server.address, out_dir=out_dir,
        policy=policy_name or str(model_dir.resolve()),
        limit=ev.questions, agent=agent, concurrency=ev.concurrency, seed=ev.seed,
      )  # fmt: skip
      scores = {"greedy": evaluate(**common, k=1, temperature=0.0)} if greedy else {}
      scores["sampled"] = evaluate(**common, k=ev.k, temperature=temperature)
  finally:
    driver.close()
  return {**scores, "temperature": temperature}


def warm_start(
  *,
  out_dir: str = "runs/warm_start",
  world: SynthWikiConfig = QUICKSTART_WORLD,
  expert: ExpertStage = ExpertStage(),
  sft: SFTStage = SFTStage(),
  hasty: HastyStage = HastyStage(),
  evaluation: QuickstartEval = QuickstartEval(),
  temperature: float = 1.0,
  engine: EngineConfig = QUICKSTART_ENGINE,
  agent: AsearcherAgentConfig = QUICKSTART_AGENT,
  ship_to: str | None = None,
  seed: int = 0,
) -> int:
  """Makes (or, rerun on the same out_dir, resumes) the SynthWiki warm start; see module doc.

  Args:
    out_dir: world, expert trajectories, the SFT run (its `model/` is the checkpoint), evals.
    world: the SynthWiki world (the quickstart must use the same one).
    expert: episodes per train question and the expert's mistake level.
    sft: stage 1's from-scratch preset, SFT steps, batch shape and AdamW schedule.
    hasty: the hasty stage's early-answer probability (0 skips it) and its fine-tuning.
    evaluation: held-out questions, k and concurrency (the quickstart's evaluation settings);
      its seed is the evaluation's.
    temperature: sampling temperature of the Avg@k / Pass@k evaluation (unless `evaluation`
      names its own).
    engine: the evaluation engine's slots, context and prefill buckets.
    agent: the evaluation agent's budgets (turns, tokens); the quickstart's by default.
    ship_to: copy the model directory and its card here (the quickstart's default is
      asearcher_jax/assets/checkpoints/synthwiki_sft).
    seed: the expert's seed (the hasty expert's is seed + 1) and the SFT init seed.
  """  # fmt: skip
  t0 = time.time()
  out = Path(out_dir)
  plan = [("world", 3), ("expert", 40), ("sft", 1200)]
  plan += [("hasty", 300)] if hasty.early_answer > 0 else []
  tracker = StageTracker([*plan, ("eval", 120), ("card", 2)], prefix="warm-start")
  with tracker.stage("world"):
    sw, files = prepare_world(out / "world", world)
  with tracker.stage("expert"):
    data = out / "expert_trajectories.jsonl"
    expert_stats = expert_trajectories(
      sw, files, data, samples_per_question=expert.samples_per_question,
      imperfection=expert.imperfection, seed=seed,
    )  # fmt: skip
  with tracker.stage("sft"):
    sft.run(
      str(data),
      out / "sft",
      policy=PolicyConfig(tokenizer_dir=str(files.tokenizer), seed=seed),
      name="SynthWiki warm start (asearcher warm-start)",
    )
  model_dir = out / "sft" / "model"
  hasty_card = None
  if hasty.early_answer > 0:
    with tracker.stage("hasty"):
      hasty_card = hasty_stage(sw, files, out, model_dir, hasty=hasty, seed=seed + 1)
    model_dir = out / "hasty" / "sft" / "model"
  with tracker.stage("eval"):
    scores = evaluate_model_dir(
      model_dir, files, out / "eval", evaluation=evaluation,
      temperature=evaluation.eval_temperature(temperature), engine=engine, agent=agent,
    )  # fmt: skip
  with tracker.stage("card"):
    card = {
      "command": invocation.command(COMMAND),
      "world": dataclasses.asdict(world),
      "world_digest": files.digest,
      "expert": {"imperfection": expert.imperfection,
                 "samples_per_question": expert.samples_per_question, **expert_stats},
      "sft_summary": json.loads((out / "sft" / "sft_summary.json").read_text()),
      "hasty": hasty_card,
      "greedy_em": scores["greedy"]["avg_em"],
      "sampled_avg_em": scores["sampled"]["avg_em"],
      "sampled_pass_em": scores["sampled"]["pass_em"],
      "eval": scores,
      "stages_s": tracker.timings(),
      "wall_s": round(time.time() - t0, 1),
    }  # fmt: skip
    (out / "warm_start.json").write_text(json.dumps(card, indent=2, default=str) + "\n")
    sft_cards = [out / "sft" / "model_card.md"]
    sft_cards += [out / "hasty" / "sft" / "model_card.md"] if hasty_card else []
    _write_card(out / "model_card.md", card, sft_cards)
    if ship_to:
      ship(model_dir, out, Path(ship_to))
  print(json.dumps({k: card[k] for k in ("greedy_em", "sampled_avg_em", "sampled_pass_em",
                                         "world_digest", "wall_s")}), flush=True)  # fmt: skip
  return 0


def hasty_stage(
  sw: SynthWiki, files: WorldFiles, out: Path, init_dir: Path, *, hasty: HastyStage, seed: int
) -> dict[str, Any]:
  """Fine-tunes `init_dir` on an expert whose only mistake is answering early (see
  EARLY_ANSWER_SFT); writes out/hasty/{expert_trajectories.jsonl, sft/}."""
  from asearcher_jax.synthwiki.expert import ExpertConfig

  data = out / "hasty" / "expert_trajectories.jsonl"
  data.parent.mkdir(parents=True, exist_ok=True)
  expert = expert_trajectories(
    sw, files, data, expert=ExpertConfig(seed=seed, p_guess=hasty.early_answer), seed=seed
  )
  SFTStage(config=hasty.config, optimizer=hasty.optimizer, mesh=hasty.mesh).run(
    str(data),
    out / "hasty" / "sft",
    policy=PolicyConfig(model_dir=str(init_dir), tokenizer_dir=str(files.tokenizer), seed=seed),
    name="SynthWiki warm start, hasty stage (asearcher warm-start)",
  )
  summary = json.loads((out / "hasty" / "sft" / "sft_summary.json").read_text())
  return {"early_answer": hasty.early_answer, **expert, "sft_summary": summary}


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


def _hasty_lines(hasty: dict[str, Any] | None) -> list[str]:
  if not hasty:
    return []
  return [
    f"Hasty stage: then {hasty['sft_summary'].get('step', '?')} SFT steps from that model on an "
    f"expert that answers with a guess with probability {hasty['early_answer']} at each act turn "
    f"before its chain is resolved, and makes no other mistake ({int(hasty['trajectories'])} "
    f"trajectories, mean reward {hasty['expert_mean_reward']:.3f}).",
    "",
  ]


def _pct(x: float) -> str:
  return f"{100 * x:.1f}%"


def _write_card(path: Path, card: dict[str, Any], sft_cards: list[Path]) -> None:
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
    *_hasty_lines(card.get("hasty")),
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
    + f"). SFT: {s.get('step', '?')} steps"
    + (f" (this run resumed it at step {s['start_step']})." if s.get("start_step") else "."),
    "",
    "---",
    "",
    *(c.read_text() + "\n" for c in sft_cards if c.exists()),
  ]
  path.write_text("\n".join(lines))
