"""Expert relabelling rounds after the long-horizon warm start's SFT (DAgger).

A warm start cloned from the expert's episodes meets, in its own episodes, contexts the expert
never showed it (one wrong relation, entity or URL and every later turn is off the expert's
path), and it has learned nothing there. Each round runs the current model on train questions
(real agent, real tools, the RL temperature), takes the scripted expert's turn wherever
the model's differs (`synthwiki.relabel`), and fine-tunes the model on those corrections together
with the SFT's own data, so that what it learned from the expert is kept. Every piece resumes:
the episodes are evaluation snapshots, the corrections a file written once, the fine-tune an
`asearcher sft` run with checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Sequence
from pathlib import Path

from asearcher_jax import storage
from asearcher_jax.agent import AsearcherAgentConfig
from asearcher_jax.agent.trajectory import Trajectory
from asearcher_jax.apps.quickstart import QuickstartEval
from asearcher_jax.apps.warm_start import SFTStage, evaluate_model_dir
from asearcher_jax.apps.world import WorldFiles
from asearcher_jax.errors import AsearcherError
from asearcher_jax.evaluation.runner import SnapshotStore
from asearcher_jax.model import steps
from asearcher_jax.model.loading import PolicyConfig
from asearcher_jax.serving.engine import EngineConfig
from asearcher_jax.sft.sft import SFTConfig
from asearcher_jax.synthwiki import relabel
from asearcher_jax.synthwiki.expert import ExpertConfig, SynthWikiExpert, write_trajectories
from asearcher_jax.synthwiki.wiki import SynthWiki
from asearcher_jax.tokenizer import Tokenizer

# A round's fine-tune: short, at a lower rate than the SFT's (it starts from the SFT's model).
DAGGER_SFT = SFTStage(
  config=SFTConfig(
    steps=300, row_len=2048, rows_per_batch=4, eval_every=100, checkpoint_every=100,
    progress=False,
  ),
  optimizer=steps.OptimizerConfig(
    learning_rate=2e-4, warmup_steps=10, total_steps=300, end_lr_ratio=0.1, weight_decay=0.01,
    grad_clip=1.0,
  ),
)  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class DaggerStage:
  """Rounds of expert relabelling after the warm start's SFT (0 rounds: none)."""

  # Rounds; each fine-tunes the previous round's model (the first: the SFT's).
  rounds: int = 0
  # Train questions whose episodes a round relabels (a seeded draw per round).
  questions: int = 256
  # Episodes per question (sampled at the run's temperature).
  samples: int = 2
  # Times the corrections are listed in a round's data beside the SFT's files (their weight).
  repeat: int = 2
  # Each round's fine-tune (its steps, batch and AdamW schedule; the scratch preset is unused).
  sft: SFTStage = DAGGER_SFT
  # The labeller gives up as the warm start's expert does (its p_guess and give-up point);
  # False: it plays every chain to its end, so the corrections teach only the chain (with the
  # give-up, ~40 % of a round's first disagreements were a random guess, 2026-11-27).
  labeller_gives_up: bool = True
  # The policy's early answers (a guess where the labeller searches on) are not corrected: with
  # `labeller_gives_up` False the round teaches the chain and leaves the give-up, the weakness
  # RL is meant to fix (`relabel` keep_guesses).
  keep_guesses: bool = False
  # Keep only each episode's first correction (`relabel` first_only): the later ones label
  # states off the expert's path, with the expert's recovery turns.
  first_only: bool = False


def labeller_config(expert: ExpertConfig, stage: DaggerStage) -> ExpertConfig:
  """The expert whose turns a round's corrections are: the warm start's, less its give-up when
  `stage.labeller_gives_up` is False (its other mistakes, attempts and note style kept)."""
  if stage.labeller_gives_up:
    return expert
  return dataclasses.replace(expert, p_guess=0.0, give_up_after_hops=None)


def round_questions(train_jsonl: Path, out: Path, n: int, seed: int) -> Path:
  """`out`: n train questions (JSONL rows of the split) drawn with `seed`, written once."""
  if not out.exists():
    rows = [
      line for line in storage.jsonl_lines(train_jsonl.read_text(encoding="utf-8")) if line.strip()
    ]
    if not rows:
      raise AsearcherError(f"{train_jsonl}: no train questions to relabel")
    picked = random.Random(f"dagger|{seed}").sample(rows, min(n, len(rows)))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".tmp").write_text("\n".join(picked) + "\n")
    out.with_suffix(".tmp").rename(out)
  return out


def episodes(eval_dir: Path) -> list[Trajectory]:
  """The policy episodes an evaluation under `eval_dir` saved (every run of every question),
  each scored with its exact match."""
  out = []
  for run_dir in sorted(p for p in eval_dir.iterdir() if p.is_dir()):
    for snap in SnapshotStore(run_dir).iter_snapshots():
      if "trajectory" in snap:
        traj = Trajectory.from_json(snap["trajectory"])
        traj.score = float(snap.get("scores", {}).get("em", 0.0))
        out.append(traj)
  return out


def run_round(
  root: Path,
  model_dir: Path,
  *,
  sw: SynthWiki,
  files: WorldFiles,
  expert: ExpertConfig,
  stage: DaggerStage,
  data_paths: Sequence[str],
  corrections: Sequence[str],
  agent: AsearcherAgentConfig,
  engine: EngineConfig,
  temperature: float,
  seed: int,
) -> tuple[Path, Path]:
  """One round under `root`: episodes of `model_dir`, their corrections, the fine-tune on
  `data_paths` plus every correction file so far; returns (the new model, this round's
  corrections file)."""
  questions = round_questions(files.train, root / "questions.jsonl", stage.questions, seed)
  evaluate_model_dir(
    model_dir, dataclasses.replace(files, test=questions), root / "episodes",
    evaluation=QuickstartEval(questions=None, k=stage.samples, seed=seed),
    temperature=temperature, agent=agent, engine=engine, policy_name=f"dagger:{root.name}",
    greedy=False,
  )  # fmt: skip
  fixed = root / "corrections.jsonl"
  if not fixed.exists():
    labeller = SynthWikiExpert(
      sw.world, sw.train, Tokenizer.from_dir(files.tokenizer), labeller_config(expert, stage)
    )
    trajs = episodes(root / "episodes")
    done = relabel.relabel(
      trajs, labeller, seed=seed, keep_guesses=stage.keep_guesses, first_only=stage.first_only
    )
    stats = done.stats()
    stats["policy_episodes"] = len(trajs)
    stats["policy_em"] = sum(t.score or 0.0 for t in trajs) / max(len(trajs), 1)
    (root / "relabel.json").write_text(json.dumps(stats, indent=2) + "\n")
    write_trajectories(done.trajectories, fixed.with_suffix(".tmp"))
    fixed.with_suffix(".tmp").rename(fixed)
  all_fixed = [*corrections, str(fixed)]
  stage.sft.run(
    [*data_paths, *(p for p in all_fixed for _ in range(stage.repeat))], root / "sft",
    policy=PolicyConfig(model_dir=str(model_dir), tokenizer_dir=str(files.tokenizer), seed=seed),
    name=f"SynthWiki long-horizon warm start, expert relabelling {root.name}",
  )  # fmt: skip
  return root / "sft" / "model", fixed


def run_rounds(
  root: Path,
  model_dir: Path,
  *,
  sw: SynthWiki,
  files: WorldFiles,
  expert: ExpertConfig,
  stage: DaggerStage,
  data_paths: Sequence[str],
  agent: AsearcherAgentConfig,
  engine: EngineConfig,
  temperature: float,
  seed: int,
) -> Path:
  """`stage.rounds` rounds under root/dagger{r}; returns the last model (`model_dir` if none)."""
  corrections: list[str] = []
  for r in range(stage.rounds):
    model_dir, fixed = run_round(
      root / f"dagger{r}", model_dir, sw=sw, files=files, expert=expert, stage=stage,
      data_paths=data_paths, corrections=corrections, agent=agent, engine=engine,
      temperature=temperature, seed=seed + r,
    )  # fmt: skip
    corrections.append(str(fixed))
  return model_dir
