"""`asearcher long-horizon`: does asynchronous RL teach the agent to search more than ten times?

SynthWiki chains of 4 to 12 hops (named, injected and fuzzed starts) where every hop needs its own
search (`synthwiki.questions.hop_leaks`), and a warm start cloned from a scripted expert whose one
weakness is the one ASearcher's RL fixes: it searches correctly but gives up after a few hops and
answers with a guess. Stages:

  warm_start  by default the shipped one (`long_warm_start.LONG_WARM_START`); with
              `warm_start_dir` None: the world, the giving-up expert's token-exact trajectories
              on the train split, `asearcher sft` from scratch on them under run_dir/warm_start
              (resumes from its checkpoints), its held-out evaluation by hop count and a model
              card (`LongWarmStart.run`), copied to `LongWarmStart.ship_to` when set;
  quickstart  the quickstart's stages unchanged (`quickstart.rl_stages`: world, load, eval_sft,
              rl, eval_rl, report) with this world and RL run (`rl`, a TrainConfig: its agent's
              budgets fit >= 30 tool calls, search results compacted after their read turn);
  report      `long_horizon_report`: accuracy and tool calls by hop count before and after RL,
              the per-step distribution of tool calls per training trajectory, per-length-bucket
              staleness and acceptance, turn/token-limit hits, the issue's bars; summary.json.

Re-running with the same run directory resumes every stage.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from asearcher_jax import metric_writer
from asearcher_jax.agent import AsearcherAgentConfig
from asearcher_jax.apps import invocation, long_warm_start
from asearcher_jax.apps import long_horizon_report as lh_report
from asearcher_jax.apps import quickstart as qs
from asearcher_jax.apps.long_warm_start import LongWarmStart
from asearcher_jax.apps.train_config import AgentChoice, TrainConfig
from asearcher_jax.errors import AsearcherError
from asearcher_jax.serving.engine import EngineConfig
from asearcher_jax.synthwiki.wiki import SynthWikiConfig

# 150 chain questions per hop count from 4 to 12 (~1,350, ~20 % test), shuffled so that the first
# evaluated test questions mix every length; hops isolated (each needs its own search).
LONG_WORLD = SynthWikiConfig(
  seed=0, questions_per_hop=(0, 0, 0) + (150,) * 9, num_comparisons=0, isolate_hops=True,
  shuffle=True,
)  # fmt: skip
# The same world with chains of up to 16 hops (150 per hop count from 13 to 16 besides), for
# `long_horizon_16.gin`: one search a hop, so the >= 6-hop held-out questions need ~11 tool calls
# (4-12 hops: 8.5). Its corpus, splits, 4-12-hop questions and tokenizer (trained on those) are
# LONG_WORLD's, so the shipped warm start speaks it.
LONGER_WORLD = dataclasses.replace(
  LONG_WORLD, questions_per_hop=(0, 0, 0) + (150,) * 13, tokenizer_max_hops=12
)
# LONGER_WORLD with 24 chain questions per hop count from 17 to 32 appended after its own, for
# `long_horizon_32.gin`: chains longer than 30 hops in the RL pool (one search a hop), while the
# held-out questions, their order and the tokenizer stay LONGER_WORLD's.
LONGEST_WORLD = dataclasses.replace(LONGER_WORLD, appended_questions_per_hop=(24,) * 16)
# 72 LLM turns (a tool call takes an act and a read turn: 30 tool calls are 61 turns), 3,072
# tokens: with results compacted to their URLs after the read turn, a hop costs ~62 tokens
# (measured on the perfect expert: 12 hops in <= 982 tokens; 30 tool calls ~2,100). Not 4,096:
# the learner's attention cost grows with the row length (2026-11-25, 2 cores: 16k token cells
# in 4,096-token rows took 3.8x the time of 1,024-token rows, peak RSS 4.5 GB at 2 rows a pass).
LONG_AGENT = AsearcherAgentConfig(
  prompt="synthwiki", topk=3, max_turns=72, max_tokens=3072, max_new_tokens=64,
  compact_search_results=True,
)  # fmt: skip
# Context a long episode needs: the prompt and question, then ~62 tokens per tool call (the query,
# the compacted results, the read turn's note), rounded up.
PROMPT_TOKENS = 256
TOKENS_PER_TOOL_CALL = 64
# The page-reading variant (`long_horizon_pages.gin`): search results are snippets (a page's title
# and first sentence), so every hop is a search and then an `access` of the page that states its
# fact, ASearcher's web agent's two calls. Results are kept in full (a snippet is ~25 tokens), and
# pages are compacted after their read turn, so a training sequence starts once per hop as before;
# a hop costs ~125 tokens, 15 hops (30 tool calls) ~2,100.
PAGES_AGENT = dataclasses.replace(
  LONG_AGENT, doc_sentences=1, compact_search_results=False, stub_chars=0
)


# The snippet variant (`long_horizon_snippets.gin`): search results show a page's title and its
# first three sentences (its intro and first two facts), as a web search's snippet shows the top of
# a page, so a hop whose fact is further down is a search and then an `access` of the page, and
# one near the top is a search alone: 12.1 tool calls on the >= 6-hop held-out questions (the
# one-search world 8.5, the page world 17.0), each hop still its own search.
SNIPPETS_AGENT = dataclasses.replace(PAGES_AGENT, doc_sentences=3)


# The page agent for an expert with `plan_notes`: its first turn lists up to 12 relations (~3
# tokens each) before its search, which 64 new tokens do not always hold.
PAGES_PLAN_AGENT = dataclasses.replace(PAGES_AGENT, max_new_tokens=96)


def long_agent() -> AsearcherAgentConfig:
  """`LONG_AGENT`, for gin."""
  return LONG_AGENT


def longer_world() -> SynthWikiConfig:
  """`LONGER_WORLD`, for gin."""
  return LONGER_WORLD


def longest_world() -> SynthWikiConfig:
  """`LONGEST_WORLD`, for gin."""
  return LONGEST_WORLD


def pages_agent() -> AsearcherAgentConfig:
  """`PAGES_AGENT`, for gin (which binds what a callable returns, not module constants)."""
  return PAGES_AGENT


def snippets_agent() -> AsearcherAgentConfig:
  """`SNIPPETS_AGENT`, for gin."""
  return SNIPPETS_AGENT


def pages_plan_agent() -> AsearcherAgentConfig:
  """`PAGES_PLAN_AGENT`, for gin."""
  return PAGES_PLAN_AGENT


LONG_ENGINE = EngineConfig(
  max_slots=32, max_seq_len=3072, prefill_buckets=(512, 1024, 2048, 3072), suffix_buckets=(256,)
)


# The RL run's defaults: the quickstart's with this engine and agent (rows of up to 3,072
# tokens), two rows per learner pass and 1,024- or 2,048-token rows for minibatches that fit them
# (4,096-token rows: 4.5 GB peak at two a pass, 7.9 GB at four); gin/experiments/long_horizon.gin
# binds the same values part by part.
LONG_RL = dataclasses.replace(
  qs.QUICKSTART_RL,
  engine=LONG_ENGINE,
  agent=AgentChoice(name="asearcher", configs={"asearcher": LONG_AGENT}),
  learner=dataclasses.replace(
    qs.QUICKSTART_RL.learner,
    ppo=dataclasses.replace(
      qs.QUICKSTART_RL.ppo(), row_len=LONG_ENGINE.max_seq_len, short_row_lens=(1024, 2048),
      micro_rows=2,
    ),
  ),
)  # fmt: skip
# RL draws the warm start's own (train) questions: its expert never answered the long ones right.
TRAIN_POOL = qs.SynthWikiRL(questions="train")

# The in-run warm start's defaults (used with `warm_start_dir` None).
IN_RUN_WARM_START = LongWarmStart()


def long_horizon(
  *,
  run_dir: str = "runs/long_horizon",
  warm_start_dir: str | None = str(long_warm_start.LONG_WARM_START),
  world: SynthWikiConfig = LONG_WORLD,
  warm: LongWarmStart = IN_RUN_WARM_START,
  evaluation: qs.QuickstartEval = qs.DEFAULT_EVAL,
  rl: TrainConfig = LONG_RL,
  pool: qs.SynthWikiRL = TRAIN_POOL,
  long_hops: int = 6,
  min_tool_calls: int = 30,
) -> int:
  """Runs the long-horizon experiment; prints its JSON summary as the last line.

  Args:
    run_dir: everything this run writes (warm_start/, then the quickstart's layout).
    warm_start_dir: a warm start for `world` (default: the shipped one); None: made in the run
      (`warm`), evaluated and given a card (run_dir/warm_start/model_card.md).
    world: the SynthWiki world (long, hop-isolated chains).
    warm: the in-run warm start (expert's give-up range, SFT recipe).
    evaluation: the held-out evaluation (of the warm start's card, and before and after RL).
    rl: the RL run, as `asearcher train` configures one; its agent's budgets (must fit
      `min_tool_calls`), engine and sampling temperature are also the warm start's and the
      evaluations' (unless `evaluation` names its own temperature).
    pool: where RL draws its questions, and the reward's per-hop credit.
    long_hops: questions of at least this many hops are the "long" ones of the summary.
    min_tool_calls: tool calls the agent's turn and token limits must allow in one episode.
  """
  t0 = time.time()
  agent, engine, temperature = qs.synthwiki_agent(rl), rl.engine, rl.temperature
  turns = 2 * min_tool_calls + 1  # an act and a read turn per tool call, then the answer
  tokens = PROMPT_TOKENS + TOKENS_PER_TOOL_CALL * min_tool_calls
  if agent.max_turns < turns or not tokens <= agent.max_tokens <= engine.max_seq_len:
    raise AsearcherError(
      f"long_horizon: {min_tool_calls} tool calls need the agent's max_turns >= {turns} (got "
      f"{agent.max_turns}) and max_tokens >= {tokens} (got {agent.max_tokens}), within "
      f"the engine's max_seq_len {engine.max_seq_len}"
    )
  root = Path(run_dir)
  expert_stats = None
  if warm_start_dir is None and warm.read_pages != (agent.doc_sentences > 0):
    raise AsearcherError(
      f"long_horizon.warm.read_pages is {warm.read_pages} but agent.doc_sentences is "
      f"{agent.doc_sentences}: an expert opens pages exactly when search shows snippets"
    )
  if warm_start_dir is None:
    made = warm.run(
      root, world=world, agent=agent, engine=engine, temperature=temperature,
      evaluation=evaluation, long_hops=long_hops,
    )  # fmt: skip
    if made.stopped is not None:
      print(json.dumps(made.stopped), flush=True)
      return 0
    warm_start_dir, expert_stats = str(made.model_dir), made.expert_stats
  stages = qs.rl_stages(world=world, evaluation=evaluation, rl=rl, pool=pool)
  qs.print_summary(root, qs.run_stages(root, qs.warm_start_path(warm_start_dir), stages))
  summary = lh_report.build(root, long_hops=long_hops, doc_sentences=agent.doc_sentences)
  summary.update(
    command=invocation.command("asearcher long-horizon (called from Python)"),
    warm_start_dir=warm_start_dir, warm_start_expert=expert_stats,
    agent_max_turns=agent.max_turns, agent_max_tokens=agent.max_tokens,
    min_tool_calls_allowed=min_tool_calls,
    wall_s=round(time.time() - t0, 1),
    peak_rss_mb=metric_writer.peak_rss_mb(),
  )  # fmt: skip
  summary["bars"] = lh_report.bars(summary)
  lh_report.write(root / "report", summary)
  print(json.dumps(summary), flush=True)
  return 0
