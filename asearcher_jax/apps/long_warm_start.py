"""The long-horizon warm start: its config (`LongWarmStart`), how it is made (the giving-up
expert, SFT, DAgger rounds), its model card and shipped copy. `long_horizon` (the pipeline)
imports this module, never the other way round.

`asearcher long-horizon` makes its warm start in the run (the giving-up expert, then SFT from
scratch: ~45 minutes on 2 cores), which alone would spend most of the experiment's 45-minute
budget. So the warm start is made once, evaluated on the held-out questions by hop count, and
shipped with a card that says how to make it again (command, seed, world digest, data hash, time,
scores); the experiment then starts from the shipped copy. The evaluation is stored under the
run's `eval/` with the name the pipeline gives the same weights, so the run that made the warm
start resumes from it instead of evaluating twice.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from asearcher_jax.agent import AsearcherAgentConfig
from asearcher_jax.apps import invocation, long_dagger
from asearcher_jax.apps import long_horizon_report as lh_report
from asearcher_jax.apps.quickstart import QuickstartEval, model_dir_id
from asearcher_jax.apps.warm_start import SFTStage, evaluate_model_dir, ship
from asearcher_jax.apps.world import WorldFiles, expert_trajectories, prepare_world
from asearcher_jax.errors import AsearcherError, ConfigValueError
from asearcher_jax.model.loading import PolicyConfig
from asearcher_jax.serving.engine import EngineConfig
from asearcher_jax.synthwiki import chain_breaks, copy_drills
from asearcher_jax.synthwiki.expert import ExpertConfig, read_trajectories, write_trajectories
from asearcher_jax.synthwiki.questions import SynthQuestion, chain_prefixes
from asearcher_jax.synthwiki.wiki import SynthWiki, SynthWikiConfig
from asearcher_jax.tokenizer import Tokenizer

# Where `asearcher long-horizon` loads its warm start from by default.
LONG_WARM_START = Path(__file__).resolve().parents[1] / "assets/checkpoints/synthwiki_long_sft"
# The command that makes a warm start from its recipe (`LongWarmStart.recipe`, a gin file).
COMMAND = "asearcher long-horizon --gin_file {recipe}"

_QUICKSTART_SFT = SFTStage()
_NO_DAGGER = long_dagger.DaggerStage()


@dataclasses.dataclass(frozen=True, kw_only=True)
class LongWarmStart:
  """The in-run warm start (with `warm_start_dir` None): SFT from scratch on the giving-up expert
  (train split), then its held-out evaluation and model card."""

  # Expert episodes per train question (each draws its own give-up point).
  samples_per_question: int = 2
  # The expert's other mistakes (`ExpertConfig.imperfect` level); 0: it only gives up.
  imperfection: float = 0.0
  # Hops after which the expert answers with a guess, uniform in [lo, hi] per episode; None: no
  # fixed give-up point.
  give_up_after_hops: tuple[int, int] | None = (2, 4)
  # Per act turn before the chain is resolved, answer with a guess (a geometric give-up point: a
  # k-hop chain is finished with probability about (1 - p_guess) ** k); 0: the imperfection's.
  p_guess: float = 0.0
  # Copy drills per expert trajectory (`synthwiki.copy_drills`: its first search turn with the
  # start renamed to any entity, so held-out starts are copy targets too); 0: none.
  copy_drills: int = 0
  # The expert opens each hop's page after finding it (`ExpertConfig.read_pages`); the agent
  # must show snippets (`doc_sentences`) for this to be a second tool call per hop.
  read_pages: bool = False
  # The expert's notes end with the chain's relations still to follow (`ExpertConfig.plan_notes`;
  # the agent needs `PAGES_PLAN_AGENT`'s longer turns).
  plan_notes: bool = False
  # Tool calls for one hop before the expert guesses (search, search by name, open the page).
  max_attempts: int = 3
  # The expert also plays the first h hops of each train chain, for each h here
  # (`questions.chain_prefix`), so that the warm start has seen short chains and an RL pool with
  # `SynthWikiRL.prefix_hops` gives it reward; () = the train chains only.
  prefix_hops: tuple[int, ...] = ()
  # Expert and SFT seed.
  seed: int = 0
  # Fine-tune this Hugging Face checkpoint (e.g. the shipped warm start, whose tokenizer is the
  # world's) instead of training from scratch; None: from scratch (`sft.scratch`).
  init_from: str | None = None
  # The SFT run (from-scratch preset, steps, batch, AdamW): the quickstart warm start's recipe.
  sft: SFTStage = _QUICKSTART_SFT
  # Rounds of expert relabelling of the SFT model's own episodes after it (`long_dagger`).
  dagger: long_dagger.DaggerStage = _NO_DAGGER
  # Copy the made warm start and its card here (the default warm start's directory:
  # asearcher_jax/assets/checkpoints/synthwiki_long_sft); None: keep it in the run directory.
  ship_to: str | None = None
  # Stop after the warm start's held-out evaluation and card (no RL).
  stop_after_card: bool = False
  # Stop as soon as the SFT has written its model, before the evaluation: for an accelerator
  # lease, whose SFT checkpoint is brought back and evaluated here by re-running without it.
  stop_after_sft: bool = False
  # The gin file that makes this warm start: the card's "Reproduce" command names it.
  recipe: str = "gin/experiments/long_horizon_warm_start.gin"

  def run(
    self,
    root: Path,
    *,
    world: SynthWikiConfig,
    agent: AsearcherAgentConfig,
    engine: EngineConfig,
    temperature: float,
    evaluation: QuickstartEval,
    long_hops: int,
  ) -> MadeWarmStart:
    """The warm-start stage of `asearcher long-horizon` in root/warm_start (resumable): the
    expert's trajectories, the SFT and its DAgger rounds (`make_warm_start`), then (unless
    `stop_after_sft`) its held-out evaluation by hop count and its card, shipped to `ship_to`."""
    model_dir, expert_stats, files = make_warm_start(
      root / "warm_start", world, self, agent, engine=engine, temperature=temperature
    )
    if self.stop_after_sft:
      stopped = {"warm_start_model": str(model_dir), "expert": expert_stats}
      return MadeWarmStart(model_dir=model_dir, expert_stats=expert_stats, stopped=stopped)
    card = evaluate_card(
      root, model_dir, files, world=world, warm=self, expert_stats=expert_stats,
      evaluation=evaluation, temperature=evaluation.eval_temperature(temperature), agent=agent,
      engine=engine, long_hops=long_hops,
    )  # fmt: skip
    dest = Path(self.ship_to) if self.ship_to else None
    write_and_ship(root / "warm_start", model_dir, card, dest)
    stopped = None
    if self.stop_after_card:
      keys = ("avg_em", "pass_em", "tool_calls", "long", "data_sha256", "world_digest")
      stopped = {k: card[k] for k in keys}
    return MadeWarmStart(model_dir=model_dir, expert_stats=expert_stats, stopped=stopped)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MadeWarmStart:
  """What the warm-start stage made."""

  # The model directory RL starts from.
  model_dir: Path
  # The expert's statistics (trajectories, mean reward, ...).
  expert_stats: dict[str, float]
  # Set when the pipeline stops here (`stop_after_sft`, `stop_after_card`): the JSON line it
  # prints.
  stopped: dict[str, Any] | None = None


def warm_start_expert(warm: LongWarmStart) -> ExpertConfig:
  """The giving-up expert `warm` describes: its imperfection level, then its give-up rules."""
  base = ExpertConfig.imperfect(warm.imperfection, seed=warm.seed)
  return dataclasses.replace(
    base,
    give_up_after_hops=tuple(warm.give_up_after_hops) if warm.give_up_after_hops else None,
    p_guess=warm.p_guess or base.p_guess,
    read_pages=warm.read_pages,
    max_attempts=warm.max_attempts,
    plan_notes=warm.plan_notes,
  )


def make_warm_start(
  root: Path,
  world: SynthWikiConfig,
  warm: LongWarmStart,
  agent: AsearcherAgentConfig,
  *,
  engine: EngineConfig,
  temperature: float = 1.0,
) -> tuple[Path, dict[str, float], WorldFiles]:
  """The giving-up expert's trajectories, an SFT on them, then `warm.dagger`'s rounds (all
  resumable); returns the model directory, the expert's statistics and the world's files."""
  sw, files = prepare_world(root.parent / "world", world)
  data = root / "expert_trajectories.jsonl"
  stats_path = root / "expert.json"
  questions = expert_questions(sw, warm.prefix_hops)
  if not stats_path.exists():
    stats = expert_trajectories(
      sw, files, data, questions=questions, expert=warm_start_expert(warm), agent_config=agent,
      seed=warm.seed, samples_per_question=warm.samples_per_question,
    )  # fmt: skip
    root.mkdir(parents=True, exist_ok=True)
    stats_path.write_text(json.dumps(stats) + "\n")
  paths = [str(data)]
  if warm.copy_drills:
    paths.append(str(write_copy_drills(root, sw, files, data, warm, questions)))
  warm.sft.run(
    paths, root / "sft",
    policy=PolicyConfig(
      model_dir=warm.init_from, tokenizer_dir=str(files.tokenizer), seed=warm.seed
    ),
    name="SynthWiki long-horizon warm start (asearcher long-horizon)",
  )  # fmt: skip
  model_dir = long_dagger.run_rounds(
    root, root / "sft" / "model", sw=sw, files=files, expert=warm_start_expert(warm),
    stage=warm.dagger, data_paths=paths, agent=agent, engine=engine, temperature=temperature,
    seed=warm.seed,
  )  # fmt: skip
  return model_dir, json.loads(stats_path.read_text()), files


def expert_questions(sw: SynthWiki, prefix_hops: tuple[int, ...]) -> list[SynthQuestion]:
  """The expert's questions: the train split, then the first h hops of its chains for each h in
  `prefix_hops` (those unique in the world)."""
  if any(h < 1 for h in prefix_hops):
    raise ConfigValueError(f"LongWarmStart.prefix_hops must be hop counts >= 1, got {prefix_hops}")
  prefixes = chain_prefixes(sw.world, sw.train, prefix_hops, sw.world.config.question_style)
  if prefix_hops and not prefixes:
    raise AsearcherError(f"LongWarmStart.prefix_hops={prefix_hops}: no train chain is longer")
  return sw.train + prefixes


def write_copy_drills(
  root: Path,
  sw: SynthWiki,
  files: WorldFiles,
  data: Path,
  warm: LongWarmStart,
  questions: list[SynthQuestion],
) -> Path:
  """root/copy_drills.jsonl from the expert's trajectories in `data` on `questions` (written
  once; resumable)."""
  path = root / "copy_drills.jsonl"
  if not path.exists():
    drills = copy_drills.copy_drills(
      read_trajectories(data), {q.id: q for q in questions}, sw.world,
      Tokenizer.from_dir(files.tokenizer), per_trajectory=warm.copy_drills, seed=warm.seed,
    )  # fmt: skip
    write_trajectories(drills, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)
  return path


def evaluate_card(
  root: Path,
  model_dir: Path,
  files: WorldFiles,
  *,
  world: SynthWikiConfig,
  warm: LongWarmStart,
  expert_stats: dict[str, float],
  evaluation: QuickstartEval,
  temperature: float,
  agent: AsearcherAgentConfig,
  engine: EngineConfig,
  long_hops: int,
) -> dict[str, Any]:
  """Held-out Avg@k by hop count of the warm start in `model_dir`, and everything its card says
  (`warm` is the run's `LongWarmStart`)."""
  t0 = time.time()
  scores = evaluate_model_dir(
    model_dir, files, root / "eval", evaluation=evaluation, temperature=temperature, agent=agent,
    engine=engine, policy_name=f"sft:{model_dir_id(model_dir)}", greedy=False,
  )  # fmt: skip
  questions = lh_report.heldout_questions(files.test)
  hops = {qid: q.hops for qid, q in questions.items()}
  rows = lh_report.eval_rows(root / "eval", "sft:")
  sft_summary = json.loads((model_dir.parent / "sft_summary.json").read_text())
  sampled = scores["sampled"]
  return {
    "command": invocation.command(COMMAND.format(recipe=warm.recipe)),
    "seed": warm.seed,
    "world": dataclasses.asdict(world),
    "world_digest": files.digest,
    "expert": {
      "give_up_after_hops": list(warm.give_up_after_hops) if warm.give_up_after_hops else None,
      "p_guess": warm.p_guess, "imperfection": warm.imperfection,
      "samples_per_question": warm.samples_per_question, "copy_drills": warm.copy_drills,
      "read_pages": warm.read_pages, "plan_notes": warm.plan_notes,
      "doc_sentences": agent.doc_sentences,
      "prefix_hops": list(warm.prefix_hops),
      **expert_stats,
    },
    "init_from": warm.init_from,
    "dagger": {
      "rounds": warm.dagger.rounds, "questions": warm.dagger.questions,
      "samples": warm.dagger.samples, "repeat": warm.dagger.repeat,
      "labeller_gives_up": warm.dagger.labeller_gives_up,
      "keep_guesses": warm.dagger.keep_guesses,
      "first_only": warm.dagger.first_only,
      "relabel": [
        json.loads(p.read_text())
        for p in sorted((root / "warm_start").glob("dagger*/relabel.json"))
      ],
    },
    "data_sha256": sft_summary["data"]["data_sha256"],
    "data_files": {Path(f).name: h for f, h in sft_summary["data"]["files"].items()},
    "sft_steps": sft_summary["step"],
    "sft_start_step": sft_summary["start_step"],
    "sft_train_seconds": sft_summary["train_seconds"],
    "avg_em": sampled["avg_em"], "pass_em": sampled["pass_em"], "k": sampled["k"],
    "tool_calls": sampled["tool_calls"], "questions": sampled["n"], "temperature": temperature,
    "long_hops": long_hops,
    "long": lh_report.long_stats(
      rows, hops, long_hops,
      needed=lh_report.calls_needed(questions, files.corpus, agent.doc_sentences),
    ),
    "by_hops": lh_report.by_hops(rows, hops),
    "chain_breaks": lh_report.breaks_of(root / "eval", "sft:", questions),
    "eval_seconds": round(time.time() - t0, 1),
    "sft_summary": sft_summary,
  }  # fmt: skip


def _pct(x: float) -> str:
  return f"{100 * x:.1f}%"


def _hop_range(world: dict[str, Any]) -> str:
  """The chain lengths of a world config (as a dict), e.g. "4-12", for the card's text."""
  per_hop = [*world["questions_per_hop"], *world.get("appended_questions_per_hop", ())]
  hops = [h for h, n in enumerate(per_hop, start=1) if n]
  return f"{min(hops)}-{max(hops)}" if hops else "no"


def _give_up(expert: dict[str, Any]) -> str:
  """How the card's expert gives up, in words."""
  parts = []
  if expert.get("give_up_after_hops"):
    lo, hi = expert["give_up_after_hops"]
    parts.append(f"gives up after {lo}-{hi} hops")
  if expert.get("p_guess"):
    turn = "act" if expert.get("read_pages") else "search"
    parts.append(f"gives up at each {turn} turn with probability {expert['p_guess']}")
  return " or ".join(parts) or "sometimes gives up"


def card_markdown(card: dict[str, Any], sft_card: str) -> str:
  """The model card: what the checkpoint is for, how to make it again, and its held-out scores."""
  e, lg = card["expert"], card["long"]
  resumed = (
    f" (this copy's run resumed at step {card['sft_start_step']}; the time is of the steps after it)"
    if card["sft_start_step"]
    else ""
  )
  lines = [
    "# SynthWiki long-horizon warm start", "",
    "A tiny Qwen2-architecture policy trained "
    + (f"from `{card['init_from']}`" if card.get("init_from") else "from scratch")
    + " by supervised fine-tuning on a scripted expert that searches correctly, "
    + lh_report.per_hop_words(e.get("doc_sentences", int(bool(e.get("read_pages")))))
    + f", but {_give_up(e)} and answers with a guess; "
    "the starting point of `asearcher long-horizon`, whose RL should teach it to keep searching.",
    "", "## Reproduce", "", "```", card["command"], "```", "",
    f"World: SynthWiki seed {card['world']['seed']} ({_hop_range(card['world'])}-hop chains, "
    "hops isolated), digest "
    f"`{card['world_digest']}`. Expert: seed {card['seed']}, {e['samples_per_question']} episodes "
    "per train question"
    + (f" and per chain prefix of {', '.join(map(str, e['prefix_hops']))} hops"
       if e.get("prefix_hops") else "")
    + f" ({int(e['trajectories'])} trajectories, mean reward "
    f"{e['expert_mean_reward']:.3f})"
    + (f", plus {e['copy_drills']} copy drills per trajectory (its first search turn with the "
       "start renamed to any entity)" if e.get("copy_drills") else "")
    + (f", then {card['dagger']['rounds']} round(s) of expert relabelling of its own episodes "
       f"({card['dagger']['questions']} train questions x {card['dagger']['samples']} a round; "
       + ("labelled by an expert that plays every chain to its end; "
          if not card["dagger"].get("labeller_gives_up", True) else "")
       + ("its early answers left uncorrected; " if card["dagger"].get("keep_guesses") else "")
       + ("only each episode's first correction kept; "
          if card["dagger"].get("first_only") else "")
       + "policy-expert agreement per round, act / read turns: "
       + "; ".join(f"{r['act']['agreement']:.2f} / {r['read']['agreement']:.2f}"
                   for r in card["dagger"]["relabel"]) + ")"
       if card.get("dagger", {}).get("rounds") else "")
    + ". Data: "
    + ", ".join(f"`{name}` sha256 `{h}`" for name, h in card["data_files"].items()) + ".", "",
    f"SFT: {card['sft_steps']} steps, {card['sft_train_seconds']:.0f} s of training{resumed}; "
    f"held-out evaluation {card['eval_seconds']:.0f} s (2 CPU cores).", "",
    "## Held-out scores (test split, questions never seen in training)", "",
    f"| | Avg@{card['k']} EM | Pass@{card['k']} EM | tool calls / trajectory | questions |",
    "|---|---|---|---|---|",
    f"| all | {_pct(card['avg_em'])} | {_pct(card['pass_em'])} | {card['tool_calls']:.2f} | "
    f"{card['questions']} |",
    f"| >= {card['long_hops']} hops | {_pct(lg['avg_em'])} | | {lg['tool_calls']:.2f} | "
    f"{lg['questions']} |",
    "", f"Temperature {card['temperature']}. By hop count (Avg EM, tool calls):", "",
    "| hops | Avg EM | tool calls | samples |", "|---|---|---|---|",
    *(f"| {h} | {_pct(d['avg_em'])} | {d['tool_calls']:.1f} | {d['samples']} |"
      for h, d in card["by_hops"].items()),
    "", "Where the chains broke (share of episodes; hops counted from 0):", "",
    *(f"- {kind}: {lh_report.break_cell(card['chain_breaks'], kind)}"
      for kind in chain_breaks.KINDS if "chain_breaks" in card),
    "", "---", "", sft_card,
  ]  # fmt: skip
  return "\n".join(lines)


def write_and_ship(out: Path, model_dir: Path, card: dict[str, Any], dest: Path | None) -> None:
  """Writes out/{model_card.md, warm_start.json}; with `dest`, copies the model and card there."""
  sft_card = model_dir.parent / "model_card.md"
  text = card_markdown(card, sft_card.read_text() if sft_card.exists() else "")
  (out / "model_card.md").write_text(text)
  (out / "warm_start.json").write_text(json.dumps(card, indent=2, default=str) + "\n")
  if dest is not None:
    ship(model_dir, out, dest)
