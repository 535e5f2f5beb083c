"""`asearcher quickstart`: the whole system on one machine, offline, in minutes, visibly learning.

Stages (a progress display shows which one runs and the ETA):

  world     generate SynthWiki (the seed of the shipped warm start; its held-out questions were
            never seen by it), the world tokenizer and the BM25 index; start the real retrieval
            server on 127.0.0.1;
  load      the shipped SFT warm start into the in-process engine; build the RL run (driver,
            decoupled-PPO learner, staleness manager, replay queue, rollout controller);
  eval_sft  Avg@k / Pass@k of the warm start on held-out questions (the real evaluation harness);
  rl        fully asynchronous RL (eta = 4) on the train split for a fixed time budget;
  eval_rl   the same evaluation with the RL policy;
  report    summary.json, report.md, PNG training curves; TensorBoard logs and checkpoints stay in
            the run directory.

Re-running with the same run directory resumes: finished evaluation questions are reused and RL
continues from its last checkpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asearcher_jax import metric_writer
from asearcher_jax.agent import AsearcherAgentConfig, Limits
from asearcher_jax.agent.registry import agent_factory
from asearcher_jax.agent.trajectory import Trajectory
from asearcher_jax.apps import invocation, wiring
from asearcher_jax.apps import quickstart_report as report
from asearcher_jax.apps import train as rl_commands
from asearcher_jax.apps.stages import StageTracker
from asearcher_jax.apps.train_config import AgentChoice, LearnerConfig, TrainConfig
from asearcher_jax.apps.world import RetrievalThread, WorldFiles, prepare_world
from asearcher_jax.data.qa import QAExample, load_qa_file, load_training_qa
from asearcher_jax.errors import AsearcherError, ConfigValueError
from asearcher_jax.evaluation import report as eval_report
from asearcher_jax.evaluation.runner import EvalRunner, RunnerConfig
from asearcher_jax.model import steps
from asearcher_jax.rl.learner import PPOConfig
from asearcher_jax.rl.rollout import RolloutConfig
from asearcher_jax.rl.scoring import Scorer, progress_scorer
from asearcher_jax.rl.staleness import StalenessConfig
from asearcher_jax.serving.driver import DriverConfig
from asearcher_jax.serving.engine import EngineConfig
from asearcher_jax.serving.types import SamplingParams
from asearcher_jax.synthwiki import chain_breaks
from asearcher_jax.synthwiki.questions import SynthQuestion, chain_prefixes, write_questions
from asearcher_jax.synthwiki.wiki import SynthWiki, SynthWikiConfig
from asearcher_jax.tools.search import LocalRetrievalConfig
from asearcher_jax.tools.toolbox import make_toolbox

log = logging.getLogger(__name__)

_ASSETS = Path(__file__).resolve().parents[1] / "assets"
# The shipped warm start (see its model_card.md for the command that made it).
DEFAULT_WARM_START = _ASSETS / "checkpoints" / "synthwiki_sft"
# The agent's budgets in the quickstart: the compact SynthWiki prompt, 3 documents per search.
QUICKSTART_AGENT = AsearcherAgentConfig(
  prompt="synthwiki", topk=3, max_turns=16, max_tokens=2048, max_new_tokens=64
)
# The world of the shipped warm start: seed 0, 256 entities, ~3,200 verified questions (many
# distinct questions, so SFT learns to copy entity names instead of memorising answers).
QUICKSTART_WORLD = SynthWikiConfig(
  seed=0, questions_per_hop=(1000, 1000, 600, 300), num_comparisons=300
)
# Slots for the 96 episodes the RL stage keeps in flight (12 groups x 8): with 32, parked slots were
# evicted before their next turn and 3 of 4 turns prefilled their whole context; with 64, 75 RL
# steps in the budget instead of 63 (decode rows up to 32, so a step with 17-32 live slots does
# not compute all 64). Suffix buckets: half of the turns continue the last call with nothing new,
# the rest add a tool result of ~170-200 tokens; a suffix costs its bucket (2026-11-26,
# docs/measurements.md). Before that day: 32 slots, decode rows (8, 16), suffix buckets (256,).
QUICKSTART_ENGINE = EngineConfig(
  max_slots=64,
  max_seq_len=2048,
  prefill_buckets=(256, 512, 1024, 2048),
  suffix_buckets=(16, 256),
  decode_rows=(8, 16, 32),
)
# Rows a learner minibatch may be packed into (each bucket one compiled shape, compiled when first
# used). Up to 512: a long-horizon batch of 16 episodes needs one training sequence per compaction
# (78 rows on 2026-11-26, the crash that added 96-256); with pages, a sequence per page opened.
LEARNER_ROW_BUCKETS = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def _sha256(path: Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()


def check_tokenizer(world: WorldFiles, warm_start: Path) -> None:
  """The warm start must speak the world's tokenizer (same seed and world config)."""
  mine, theirs = world.tokenizer / "tokenizer.json", warm_start / "tokenizer.json"
  if not theirs.exists():
    raise AsearcherError(f"no tokenizer.json in the warm start {warm_start}")
  if _sha256(mine) != _sha256(theirs):
    raise AsearcherError(
      f"the warm start {warm_start} was trained on a different SynthWiki world (tokenizer "
      "differs): use the world seed and config from its model_card.md"
    )


def evaluate(
  *,
  client: Any,
  tokenizer: Any,
  questions: Path,
  retrieval_address: str,
  out_dir: Path,
  policy: str,
  k: int,
  limit: int | None,
  temperature: float,
  agent: AsearcherAgentConfig,
  concurrency: int,
  seed: int,
) -> dict[str, float]:
  """Avg@k / Pass@k (EM and F1), mean tool calls and turns of `client` on held-out questions,
  through the real evaluation harness (snapshots per question: a rerun resumes)."""
  examples = load_qa_file(questions, name="synthwiki_test")[:limit]

  async def go() -> Path:
    toolbox = make_toolbox(
      local=LocalRetrievalConfig(addresses=(retrieval_address,)), config=agent.toolbox_config()
    )
    try:
      runner = EvalRunner(
        config=RunnerConfig(
          output_dir=str(out_dir), num_runs=k, seed=seed, concurrency=concurrency, progress=False
        ),
        agent_factory=agent_factory(
          "asearcher", agent, client=client, tokenizer=tokenizer, toolbox=toolbox,
          limits=Limits(llm_timeout_s=600.0, tool_timeout_s=60.0),
        ),
        identity={"agent": "asearcher", "agent_config": dataclasses.asdict(agent),
                  "policy": policy},
        sampling=SamplingParams(temperature=temperature),
        toolbox=toolbox,
      )  # fmt: skip
      await runner.run({"synthwiki_test": examples})
      return runner.run_dir
    finally:
      await asyncio.wait_for(toolbox.close(), 30)

  run_dir = asyncio.run(go())
  summary = eval_report.write_report(run_dir)
  ds = summary["datasets"]["synthwiki_test"]
  return {
    "avg_em": ds["avg@k"]["em"],
    "pass_em": ds["pass@k"]["em"],
    "avg_f1": ds["avg@k"]["f1"],
    "pass_f1": ds["pass@k"]["f1"],
    "tool_calls": ds["mean_tool_calls"],
    "turns": ds["mean_turns"],
    "n": ds["n"],
    "k": ds["k"],
    "run_dir": str(run_dir),
  }


def rl_pool(
  files: WorldFiles,
  which: str,
  eval_questions: int | None,
  kinds: tuple[str, ...] | None = None,
  *,
  prefix_hops: tuple[int, ...] = (),
  sw: SynthWiki | None = None,
) -> list[QAExample]:
  """The RL question pool (see `QuickstartRL.questions`): "train", or "heldout" = the test
  split after its first eval_questions (the evaluated ones), disjoint from both the warm start's
  training questions and the evaluation; with `prefix_hops`, also the first h hops of each
  pooled chain (`QuickstartRL.prefix_hops`; needs the world `sw`); only questions of `kinds`
  (QAExample.bucket) if given."""
  if which == "train":
    items = load_training_qa(files.train)
  elif which == "heldout":
    items = load_training_qa(files.test)[eval_questions:] if eval_questions is not None else []
    if not items:
      raise AsearcherError(
        "QuickstartRL.questions='heldout' needs test questions beyond the evaluated ones: set "
        "QuickstartEval.questions below the test split's size, or QuickstartRL.questions='train'"
      )
  else:
    raise ConfigValueError(f"QuickstartRL.questions must be 'heldout' or 'train', got {which!r}")
  if prefix_hops:
    if sw is None:
      raise AsearcherError("rl_pool: prefix_hops needs the world (sw)")
    items = items + prefix_pool(sw, items, prefix_hops, files.root / f"rl_prefixes_{which}.jsonl")
  if kinds is not None:
    found = sorted({it.bucket for it in items})
    items = [it for it in items if it.bucket in kinds]
    if not items:
      raise AsearcherError(f"no RL question of kinds {kinds}; the pool has {found}")
  return items


def prefix_pool(
  sw: SynthWiki, items: list[QAExample], hops: tuple[int, ...], path: Path
) -> list[QAExample]:
  """The first h hops of every chain among `items`, for each h in `hops` (longer chains only,
  each checked unique), written to `path` (QA jsonl) and read back as RL questions."""
  if any(h < 1 for h in hops):
    raise ConfigValueError(f"QuickstartRL.prefix_hops must be hop counts >= 1, got {hops}")
  ids = {it.id for it in items}
  pooled = [q for q in sw.questions if q.id in ids]
  made = chain_prefixes(sw.world, pooled, hops, sw.world.config.question_style)
  if not made:
    raise AsearcherError(f"QuickstartRL.prefix_hops={hops}: no pooled chain is longer than that")
  write_questions(made, path)
  return load_training_qa(path)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuickstartEval:
  """The held-out evaluation before and after RL."""

  # Held-out test questions evaluated (the first N of the test split).
  questions: int | None = 64
  # Samples per question (Avg@k, Pass@k).
  k: int = 4
  # Questions evaluated at once.
  concurrency: int = 32
  # Evaluation seed (runs use seed + r); also the RL rollout's seed.
  seed: int = 0
  # Sampling temperature of the held-out evaluations; None: the RL temperature (the quickstart
  # measures the policy RL samples). ASearcher trains at 1.0 and reports Avg@4 at 0.6.
  temperature: float | None = None
  # Compile every engine shape before the first evaluation, so that its times are serving times;
  # False compiles each shape on first use (CI-size runs, which use few of them).
  engine_warmup: bool = True

  def __post_init__(self) -> None:
    # Checked when the config is built, not when the first evaluation starts (the long-horizon
    # run evaluates only after its warm start).
    if self.temperature is not None and not self.temperature >= 0:
      raise ConfigValueError(f"QuickstartEval.temperature must be >= 0 (got {self.temperature})")

  def eval_temperature(self, rl_temperature: float) -> float:
    """The temperature the evaluations sample at, given the run's RL temperature."""
    return rl_temperature if self.temperature is None else self.temperature


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuickstartRL:
  """The asynchronous RL stage (figures behind the defaults: docs/measurements.md)."""

  # Wall-clock budget (steps end at the first one past it).
  seconds: float = 420.0
  # Upper bound on RL steps.
  max_steps: int = 1000
  # B, groups per step.
  batch_groups: int = 2
  # n, episodes per group.
  group_size: int = 8
  # eta, the staleness bound.
  max_staleness: int = 4
  # Groups in flight at once.
  max_concurrent: int = 12
  # AdamW learning rate of the learner.
  learning_rate: float = 1e-4
  # Optimizer steps per pass over an RL batch (split into minibatches).
  ppo_minibatches: int = 1
  # Passes over each RL batch (all clipped around the pre-step policy).
  ppo_epochs: int = 1
  # Draw questions through the learnability curriculum (`rl.cursors`): kinds whose recent groups
  # were all-equal are sampled less.
  curriculum: bool = False
  # Where RL draws its questions: "heldout" (the test split minus the evaluated questions: seen
  # by neither the warm start nor the evaluation) or "train" (the warm start's SFT questions,
  # where reward partly comes from recalling memorised answers).
  questions: str = "heldout"
  # Only questions of these kinds ("chain-1" .. "chain-4", "comparison-2"); None = all.
  kinds: tuple[str, ...] | None = None
  # Also draw the first h hops of each pooled chain as a question, for each h here (e.g. (1, 2,
  # 3)): shorter chains through the same pages, so a policy that cannot yet finish the long ones
  # still meets groups of mixed reward; () = the pool as is.
  prefix_hops: tuple[int, ...] = ()
  # In-flight keys/values on a weight update (`DriverConfig.kv_on_update`): "recompute" | "keep".
  kv_on_update: str = "recompute"
  # Re-prefill in-flight slots grouped by bucket on a weight update (`DriverConfig.batch_reprefill`);
  # False is one call per slot, the engine's setting before 2026-11-26 (for side-by-side runs).
  batch_reprefill: bool = True
  # Fail the stage if no batch of accepted groups arrives within this long.
  batch_timeout_s: float = 900.0
  # The RL reward (`TrainConfig.reward`): "answer" (the ASearcher F1 reward) or "smoke" (the
  # even-token fraction: a signal for an untrained policy, for plumbing tests only).
  reward: str = "answer"
  # Rows per learner forward/backward pass (`PPOConfig.micro_rows`): memory against step time.
  micro_rows: int = 4
  # Shorter learner rows a minibatch packs into when its longest sequence fits
  # (`PPOConfig.short_row_lens`); None: half the engine's context.
  short_row_lens: tuple[int, ...] | None = None
  # Weight of per-hop credit in the RL reward (`rl.scoring.progress_scorer`): (1 - w) x the answer
  # reward + w x the fraction of a chain's hops searched right before its first wrong search
  # (`synthwiki.chain_breaks.hops_searched`). 0: the ASearcher reward alone.
  hop_credit: float = 0.0

  def __post_init__(self) -> None:
    if not 0 <= self.hop_credit < 1:
      raise ConfigValueError(f"QuickstartRL.hop_credit must be in [0, 1) (got {self.hop_credit})")
    if self.hop_credit and self.prefix_hops:
      raise ConfigValueError(
        "QuickstartRL.hop_credit does not credit prefix_hops questions: use one"
      )


def quickstart(
  *,
  run_dir: str = "runs/quickstart",
  warm_start_dir: str | None = None,
  world: SynthWikiConfig = QUICKSTART_WORLD,
  temperature: float = 1.0,
  evaluation: QuickstartEval = QuickstartEval(),
  rl: QuickstartRL = QuickstartRL(),
  agent: AsearcherAgentConfig = QUICKSTART_AGENT,
  engine: EngineConfig = QUICKSTART_ENGINE,
) -> int:
  """Runs the quickstart; prints the before/after table and a JSON summary as the last line.

  Args:
    run_dir: everything this run writes (world, evaluations, RL checkpoints/metrics, report).
    warm_start_dir: an SFT model directory (config.json, safetensors, tokenizer); default: the
      shipped SynthWiki warm start.
    world: the SynthWiki world; must be the warm start's (checked through its tokenizer).
    temperature: sampling temperature of RL, and of the evaluation unless it names its own.
    evaluation: the held-out evaluation (questions, k, concurrency, seed, temperature).
    rl: the RL stage (time budget, B, n, eta, learner, question pool).
    agent / engine: the agent's budgets and the in-process engine's slots and context.
  """
  ev = evaluation
  eval_temperature = ev.eval_temperature(temperature)
  t0 = time.time()
  root = Path(run_dir)
  warm = Path(warm_start_dir) if warm_start_dir else DEFAULT_WARM_START
  if not (warm / "config.json").exists():
    raise AsearcherError(f"no warm start at {warm} (config.json missing)")
  tracker = StageTracker([
    ("world", 3), ("load", 20), ("eval_sft", 90), ("rl", rl.seconds + 30), ("eval_rl", 90),
    ("report", 3),
  ])  # fmt: skip
  with tracker.stage("world"):
    sw, files = prepare_world(root / "world", world)
    check_tokenizer(files, warm)
    rl_items = rl_pool(
      files, rl.questions, ev.questions, rl.kinds, prefix_hops=tuple(rl.prefix_hops), sw=sw
    )
  addr_dir = root / "rl" / "retrieval_addrs"
  with RetrievalThread(files.index, addr_dir=addr_dir) as server:
    with tracker.stage("load"):
      config = TrainConfig(
        train_steps=rl.max_steps, batch_timeout_s=rl.batch_timeout_s, reward=rl.reward,
        temperature=temperature, seed=ev.seed,
        staleness=StalenessConfig(
          batch_groups=rl.batch_groups, max_staleness=rl.max_staleness, max_concurrent=rl.max_concurrent
        ),
        engine=engine,
        driver=DriverConfig(
          request_timeout_s=600.0, kv_on_update=rl.kv_on_update, batch_reprefill=rl.batch_reprefill
        ),
        agent=AgentChoice(name="asearcher", configs={"asearcher": agent}),
        tools=wiring.ToolsConfig(local=LocalRetrievalConfig(addresses=(server.address,))),
        rollout=RolloutConfig(
          group_size=rl.group_size, episode_timeout_s=600.0, seed=ev.seed, curriculum=rl.curriculum
        ),
        learner=LearnerConfig(
          # micro_rows=4: a minibatch of 8 rows of 2,048 tokens needed ~5 GB of XLA:CPU
          # temporaries in one pass (peak RSS 7.9-8.0 GB in the quickstart); 4-row passes ~2 GB.
          # Rows of 1,024 tokens unless a sequence is longer (99 % are not), in buckets of 4 rows:
          # the same tokens as 2,048-token rows in power-of-two buckets at ~half the step time.
          # LEARNER_ROW_BUCKETS: a long-horizon batch needs far more rows than the quickstart's.
          ppo=PPOConfig(
            row_len=engine.max_seq_len,
            short_row_lens=(engine.max_seq_len // 2,) if rl.short_row_lens is None
            else tuple(rl.short_row_lens),
            row_buckets=LEARNER_ROW_BUCKETS,
            temperature=max(temperature, 1e-6),
            ppo_n_minibatches=rl.ppo_minibatches, ppo_epochs=rl.ppo_epochs, micro_rows=rl.micro_rows,
          ),
          optimizer=steps.OptimizerConfig(learning_rate=rl.learning_rate, weight_decay=0.0),
        ),
      )  # fmt: skip
      run = rl_commands.build_run(
        config,
        run_dir=str(root / "rl"),
        policy=wiring.policy(model_dir=str(warm), tokenizer_dir=str(warm)),
        items=rl_items,
        scorer=hop_credit_scorer(sw.questions, rl.hop_credit) if rl.hop_credit else None,
      )  # fmt: skip
      # Compile every prefill/decode shape now, so evaluation times are not compile times.
      if ev.engine_warmup:
        modes = {"sample" if t > 0 else "greedy" for t in (temperature, eval_temperature)}
        warm_s = run.engine.warmup(modes=tuple(sorted(modes)))
        log.info("engine warmup: %.1f s", warm_s)
    try:
      common = dict(
        client=run.driver, tokenizer=run.tokenizer, questions=files.test,
        retrieval_address=server.address, k=ev.k, limit=ev.questions,
        temperature=eval_temperature, agent=agent, concurrency=ev.concurrency, seed=ev.seed,
      )  # fmt: skip
      with tracker.stage("eval_sft"):
        before = evaluate(**common, out_dir=root / "eval", policy=f"sft:{model_dir_id(warm)}")
      with tracker.stage("rl") as st:
        resumed = run.trainer.restore()
        run.rollout.start()
        run.rollout.add_closer(run.toolbox.close)
        t_rl = time.perf_counter()

        def progress(m: dict[str, float]) -> None:
          frac = (time.perf_counter() - t_rl) / max(rl.seconds, 1e-9)
          st.update(frac, f"step {run.learner.version}, reward {m.get('rollout/reward', 0):.2f}")

        run.trainer.run(max_seconds=rl.seconds, on_step=progress)
        run.rollout.stop()
      with tracker.stage("eval_rl"):
        after = evaluate(
          **common, out_dir=root / "eval", policy=f"rl:{root.resolve()}:v{run.learner.version}"
        )
      version = run.learner.version
    finally:
      run.close()
  with tracker.stage("report"):
    rows = report.read_metrics(root / "rl" / "metrics" / "metrics.jsonl")
    curves = report.curves(rows)
    report.write_plots(curves, root / "report")
    tool_calls = curves["rollout/tool_calls"]
    summary = {
      "command": invocation.command("asearcher quickstart (called from Python)"),
      "avg4_sft": before["avg_em"], "avg4_rl": after["avg_em"],
      "pass4_sft": before["pass_em"], "pass4_rl": after["pass_em"],
      "f1_avg4_sft": before["avg_f1"], "f1_avg4_rl": after["avg_f1"],
      "eval_tool_calls_sft": before["tool_calls"], "eval_tool_calls_rl": after["tool_calls"],
      "eval_turns_sft": before["turns"], "eval_turns_rl": after["turns"],
      "tool_calls_first_steps": report.window_mean(tool_calls, first=True),
      "tool_calls_last_steps": report.window_mean(tool_calls, first=False),
      "rl_steps": version, "rl_resumed_from": resumed, "eta": rl.max_staleness,
      "temperature_rl": temperature, "temperature_eval": eval_temperature,
      "hop_credit": rl.hop_credit, "curriculum": rl.curriculum,
      "k": ev.k, "num_test_questions": before["n"], "world_seed": world.seed,
      "world_digest": files.digest, "warm_start": str(warm),
      "stages": tracker.timings(),
      "stages_peak_rss_mb": tracker.peak_rss(),
      "wall_s": round(time.time() - t0, 1),
      "peak_rss_mb": metric_writer.peak_rss_mb(),
    }  # fmt: skip
    out = root / "report"
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "report.md").write_text(report.format_markdown(summary))
  print(report.format_markdown(summary))
  print(f"report: {out}/report.md, summary.json, training.png; tensorboard --logdir {root}/rl")
  print(json.dumps(summary), flush=True)
  return 0


def hop_credit_scorer(questions: Sequence[SynthQuestion], weight: float) -> Scorer:
  """The RL reward with per-hop credit on the world's chain questions (`QuickstartRL.hop_credit`);
  other questions get the answer reward's share alone."""
  by_id = {q.id: q for q in questions}

  def progress(t: Trajectory) -> float | None:
    q = by_id.get(t.qid)
    acts = [c.action for c in t.calls if c.kind == "act"]
    return None if q is None else chain_breaks.hops_searched(q, acts)

  return progress_scorer(progress, weight)


def model_dir_id(d: Path) -> str:
  """Short identity of a model directory (its weights), so evaluations of other weights never
  reuse these snapshots."""
  h = hashlib.sha256()
  for p in sorted(d.glob("*.safetensors")):
    h.update(p.read_bytes())
  return h.hexdigest()[:16]
