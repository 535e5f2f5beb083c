"""The long-horizon warm start's model card and shipped copy.

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
from typing import TYPE_CHECKING, Any

from asearcher_jax.agent import AsearcherAgentConfig
from asearcher_jax.apps import invocation
from asearcher_jax.apps import long_horizon_report as lh_report
from asearcher_jax.apps.quickstart import QuickstartEval, model_dir_id
from asearcher_jax.apps.warm_start import evaluate_model_dir, ship
from asearcher_jax.apps.world import WorldFiles
from asearcher_jax.serving.engine import EngineConfig
from asearcher_jax.synthwiki import chain_breaks
from asearcher_jax.synthwiki.wiki import SynthWikiConfig

if TYPE_CHECKING:  # long_horizon imports this module
  from asearcher_jax.apps.long_horizon import LongWarmStart

# Where `asearcher long-horizon` loads its warm start from by default.
LONG_WARM_START = Path(__file__).resolve().parents[1] / "assets/checkpoints/synthwiki_long_sft"
# The command that makes a warm start from its recipe (`LongWarmStart.recipe`, a gin file).
COMMAND = "asearcher long-horizon --gin_file {recipe}"


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
