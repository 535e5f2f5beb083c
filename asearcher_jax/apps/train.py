"""`asearcher train`: asynchronous RL of a search agent on one machine.

A keyword-only function that gin binds; with no gin file at all it trains a random qwen2-tiny
policy on the shipped HotpotQA-100 questions, with the real retrieval server (BM25 over the
shipped corpus) on 127.0.0.1, the ASearcher agent and the in-process engine. `build_run` wires
the pieces (used by the tests too); `train` runs them and prints a JSON summary as its last line.

Threads: the learner on the caller's thread, rollouts + tools + the retrieval server on the
rollout controller's asyncio thread, the engine on the driver's thread. With
`engine_address_files` the engine is elsewhere instead: `serve-model` servers that load each
version from `weights_dir` (`rl.remote`: AReaL's disaggregated layout).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx

from asearcher_jax.agent import Agent, AsearcherAgentConfig, Limits, registry
from asearcher_jax.agent.trajectory import Trajectory
from asearcher_jax.checkpoint import CheckpointConfig, Checkpointer
from asearcher_jax.errors import AsearcherError
from asearcher_jax.metric_writer import MetricWriter
from asearcher_jax.model import steps
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.model.loading import load_policy
from asearcher_jax.rl import reward as reward_lib
from asearcher_jax.rl.learner import Learner, PPOConfig
from asearcher_jax.rl.remote import RemoteEngines
from asearcher_jax.rl.replay import ReplayConfig, ReplayQueue
from asearcher_jax.rl.rollout import QAItem, RolloutConfig, RolloutController, Scorer, answer_scorer
from asearcher_jax.rl.staleness import StalenessConfig, StalenessManager
from asearcher_jax.rl.trainer import Trainer, TrainerConfig
from asearcher_jax.rl.weight_sync import InProcessWeightSync
from asearcher_jax.serving.client import RemoteClientConfig
from asearcher_jax.serving.driver import Driver, DriverConfig
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.serving.types import SamplingParams
from asearcher_jax.tools.search import LocalRetrievalConfig
from asearcher_jax.tools.toolbox import ToolBox, make_toolbox

log = logging.getLogger(__name__)

# CPU-sized defaults: short agent budgets so a random tiny policy finishes a step in seconds.
DEFAULT_ENGINE = EngineConfig(max_slots=8, max_seq_len=1024, prefill_buckets=(512, 1024))
DEFAULT_AGENT = AsearcherAgentConfig(max_turns=2, max_new_tokens=16, max_tokens=1024)
DEFAULT_ROLLOUT = RolloutConfig()

DEFAULT_QA = (
  Path(__file__).resolve().parents[1] / "assets" / "qa" / "hipporag_hotpotqa_train100.json.gz"
)


def load_qa(path: str | Path | None = None, *, limit: int | None = None) -> list[QAItem]:
  """Questions from a .json / .json.gz list or .jsonl(.gz) file with `question` and `answer`
  (str) or `answers` (list) fields -- HotpotQA and ASearcher's formats. Default: HotpotQA-100."""
  path = Path(path) if path else DEFAULT_QA
  opener = gzip.open if path.suffix == ".gz" else open
  with opener(path, "rt", encoding="utf-8") as f:
    text = f.read()
  stem = path.name.removesuffix(".gz")
  rows = (
    [json.loads(x) for x in text.splitlines() if x.strip()]
    if stem.endswith(".jsonl")
    else json.loads(text)
  )
  items = []
  for i, r in enumerate(rows[:limit]):
    answers = r.get("answers", r.get("answer"))
    answers = [answers] if isinstance(answers, str) else list(answers or [])
    items.append(
      QAItem(
        qid=str(r.get("id", r.get("_id", i))),
        question=str(r["question"]),
        answers=tuple(str(a) for a in answers),
        aug_answers=tuple(str(a) for a in r.get("aug_answers", ())),
        bucket=_bucket(r),
      )
    )
  if not items:
    raise ValueError(f"no questions in {path}")
  return items


def _bucket(record: dict) -> str:
  """The curriculum bucket of a QA record: its `bucket` field, else what the common formats say
  about the kind of question (SynthWiki: kind and hops; HotpotQA: type and level)."""
  if record.get("bucket"):
    return str(record["bucket"])
  return "-".join(str(record[k]) for k in ("kind", "hops", "type", "level") if k in record)


def smoke_scorer(trajs: Sequence[Trajectory]) -> list[float | None]:
  """A learnable stand-in reward for random policies: the fraction of generated tokens with an
  even id. A random policy never closes an <answer> tag, so the answer reward is identically 0
  and the zero-variance filter would drop every group; this one varies, so the whole pipeline
  (filter, centring, staleness, learner) runs for real and the reward visibly rises."""
  out = []
  for t in trajs:
    ids = np.concatenate([c.output_ids for c in t.calls]) if t.calls else np.zeros(0)
    t.score = float((ids % 2 == 0).mean()) if ids.size else 0.0
    out.append(t.score)
  return out


@dataclasses.dataclass
class TrainRun:
  """Every live object of a run; `close()` tears them down in reverse order."""

  tokenizer: object
  engine: Engine | None  # None: generation on remote servers
  driver: Driver | None
  learner: Learner
  staleness: StalenessManager
  replay: ReplayQueue
  rollout: RolloutController
  trainer: Trainer
  checkpointer: Checkpointer
  writer: MetricWriter
  run_dir: Path
  toolbox: ToolBox | None = None
  retrieval: object | None = None
  remote: RemoteEngines | None = None
  engine_wait_s: float = 600.0

  def start(self, *, retrieval_index_dir: str | None = None) -> int | None:
    """Restores the latest checkpoint (returns its version, None for a fresh run), starts the
    rollout loop, the retrieval server on it (if the agent has tools), then admits groups."""
    version = self.trainer.restore()  # a resumed run publishes its restored version
    if self.remote is not None:
      if version is None:
        self.remote.publish(self.learner)  # servers may have started from any init
      self.remote.start()
      self.remote.wait_loaded(self.engine_wait_s)
    self.rollout.pause()  # no episode before the tools are up
    self.rollout.start()
    if self.remote is not None:
      self.rollout.add_closer(self.remote.close_clients)
    if self.toolbox is not None:
      self.rollout.add_closer(self.toolbox.close)
      start_retrieval(self, retrieval_index_dir)
    self.rollout.resume()
    return version

  def close(self) -> None:
    self.rollout.stop()  # cancels running groups, then closes the ToolBox and the server
    if self.driver is not None:
      self.driver.close()
    if self.remote is not None:
      self.remote.stop()
    self.writer.close()
    self.checkpointer.close()
    self.replay.close()


def build_run(
  *,
  run_dir: str,
  model_dir: str | None = None,
  model: ModelConfig | None = None,
  tokenizer_dir: str | None = None,
  items: Sequence[QAItem] | None = None,
  train_steps: int = 4,
  batch_groups: int = 2,
  max_staleness: int = 1,
  max_concurrent: int | None = None,
  engine: EngineConfig = DEFAULT_ENGINE,
  driver: DriverConfig = DriverConfig(request_timeout_s=600.0),
  agent_name: str = "asearcher",
  agent: Any = DEFAULT_AGENT,
  ppo: PPOConfig | None = None,
  optimizer: steps.OptimizerConfig | None = None,
  rollout: RolloutConfig = DEFAULT_ROLLOUT,
  reward: Literal["auto", "answer", "smoke"] = "auto",
  temperature: float = 1.0,
  search: bool = True,
  checkpoint_every: int = 1,
  batch_timeout_s: float = 600.0,
  seed: int = 0,
  engine_address_files: Sequence[str] = (),
  weights_dir: str | None = None,
  engine_wait_s: float = 600.0,
  engine_client: RemoteClientConfig | None = None,
) -> TrainRun:
  """Builds (does not start) a run; see `train` for the arguments."""
  run = Path(run_dir)
  if engine_address_files and weights_dir is None:
    raise AsearcherError(
      "engine_address_files needs weights_dir: the directory the servers load versions from"
    )
  if agent is DEFAULT_AGENT and agent_name != "asearcher":
    agent = None  # that agent's own defaults
  _, agent = registry.resolve(agent_name, agent)  # a wrong name or config fails before any work
  policy, tokenizer, what = load_policy(model_dir, model, tokenizer_dir, seed)
  log.info("policy: %s", what)
  graphdef, params = nnx.split(policy)
  eng = drv = remote = None
  if engine_address_files:
    log.info("generation on %d serve-model server(s)", len(engine_address_files))
  else:
    eng = Engine.from_model(policy, tokenizer, engine)
    drv = Driver(eng, driver)
  ppo = ppo or PPOConfig(row_len=engine.max_seq_len, temperature=max(temperature, 1e-6))
  learner = Learner(
    graphdef,
    jax.tree.map(lambda x: x.copy(), params),  # the learner donates; the engine keeps its own
    ppo=ppo,
    optimizer=optimizer or steps.OptimizerConfig(learning_rate=1e-3, weight_decay=0.0),
  )
  staleness = StalenessManager(
    StalenessConfig(
      batch_groups=batch_groups, max_staleness=max_staleness, max_concurrent=max_concurrent
    )
  )
  if engine_address_files:
    remote = RemoteEngines(
      engine_address_files, weights_dir, graphdef, staleness,
      client=engine_client or RemoteClientConfig(
        timeout_s=driver.request_timeout_s, retries=6, max_backoff_s=8.0
      ),
    )  # fmt: skip
  replay = ReplayQueue(
    ReplayConfig(directory=str(run / "replay"), max_head_staleness=max_staleness),
    on_discard=lambda g: staleness.on_discard(),
  )
  toolbox = None
  if search:
    toolbox = make_toolbox(local=LocalRetrievalConfig(addr_dir=str(run / "retrieval_addrs")))
  sampling = SamplingParams(temperature=temperature)
  limits = Limits(llm_timeout_s=driver.request_timeout_s, tool_timeout_s=60.0)

  def agent_factory() -> Agent:
    client = drv if remote is None else remote.client_for_episode()  # one server per episode
    make = registry.agent_factory(
      agent_name, agent, client=client, tokenizer=tokenizer, toolbox=toolbox, limits=limits
    )
    return make(sampling)

  if reward == "auto":
    reward = "answer" if model_dir is not None else "smoke"
    log.info("reward: %s (%s policy)", reward, "loaded" if model_dir else "random")
  scorer: Scorer = smoke_scorer if reward == "smoke" else answer_scorer(reward_lib.RewardConfig())
  engine_stats = drv.stats if remote is None else remote.stats
  controller = RolloutController(
    config=rollout,
    items=items if items is not None else load_qa(),
    agent_factory=agent_factory,
    staleness=staleness,
    replay=replay,
    scorer=scorer,
    engine_stats=engine_stats,
  )
  ckpt = Checkpointer(CheckpointConfig(directory=str(run / "checkpoints"), max_to_keep=2))
  writer = MetricWriter(run / "metrics")
  trainer = Trainer(
    config=TrainerConfig(
      train_steps=train_steps,
      batch_groups=batch_groups,
      checkpoint_every=checkpoint_every,
      batch_timeout_s=batch_timeout_s,
    ),
    learner=learner,
    replay=replay,
    staleness=staleness,
    weight_sync=InProcessWeightSync(drv, staleness) if remote is None else remote,
    rollout=controller,
    checkpointer=ckpt,
    writer=writer,
    engine_stats=engine_stats,
  )
  out = TrainRun(
    tokenizer=tokenizer, engine=eng, driver=drv, learner=learner, staleness=staleness,
    replay=replay, rollout=controller, trainer=trainer, checkpointer=ckpt, writer=writer,
    run_dir=run, toolbox=toolbox, remote=remote, engine_wait_s=engine_wait_s,
  )  # fmt: skip
  return out


def start_retrieval(run: TrainRun, index_dir: str | None) -> None:
  """Starts the retrieval server on the rollout loop (127.0.0.1, free port, address file)."""
  from asearcher_jax.apps.index import default_index_dir
  from asearcher_jax.tools.retrieval.corpus import default_corpus_paths
  from asearcher_jax.tools.retrieval.index import build_index_dir, load_index
  from asearcher_jax.tools.retrieval.server import RetrievalServer, RetrievalServerConfig

  out = Path(index_dir) if index_dir else default_index_dir()
  if index_dir is None:
    build_index_dir(corpus=default_corpus_paths(), index_dir=out, show_progress=False)
  addr_dir = run.run_dir / "retrieval_addrs"
  for stale in addr_dir.glob("Host*_IP*.txt"):  # a killed run's server is gone
    stale.unlink(missing_ok=True)
  server = RetrievalServer(load_index(out), RetrievalServerConfig(port=0, addr_dir=str(addr_dir)))
  run.rollout.run_coroutine(server.start(), 30)
  run.rollout.add_closer(server.stop)
  run.retrieval = server


def train(
  *,
  run_dir: str = "runs/train",
  model_dir: str | None = None,
  model: ModelConfig | None = None,
  tokenizer_dir: str | None = None,
  questions: str | None = None,
  max_questions: int | None = None,
  train_steps: int = 4,
  batch_groups: int = 2,
  group_size: int = 4,
  max_staleness: int = 1,
  max_concurrent: int | None = None,
  engine: EngineConfig = DEFAULT_ENGINE,
  driver: DriverConfig = DriverConfig(request_timeout_s=600.0),
  agent_name: str = "asearcher",
  agent: Any = DEFAULT_AGENT,
  ppo: PPOConfig | None = None,
  optimizer: steps.OptimizerConfig | None = None,
  rollout: RolloutConfig | None = None,
  reward: Literal["auto", "answer", "smoke"] = "auto",
  temperature: float = 1.0,
  search: bool = True,
  retrieval_index_dir: str | None = None,
  checkpoint_every: int = 1,
  batch_timeout_s: float = 600.0,
  seed: int = 0,
  engine_address_files: Sequence[str] = (),
  weights_dir: str | None = None,
  engine_wait_s: float = 600.0,
  engine_client: RemoteClientConfig | None = None,
) -> int:
  """Trains until `train_steps` (resuming from `run_dir` if it holds a checkpoint); returns 0.

  Args:
    run_dir: checkpoints, the replay log, metrics (TensorBoard + JSONL) and the summary.
    model_dir: a Hugging Face Qwen2/Qwen3 checkpoint; None: a random `model` policy.
    model: architecture of the random policy (default: the qwen2-tiny preset).
    tokenizer_dir: tokenizer files; default: model_dir's, else the packaged Qwen2 vocabulary.
    questions: QA file (.json/.jsonl, optionally .gz); None: the shipped HotpotQA-100.
    max_questions: use only the first this many questions.
    train_steps: stop when the policy version reaches this.
    batch_groups: B, groups (dataset items) per training step.
    group_size: n, episodes per group.
    max_staleness: eta; 0 = synchronous RL on the same code path.
    max_concurrent: groups in flight at once; None = B.
    engine: slots, context and prefill buckets of the in-process engine (with remote servers:
      its max_seq_len still sets the learner's row length; match the servers').
    driver: the engine driver's settings.
    agent_name: which agent to train ("asearcher", "reasoning", "search_r1"; agent.registry).
    agent: that agent's config (budgets, prompts); the default is a smoke-sized ASearcher one, and
      another agent_name with it left unbound uses that agent's own defaults.
    ppo: learner settings; None: decoupled PPO with row_len = the engine context.
    optimizer: AdamW settings; None: lr 1e-3 (tiny models).
    rollout: the controller's settings (its group_size is replaced by `group_size`).
    reward: "answer" (ASearcher F1 reward), "smoke" (even-token fraction, for random policies
      that never answer), "auto" (answer with model_dir, else smoke).
    temperature: sampling temperature (the learner recomputes logprobs at the same one).
    search: give the agent the local retrieval server (False: no tools).
    retrieval_index_dir: index to serve; None: the shipped corpus's BM25 index (built if needed).
    checkpoint_every: checkpoint (and commit consumed groups) every this many steps.
    batch_timeout_s: fail if no batch arrives within this long.
    seed: init seed of the random policy.
    engine_address_files: address files of `asearcher serve-model` servers to generate on
      (one server per episode, round-robin) instead of the in-process engine; each server
      must be started with `weights_dir` set to this run's `weights_dir`. (): in-process.
    weights_dir: where each policy version is published for those servers (a directory both
      sides can read: local disk on one host, a shared filesystem on a pod).
    engine_wait_s: longest wait at start for every server to load the trainer's weights.
    engine_client: timeouts and retries of the calls to those servers; None: the request
      timeout of `driver`, and 6 retries backing off up to 8 s (~12-24 s in all: a server
      restarted on the same address file is found again; then the episode fails as an
      environment failure, retried per `rollout`).
  """
  t0 = time.time()
  rollout_cfg = dataclasses.replace(rollout or DEFAULT_ROLLOUT, group_size=group_size)
  run = build_run(
    run_dir=run_dir, model_dir=model_dir, model=model, tokenizer_dir=tokenizer_dir,
    items=load_qa(questions, limit=max_questions), train_steps=train_steps,
    batch_groups=batch_groups, max_staleness=max_staleness,
    max_concurrent=max_concurrent, engine=engine, driver=driver, agent_name=agent_name, agent=agent, ppo=ppo,
    optimizer=optimizer, rollout=rollout_cfg, reward=reward, temperature=temperature,
    search=search, checkpoint_every=checkpoint_every, batch_timeout_s=batch_timeout_s, seed=seed,
    engine_address_files=tuple(engine_address_files), weights_dir=weights_dir,
    engine_wait_s=engine_wait_s, engine_client=engine_client,
  )  # fmt: skip
  try:
    resumed = run.start(retrieval_index_dir=retrieval_index_dir)
    print(
      f"[train] {'resumed at version ' + str(resumed) if resumed else 'fresh start'}", flush=True
    )
    last = run.trainer.run()
  finally:
    run.close()
  summary = {
    "version": run.learner.version,
    "resumed_from": resumed,
    "reward": last.get("rollout/reward"),
    "loss": last.get("ppo/loss"),
    "staleness_head_max": last.get("staleness/head_max"),
    "trainer_idle_frac": last.get("perf/trainer_idle_frac_cum"),
    "groups_trained": sum(len(x) for x in run.trainer.trained_ids),
    "seconds": round(time.time() - t0, 1),
  }
  print(json.dumps(summary), flush=True)
  return 0
