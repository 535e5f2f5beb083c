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
import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asearcher_jax import metric_writer
from asearcher_jax.agent import AsearcherAgentConfig, Limits, registry
from asearcher_jax.agent.registry import agent_factory
from asearcher_jax.agent.trajectory import Trajectory
from asearcher_jax.apps import invocation, wiring
from asearcher_jax.apps import quickstart_report as report
from asearcher_jax.apps import train as rl_commands
from asearcher_jax.apps.stages import PipelineStage, Stage, StageTracker
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
  """The RL question pool (see `SynthWikiRL.questions`): "train", or "heldout" = the test
  split after its first eval_questions (the evaluated ones), disjoint from both the warm start's
  training questions and the evaluation; with `prefix_hops`, also the first h hops of each
  pooled chain (`SynthWikiRL.prefix_hops`; needs the world `sw`); only questions of `kinds`
  (QAExample.bucket) if given."""
  if which == "train":
    items = load_training_qa(files.train)
  elif which == "heldout":
    items = load_training_qa(files.test)[eval_questions:] if eval_questions is not None else []
    if not items:
      raise AsearcherError(
        "SynthWikiRL.questions='heldout' needs test questions beyond the evaluated ones: set "
        "QuickstartEval.questions below the test split's size, or SynthWikiRL.questions='train'"
      )
  else:
    raise ConfigValueError(f"SynthWikiRL.questions must be 'heldout' or 'train', got {which!r}")
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
    raise ConfigValueError(f"SynthWikiRL.prefix_hops must be hop counts >= 1, got {hops}")
  ids = {it.id for it in items}
  pooled = [q for q in sw.questions if q.id in ids]
  made = chain_prefixes(sw.world, pooled, hops, sw.world.config.question_style)
  if not made:
    raise AsearcherError(f"SynthWikiRL.prefix_hops={hops}: no pooled chain is longer than that")
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
  # Evaluation seed (runs use seed + r); RL's is `RolloutConfig.seed` (the recipes bind both to
  # their SEED macro).
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
class SynthWikiRL:
  """What an RL run on a SynthWiki world needs beside its `TrainConfig`: the question pool it
  draws from and the per-hop credit of its reward (both need the world's questions, which
  `TrainConfig` knows nothing of)."""

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
  # Weight of per-hop credit in the RL reward (`rl.scoring.progress_scorer`): (1 - w) x the answer
  # reward + w x the fraction of a chain's hops searched right before its first wrong search
  # (`synthwiki.chain_breaks.hops_searched`). 0: the ASearcher reward alone.
  hop_credit: float = 0.0

  def __post_init__(self) -> None:
    if not 0 <= self.hop_credit < 1:
      raise ConfigValueError(f"SynthWikiRL.hop_credit must be in [0, 1) (got {self.hop_credit})")
    if self.hop_credit and self.prefix_hops:
      raise ConfigValueError(
        "SynthWikiRL.hop_credit does not credit prefix_hops questions: use one"
      )


# The quickstart's RL run (figures behind the values: docs/measurements.md, "The quickstart's RL
# stage"); gin/experiments/quickstart.gin binds the same values part by part. B = 2 groups of
# n = 8, eta = 4, 12 groups in flight, 420 s. Learner: micro_rows=4 (a minibatch of 8 rows of
# 2,048 tokens needed ~5 GB of XLA:CPU temporaries in one pass, peak RSS 7.9-8.0 GB; 4-row passes
# ~2 GB); rows of 1,024 tokens unless a sequence is longer (99 % are not), in buckets of 4 rows:
# the same tokens as 2,048-token rows in power-of-two buckets at ~half the step time.
QUICKSTART_RL = TrainConfig(
  train_steps=1000, max_seconds=420.0, batch_timeout_s=900.0, reward="answer", temperature=1.0,
  staleness=StalenessConfig(batch_groups=2, max_staleness=4, max_concurrent=12),
  engine=QUICKSTART_ENGINE,
  driver=DriverConfig(request_timeout_s=600.0),
  agent=AgentChoice(name="asearcher", configs={"asearcher": QUICKSTART_AGENT}),
  rollout=RolloutConfig(group_size=8, episode_timeout_s=600.0, seed=0),
  learner=LearnerConfig(
    ppo=PPOConfig(
      row_len=QUICKSTART_ENGINE.max_seq_len, short_row_lens=(QUICKSTART_ENGINE.max_seq_len // 2,),
      row_buckets=LEARNER_ROW_BUCKETS, micro_rows=4,
    ),
    optimizer=steps.OptimizerConfig(learning_rate=1e-4, weight_decay=0.0),
  ),
)  # fmt: skip
# The quickstart's question pool: the held-out questions it does not evaluate, no hop credit.
HELDOUT_POOL = SynthWikiRL()
DEFAULT_EVAL = QuickstartEval()


def synthwiki_agent(config: TrainConfig) -> AsearcherAgentConfig:
  """The agent config of an RL run on SynthWiki (the evaluation harness runs the same agent)."""
  if registry.ALIASES.get(config.agent.name, config.agent.name) != "asearcher":
    raise ConfigValueError(
      f"the SynthWiki pipelines train and evaluate the asearcher agent, not {config.agent.name!r}"
    )
  agent = config.agent.config
  if not isinstance(agent, AsearcherAgentConfig):
    raise ConfigValueError(
      "the SynthWiki pipelines need TrainConfig.agent.configs['asearcher'] (an "
      f"AsearcherAgentConfig), got {agent!r}"
    )
  return agent


@dataclasses.dataclass
class PipelineState:
  """What the stages of an RL pipeline hand each other (the world, the live RL run, scores);
  `resources` closes the run and the retrieval server when the pipeline ends."""

  root: Path
  warm_start: Path
  resources: contextlib.ExitStack
  sw: SynthWiki | None = None
  files: WorldFiles | None = None
  items: list[QAExample] = dataclasses.field(default_factory=list)
  server: RetrievalThread | None = None
  run: rl_commands.TrainRun | None = None
  scores: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
  resumed: int | None = None
  summary: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorldStage:
  """The SynthWiki world (corpus, tokenizer, BM25 index) checked against the warm start's
  tokenizer, the RL question pool, and the world's retrieval server on 127.0.0.1."""

  name: str = "world"
  estimate_s: float = 3.0
  # The world; must be the warm start's.
  world: SynthWikiConfig
  # The RL question pool.
  pool: SynthWikiRL
  # Held-out questions the evaluation takes (kept out of a "heldout" pool).
  eval_questions: int | None

  def run(self, state: PipelineState, stage: Stage) -> None:
    state.sw, state.files = prepare_world(state.root / "world", self.world)
    check_tokenizer(state.files, state.warm_start)
    state.items = rl_pool(
      state.files, self.pool.questions, self.eval_questions, self.pool.kinds,
      prefix_hops=tuple(self.pool.prefix_hops), sw=state.sw,
    )  # fmt: skip
    addr_dir = state.root / "rl" / rl_commands.RETRIEVAL_ADDRS
    state.server = state.resources.enter_context(
      RetrievalThread(state.files.index, addr_dir=addr_dir)
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadStage:
  """The warm start loaded into the RL run of `rl` (built, not started), its tools on the
  world's retrieval server; with `warmup_temperatures`, every engine shape compiled now, so
  evaluation times are not compile times."""

  name: str = "load"
  estimate_s: float = 20.0
  # The RL run.
  rl: TrainConfig
  # The reward's per-hop credit (`SynthWikiRL.hop_credit`).
  hop_credit: float = 0.0
  # Compile the engine's shapes for these sampling temperatures; () = on first use.
  warmup_temperatures: tuple[float, ...] = ()

  def run(self, state: PipelineState, stage: Stage) -> None:
    assert state.server is not None and state.sw is not None
    tools = wiring.ToolsConfig(local=LocalRetrievalConfig(addresses=(state.server.address,)))
    run = rl_commands.build_run(
      dataclasses.replace(self.rl, tools=tools),
      run_dir=str(state.root / "rl"),
      policy=wiring.policy(model_dir=str(state.warm_start), tokenizer_dir=str(state.warm_start)),
      items=state.items,
      scorer=hop_credit_scorer(state.sw.questions, self.hop_credit) if self.hop_credit else None,
    )  # fmt: skip
    state.resources.callback(run.close)
    state.run = run
    if self.warmup_temperatures:
      log.info("engine warmup: %.1f s", run.warmup(self.warmup_temperatures))


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalStage:
  """Avg@k / Pass@k of the RL run's current policy on the held-out questions (the warm start
  before RL, the RL policy after it)."""

  name: str
  estimate_s: float = 90.0
  # The held-out evaluation.
  evaluation: QuickstartEval
  # Its sampling temperature.
  temperature: float
  # The evaluated agent.
  agent: AsearcherAgentConfig
  # "sft": the warm start's weights; "rl": the RL run's latest version.
  policy: str

  def run(self, state: PipelineState, stage: Stage) -> None:
    assert state.run is not None and state.files is not None and state.server is not None
    ev, run = self.evaluation, state.run
    if self.policy == "sft":
      policy = f"sft:{model_dir_id(state.warm_start)}"
    else:
      policy = f"rl:{state.root.resolve()}:v{run.learner.version}"
    state.scores[self.policy] = evaluate(
      client=run.driver, tokenizer=run.tokenizer, questions=state.files.test,
      retrieval_address=state.server.address, out_dir=state.root / "eval", policy=policy,
      k=ev.k, limit=ev.questions, temperature=self.temperature, agent=self.agent,
      concurrency=ev.concurrency, seed=ev.seed,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLStage:
  """Fully asynchronous RL: the run started (`TrainRun.start`: restored from its checkpoint
  when there is one), trained for `rl.max_seconds` or `rl.train_steps`, its rollouts stopped
  so that the evaluation after it has the engine to itself."""

  name: str = "rl"
  # The RL run (its budget: max_seconds, train_steps).
  rl: TrainConfig

  @property
  def estimate_s(self) -> float:
    return (600.0 if self.rl.max_seconds is None else self.rl.max_seconds) + 30.0

  def run(self, state: PipelineState, stage: Stage) -> None:
    run = state.run
    assert run is not None and run.rollout is not None
    state.resumed = run.start()
    budget = self.estimate_s - 30.0
    t_rl = time.perf_counter()

    def progress(m: dict[str, float]) -> None:
      frac = (time.perf_counter() - t_rl) / max(budget, 1e-9)
      stage.update(frac, f"step {run.learner.version}, reward {m.get('rollout/reward', 0):.2f}")

    run.trainer.run(max_seconds=self.rl.max_seconds, on_step=progress)
    run.rollout.stop()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReportStage:
  """summary.json, report.md and the training curves of the run."""

  name: str = "report"
  estimate_s: float = 3.0
  # The RL run and its question pool (their settings the summary records).
  rl: TrainConfig
  pool: SynthWikiRL
  # The evaluation's settings and temperature, and the world's seed.
  evaluation: QuickstartEval
  eval_temperature: float
  world_seed: int

  def run(self, state: PipelineState, stage: Stage) -> None:
    assert state.files is not None and state.run is not None
    state.resources.close()  # the run (its metrics flushed) and the server end first
    root = state.root
    before, after = state.scores["sft"], state.scores["rl"]
    rows = report.read_metrics(root / "rl" / "metrics" / "metrics.jsonl")
    curves = report.curves(rows)
    report.write_plots(curves, root / "report")
    tool_calls = curves["rollout/tool_calls"]
    state.summary = {
      "command": invocation.command("asearcher quickstart (called from Python)"),
      "avg4_sft": before["avg_em"], "avg4_rl": after["avg_em"],
      "pass4_sft": before["pass_em"], "pass4_rl": after["pass_em"],
      "f1_avg4_sft": before["avg_f1"], "f1_avg4_rl": after["avg_f1"],
      "eval_tool_calls_sft": before["tool_calls"], "eval_tool_calls_rl": after["tool_calls"],
      "eval_turns_sft": before["turns"], "eval_turns_rl": after["turns"],
      "tool_calls_first_steps": report.window_mean(tool_calls, first=True),
      "tool_calls_last_steps": report.window_mean(tool_calls, first=False),
      "rl_steps": state.run.learner.version, "rl_resumed_from": state.resumed,
      "eta": self.rl.staleness.max_staleness,
      "temperature_rl": self.rl.temperature, "temperature_eval": self.eval_temperature,
      "hop_credit": self.pool.hop_credit, "curriculum": self.rl.rollout.curriculum,
      "k": self.evaluation.k, "num_test_questions": before["n"], "world_seed": self.world_seed,
      "world_digest": state.files.digest, "warm_start": str(state.warm_start),
    }  # fmt: skip


def rl_stages(
  *,
  world: SynthWikiConfig,
  evaluation: QuickstartEval,
  rl: TrainConfig,
  pool: SynthWikiRL,
) -> list[PipelineStage]:
  """The quickstart's stages from a warm start: world, load, eval_sft, rl, eval_rl, report (the
  quickstart runs them alone; the long-horizon pipeline after its warm start)."""
  agent = synthwiki_agent(rl)
  eval_temperature = evaluation.eval_temperature(rl.temperature)
  temperatures = (rl.temperature, eval_temperature) if evaluation.engine_warmup else ()
  ev = dict(evaluation=evaluation, temperature=eval_temperature, agent=agent)
  return [
    WorldStage(world=world, pool=pool, eval_questions=evaluation.questions),
    LoadStage(rl=rl, hop_credit=pool.hop_credit, warmup_temperatures=temperatures),
    EvalStage(name="eval_sft", policy="sft", **ev),
    RLStage(rl=rl),
    EvalStage(name="eval_rl", policy="rl", **ev),
    ReportStage(rl=rl, pool=pool, evaluation=evaluation, eval_temperature=eval_temperature,
                world_seed=world.seed),
  ]  # fmt: skip


def run_stages(root: Path, warm_start: Path, stages: Sequence[PipelineStage]) -> dict[str, Any]:
  """Runs `stages` in order under one progress display; returns the report stage's summary
  (with the stages' timings and peak memory) after writing summary.json and report.md."""
  t0 = time.time()
  tracker = StageTracker([(s.name, s.estimate_s) for s in stages])
  with contextlib.ExitStack() as resources:
    state = PipelineState(root=root, warm_start=warm_start, resources=resources)
    for s in stages:
      with tracker.stage(s.name) as handle:
        s.run(state, handle)
        if s is stages[-1]:
          _write_summary(state, tracker, t0)
  return state.summary


def _write_summary(state: PipelineState, tracker: StageTracker, t0: float) -> None:
  summary = state.summary
  summary.update(
    stages=tracker.timings(), stages_peak_rss_mb=tracker.peak_rss(),
    wall_s=round(time.time() - t0, 1), peak_rss_mb=metric_writer.peak_rss_mb(),
  )  # fmt: skip
  out = state.root / "report"
  (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  (out / "report.md").write_text(report.format_markdown(summary))


def quickstart(
  *,
  run_dir: str = "runs/quickstart",
  warm_start_dir: str | None = None,
  world: SynthWikiConfig = QUICKSTART_WORLD,
  evaluation: QuickstartEval = DEFAULT_EVAL,
  rl: TrainConfig = QUICKSTART_RL,
  pool: SynthWikiRL = HELDOUT_POOL,
) -> int:
  """Runs the quickstart; prints the before/after table and a JSON summary as the last line.

  Args:
    run_dir: everything this run writes (world, evaluations, RL checkpoints/metrics, report).
    warm_start_dir: an SFT model directory (config.json, safetensors, tokenizer); default: the
      shipped SynthWiki warm start.
    world: the SynthWiki world; must be the warm start's (checked through its tokenizer).
    evaluation: the held-out evaluation (questions, k, concurrency, seed, temperature).
    rl: the RL run, as `asearcher train` configures one (time budget, staleness, engine, agent,
      rollout, learner, sampling temperature; its tools are the world's retrieval server).
    pool: where RL draws its questions, and the reward's per-hop credit.
  """
  root = Path(run_dir)
  warm = warm_start_path(warm_start_dir)
  summary = run_stages(root, warm, rl_stages(world=world, evaluation=evaluation, rl=rl, pool=pool))
  print_summary(root, summary)
  return 0


def warm_start_path(warm_start_dir: str | None) -> Path:
  """The warm start an RL pipeline starts from (default: the shipped SynthWiki one), checked."""
  warm = Path(warm_start_dir) if warm_start_dir else DEFAULT_WARM_START
  if not (warm / "config.json").exists():
    raise AsearcherError(f"no warm start at {warm} (config.json missing)")
  return warm


def print_summary(root: Path, summary: dict[str, Any]) -> None:
  """The before/after table, where the report is, and the summary as one JSON line."""
  print(report.format_markdown(summary))
  print(
    f"report: {root}/report/report.md, summary.json, training.png; tensorboard --logdir {root}/rl"
  )
  print(json.dumps(summary), flush=True)


def hop_credit_scorer(questions: Sequence[SynthQuestion], weight: float) -> Scorer:
  """The RL reward with per-hop credit on the world's chain questions (`SynthWikiRL.hop_credit`);
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
