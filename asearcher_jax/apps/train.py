"""`asearcher train`: asynchronous RL of any registered agent with any toolbox, on one machine.

`train` is the keyword-only function gin binds: a `TrainConfig` (apps/train_config.py: engine,
driver, agent, tools, rollout, replay, staleness, learner, remote engines) plus the run's inputs
and outputs. gin/runs/train.gin (the default) trains a random qwen2-tiny policy on the shipped
HotpotQA-100 questions with the ASearcher agent, the real retrieval server (BM25 over the shipped
corpus) on 127.0.0.1 and the in-process engine; `tools.kind = "web"` gives the agents Serper
search and the Jina reader (or direct fetching) under the record/replay cache and the cost
budget. `build_run` wires the pieces (used by the tests and the quickstart too); `train` runs
them and prints a JSON summary as its last line.

Threads: the learner on the caller's thread, rollouts + tools + the retrieval server on the
rollout controller's asyncio thread, the engine on the driver's thread. With
`remote.address_files` the engine is elsewhere instead: `serve-model` servers that load each
version from `remote.weights_dir` (`rl.remote`: AReaL's disaggregated layout).

Several processes (`jax.distributed`, initialised by main.py): one learner over `config.mesh`
spanning every process's devices, generation on serve-model servers only. Process 0 builds the
whole run; the others build the learner, the checkpointer and a trainer that follows process
0's batches (`rl.trainer`), and nothing that talks to engines, tools or the replay log.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asearcher_jax import storage
from asearcher_jax.agent import Agent, Limits, registry
from asearcher_jax.agent.trajectory import Trajectory
from asearcher_jax.apps import rehearsal, wiring
from asearcher_jax.apps.train_config import TrainConfig
from asearcher_jax.checkpoint import CheckpointConfig, Checkpointer
from asearcher_jax.data.qa import QAExample, load_training_qa
from asearcher_jax.errors import AsearcherError
from asearcher_jax.metric_writer import MetricWriter
from asearcher_jax.model.config import ModelConfig, to_hf_config
from asearcher_jax.model.sharding import MeshConfig
from asearcher_jax.rl import aot
from asearcher_jax.rl import reward as reward_lib
from asearcher_jax.rl.episodes import EPISODES_FILE, EpisodeLog
from asearcher_jax.rl.inflight import RESUME_LOG, ResumeLog
from asearcher_jax.rl.learner import Learner
from asearcher_jax.rl.remote import RemoteEngines
from asearcher_jax.rl.replay import ReplayQueue
from asearcher_jax.rl.rollout import AgentSource, RolloutController
from asearcher_jax.rl.scoring import Scorer, answer_scorer
from asearcher_jax.rl.staleness import StalenessManager
from asearcher_jax.rl.trainer import Trainer, TrainerConfig
from asearcher_jax.rl.weight_sync import DirectoryWeightPublisher, InProcessWeightSync
from asearcher_jax.serving.client import RemoteClientConfig
from asearcher_jax.serving.driver import Driver
from asearcher_jax.serving.engine import Engine
from asearcher_jax.serving.types import GenerationClient, SamplingParams
from asearcher_jax.tools.toolbox import ToolBox

log = logging.getLogger(__name__)


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

  config: TrainConfig
  tokenizer: object
  engine: Engine | None  # None: generation on remote servers
  driver: Driver | None
  learner: Learner
  staleness: StalenessManager | None  # None (and replay, rollout): a non-lead trainer process
  replay: ReplayQueue | None
  rollout: RolloutController | None
  trainer: Trainer
  checkpointer: Checkpointer
  writer: MetricWriter
  run_dir: Path
  toolbox: ToolBox | None = None
  retrieval: object | None = None
  remote: RemoteEngines | None = None
  logs: storage.ShippedLogs | None = None  # logs appended locally, shipped to run_dir

  def start(self, *, retrieval_index_dir: str | None = None) -> int | None:
    """Restores the latest checkpoint (returns its version, None for a fresh run), starts the
    rollout loop, the run's own retrieval server on it (local tools), then admits groups."""
    version = self.trainer.restore()  # a resumed run publishes its restored version
    if self.logs is not None:
      self.logs.start()
    if version is None and self.config.remote.enabled:
      self.trainer.publish()  # servers may have started from any init (every process joins)
    if self.rollout is None:  # a non-lead trainer process: it follows process 0's batches
      return version
    if self.remote is not None:
      self.remote.start()
      self.remote.wait_loaded(self.config.remote.wait_s)
    self.rollout.pause()  # no episode before the tools are up
    self.rollout.start()
    if self.remote is not None:
      self.rollout.add_closer(self.remote.close_clients)
    if self.toolbox is not None:
      self.rollout.add_closer(self.toolbox.close)
      if self.config.tools.own_server:
        self.retrieval = wiring.start_retrieval_server(
          self.rollout, retrieval_index_dir, self.run_dir / RETRIEVAL_ADDRS
        )
    self.rollout.resume()
    return version

  def warmup(self, temperatures: Sequence[float]) -> float:
    """Compiles every in-process engine shape for sampling at `temperatures` (0: greedy) before
    the first request, so that what runs next (an evaluation) is timed as serving; returns the
    seconds it took (0 with remote engines)."""
    if self.engine is None:
      return 0.0
    modes = {"sample" if t > 0 else "greedy" for t in temperatures}
    return self.engine.warmup(modes=tuple(sorted(modes)))

  def close(self) -> None:
    try:
      self._close_weights()
    finally:
      self._close_rest()

  def _close_weights(self) -> None:
    """The weight sync's end: the last version committed (a failed write raised here)."""
    if self.trainer.weight_sync is not None:  # the remote engines' sync, when remote
      self.trainer.weight_sync.close()

  def _close_rest(self) -> None:
    if self.rollout is not None:
      self.rollout.stop()  # cancels running groups, then closes the ToolBox and the server
    if self.driver is not None:
      self.driver.close()
    if self.remote is not None:
      self.remote.stop()
    self.writer.close()
    if self.logs is not None:
      self.logs.close()  # after the writer: its last rows are shipped
    self.checkpointer.close()
    if self.replay is not None:
      self.replay.close()


# Where the run's own retrieval server announces its address (inside run_dir).
RETRIEVAL_ADDRS = "retrieval_addrs"
# The trained policy's Hugging Face config.json (its architecture and dtype), written when the run
# starts, so that a checkpoint's parameters can be exported without the model they started from.
POLICY_CONFIG = "policy_config.json"


def check_fit(
  config: TrainConfig, model: ModelConfig, devices: Sequence, hbm_bytes: float
) -> dict[str, Any]:
  """Compiles the learner's optimizer step and its prox pass (`aot.compile_learner`, what the
  Learner runs) for `devices` and raises a one-line AsearcherError if either needs more than
  `hbm_bytes` a device: a run too big for its slice is refused before the engine, the
  learner's weights or a rollout exist. A colocated engine needs room besides, so passing is
  necessary, not sufficient. Returns the compile's report."""
  report = aot.compile_learner(
    model, devices=devices, hbm_gib=hbm_bytes / aot.GIB, ppo=config.ppo(),
    optimizer=config.learner.optimizer, mesh=config.mesh or MeshConfig(),
  )  # fmt: skip
  for part in ("train", "score"):
    r = report.get(part)
    if r is None or (part == "score" and not r.get("runs")) or r["fits"]:
      continue
    at_least = "at least " if r.get("total_is_lower_bound") else ""
    raise AsearcherError(
      f"the learner's {part} step needs {at_least}{r['total_gib']:.1f} GiB a device (compiled "
      f"for {len(devices)} x {devices[0].device_kind}, mesh {report['mesh']}, "
      f"{report['rows']} rows of {config.ppo().row_len} tokens), the device has "
      f"{hbm_bytes / aot.GIB:.1f} GiB: lower learner.ppo.micro_rows or row_len, use "
      "remat_policy='full', or a larger slice (`asearcher compile` shows the split)"
    )
  return report


def _check_fit_here(config: TrainConfig, model: ModelConfig) -> None:
  """`check_fit` on this host's accelerator devices (their allocator's limit); CPU: nothing."""
  devices = jax.devices()
  if not config.check_fit or devices[0].platform == "cpu":
    return
  # A device of this process: another process's device has no memory statistics here.
  limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
  if not limit:
    return
  report = check_fit(config, model, devices, float(limit))
  log.info("the learner fits: %.1f GiB of %.1f a device", report["train"]["total_gib"],
           limit / aot.GIB)  # fmt: skip


def build_run(
  config: TrainConfig,
  *,
  run_dir: str,
  policy: wiring.Policy,
  items: Sequence[QAExample],
  scorer: Scorer | None = None,
) -> TrainRun:
  """Builds (does not start) a run of `config` in `run_dir`: `policy` is trained (the engine
  gets its own copy of the parameters) on `items`; see `train`. `scorer` replaces the one
  `config.reward` names (a program's own reward, e.g. per-hop credit on SynthWiki chains)."""
  run = Path(run_dir)
  remote_cfg = config.remote
  if remote_cfg.enabled and remote_cfg.weights_dir is None:
    raise AsearcherError(
      "engine_address_files needs weights_dir: the directory the servers load versions from"
    )
  if jax.process_count() > 1 and not remote_cfg.enabled:
    raise AsearcherError(
      f"a trainer of {jax.process_count()} processes generates on serve-model servers: set "
      "TrainConfig.remote (address_files, weights_dir); the in-process engine runs in one process"
    )
  # A wrong name or a config of another agent fails before any work.
  agent_cls, agent_cfg = registry.resolve(config.agent.name, config.agent.config)
  _check_fit_here(config, policy.module.cfg)
  graphdef, params = nnx.split(policy.module)
  eng = drv = remote = None
  if remote_cfg.enabled:
    log.info("generation on %d serve-model server(s)", len(remote_cfg.address_files))
  else:
    eng, drv = wiring.in_process_generation(policy, config.engine, config.driver)
  learner = Learner(
    graphdef,
    jax.tree.map(lambda x: x.copy(), params),  # the learner donates; the engine keeps its own
    ppo=config.ppo(),
    optimizer=config.learner.optimizer,
    mesh=config.learner_mesh(),
  )
  if jax.process_index() > 0:
    return _follower_run(config, run, policy, learner, graphdef)
  staleness = StalenessManager(config.staleness)
  if remote_cfg.enabled:
    client_cfg = remote_cfg.client or RemoteClientConfig(
      timeout_s=config.driver.request_timeout_s, retries=6, max_backoff_s=8.0
    )
    remote = RemoteEngines(
      remote_cfg.address_files, remote_cfg.weights_dir, graphdef,
      client=client_cfg, sync=remote_cfg.sync,
    )  # fmt: skip
  logs, local = None, run
  if config.journal_dir is None:
    replay_cfg = config.replay_config(str(run / "replay"))
  else:  # appended locally, shipped to the run directory
    replay_cfg = dataclasses.replace(
      config.replay_config(str(Path(config.journal_dir) / "replay")), ship_to=str(run / "replay")
    )
    local = Path(config.journal_dir) / "run"
  episode_log = EpisodeLog(local / EPISODES_FILE)
  if config.journal_dir is not None:
    logs = storage.ShippedLogs(
      local, run, journals={EPISODES_FILE: episode_log.lock}, files=(RESUME_LOG, "metrics/*")
    )
    logs.open()  # before anything appends: a replaced VM's logs come back from run_dir
  replay = ReplayQueue(replay_cfg, on_discard=lambda g: staleness.on_discard())
  toolbox = wiring.toolbox(
    config.tools, view=wiring.agent_view(agent_cfg), addr_dir=run / RETRIEVAL_ADDRS
  )
  sampling = SamplingParams(temperature=config.temperature)
  limits = Limits(llm_timeout_s=config.driver.request_timeout_s, tool_timeout_s=60.0)

  def make_agent(client: GenerationClient, tools: ToolBox | None) -> Agent:
    return agent_cls(
      client=client, tokenizer=policy.tokenizer, toolbox=tools, config=agent_cfg,
      sampling=sampling, limits=limits,
    )  # fmt: skip

  reward = config.reward
  if reward == "auto":
    reward = "answer" if policy.pretrained else "smoke"
    log.info("reward: %s (%s policy)", reward, "loaded" if policy.pretrained else "random")
  if scorer is None:
    scorer = smoke_scorer if reward == "smoke" else answer_scorer(reward_lib.RewardConfig())
  engine_stats = drv.stats if remote is None else remote.stats
  controller = RolloutController(
    config=config.rollout,
    items=items,
    agents=AgentSource(
      factory=make_agent,
      # Remote: one server per group, so the group's prompt pages are shared there.
      client=(lambda group: drv) if remote is None else remote.client_for_group,
      group_done=None if remote is None else remote.group_done,
      toolbox=toolbox,
      stop_token_ids=policy.tokenizer.stop_token_ids,
    ),
    staleness=staleness,
    replay=replay,
    scorer=scorer,
    engine_stats=engine_stats,
    episode_log=episode_log,
    resume_log=ResumeLog(local / RESUME_LOG),
  )
  if not (run / "tokenizer" / "tokenizer.json").exists():  # the vocabulary of the exported ids
    policy.tokenizer.save(run / "tokenizer")
  if not (run / POLICY_CONFIG).exists():  # with the tokenizer: all `asearcher export` needs
    (run / POLICY_CONFIG).write_text(json.dumps(to_hf_config(policy.module.cfg), indent=2) + "\n")
  ckpt = Checkpointer(checkpoint_config(config, run))
  writer = MetricWriter(local / "metrics", config=config.metrics)
  trainer = Trainer(
    config=_trainer_config(config, _sampler_tag(config, eng, params)),
    learner=learner,
    replay=replay,
    staleness=staleness,
    weight_sync=InProcessWeightSync(drv) if remote is None else remote,
    rollout=controller,
    checkpointer=ckpt,
    writer=writer,
    engine_stats=engine_stats,
    learner_step=drv.learner_step if remote is None else None,
  )
  return TrainRun(
    config=config, tokenizer=policy.tokenizer, engine=eng, driver=drv, learner=learner,
    staleness=staleness, replay=replay, rollout=controller, trainer=trainer, checkpointer=ckpt,
    writer=writer, run_dir=run, toolbox=toolbox, remote=remote, logs=logs,
  )  # fmt: skip


def _follower_run(
  config: TrainConfig, run: Path, policy: wiring.Policy, learner: Learner, graphdef: nnx.GraphDef
) -> TrainRun:
  """A non-lead process of a multi-process trainer: its share of the learner, the checkpoint
  and the weight store (each writes the shards its devices hold) and a trainer fed by process
  0's batches."""
  ckpt = Checkpointer(checkpoint_config(config, run))
  writer = MetricWriter(None)  # metrics are process 0's
  publisher = DirectoryWeightPublisher(config.remote.weights_dir, graphdef, config.remote.sync)
  trainer = Trainer(
    config=_trainer_config(config), learner=learner, replay=None, staleness=None,
    weight_sync=publisher, checkpointer=ckpt, writer=writer,
  )  # fmt: skip
  return TrainRun(
    config=config, tokenizer=policy.tokenizer, engine=None, driver=None, learner=learner,
    staleness=None, replay=None, rollout=None, trainer=trainer, checkpointer=ckpt, writer=writer,
    run_dir=run,
  )  # fmt: skip


def checkpoint_config(config: TrainConfig, run: Path) -> CheckpointConfig:
  """The run's checkpoints: `config.checkpoint_dir` as given (a gs:// URL stays a URL), else
  <run>/checkpoints; `config.checkpoints_kept` of them."""
  directory = config.checkpoint_dir or str(run / "checkpoints")
  return CheckpointConfig(directory=directory, max_to_keep=config.checkpoints_kept)


def _sampler_tag(config: TrainConfig, eng: Any, params: Any) -> str:
  """Which engine path and weight dtype sample the tokens, naming the agreement metrics:
  fixed / paged-gather / paged-ragged / paged-ragged_reference (in process), remote-<dtype of
  the published versions> (serve-model servers)."""
  if eng is None:
    dtype = config.remote.sync.dtype
    return f"remote.{jnp.dtype(dtype).name if dtype else 'asloaded'}"
  path = "fixed" if eng.cfg.kv_layout == "fixed" else f"paged-{eng.paged_attention}"
  floats = [x.dtype for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
  return f"{path}.{jnp.dtype(floats[0]).name if floats else 'unknown'}"


def _trainer_config(config: TrainConfig, tag: str = "engine") -> TrainerConfig:
  return TrainerConfig(
    train_steps=config.train_steps,
    batch_groups=config.staleness.batch_groups,
    checkpoint_every=config.checkpoint_every,
    batch_timeout_s=config.batch_timeout_s,
    sampler_tag=tag,
  )


# Library defaults throughout; gin/runs/train.gin binds the CPU-sized smoke run.
DEFAULT_CONFIG = TrainConfig()


def train(
  *,
  config: TrainConfig = DEFAULT_CONFIG,
  run_dir: str = "runs/train",
  model_dir: str | None = None,
  model: ModelConfig | None = None,
  tokenizer_dir: str | None = None,
  questions: str | None = None,
  max_questions: int | None = None,
  retrieval_index_dir: str | None = None,
) -> int:
  """Trains until `config.train_steps` (resuming from `run_dir` if it holds a checkpoint);
  prints a JSON summary as its last line and returns 0.

  Args:
    config: everything about how the run trains (`apps.train_config.TrainConfig`: engine,
      driver, agent, tools, rollout, replay, staleness, learner, remote engines).
    run_dir: checkpoints, the replay log, metrics (TensorBoard + JSONL) and the summary.
    model_dir: a Hugging Face Qwen2/Qwen3 checkpoint; None: a random `model` policy.
    model: architecture of the random policy (default: the qwen2-tiny preset).
    tokenizer_dir: tokenizer files; default: model_dir's, else the packaged Qwen2 vocabulary.
    questions: QA file (.json/.jsonl, optionally .gz); None: the shipped HotpotQA-100.
    max_questions: use only the first this many questions.
    retrieval_index_dir: the index the run's own retrieval server serves (local tools); None:
      the shipped corpus's BM25 index (built if needed).
  """
  if rehearsal.active():  # `asearcher rehearse`: this trainer's programs, compiled for its slice
    return rehearsal.trainer(config=config, model_dir=model_dir, model=model)
  t0 = time.time()
  run = build_run(
    config,
    run_dir=run_dir,
    policy=wiring.policy(
      model_dir=model_dir,
      model=model,
      tokenizer_dir=tokenizer_dir,
      seed=config.seed,
      # Several processes: a checkpoint is read straight into the learner's shardings.
      mesh=config.learner_mesh() if jax.process_count() > 1 else None,
    ),
    items=load_training_qa(questions, limit=max_questions),
  )
  try:
    resumed = run.start(retrieval_index_dir=retrieval_index_dir)
    print(
      f"[train] {'resumed at version ' + str(resumed) if resumed else 'fresh start'}", flush=True
    )
    last = run.trainer.run(max_seconds=config.max_seconds)
  finally:
    run.close()
  summary = {
    "version": run.learner.version,
    "resumed_from": resumed,
    "agent": config.agent.name,
    "reward": last.get("rollout/reward"),
    "loss": last.get("ppo/loss"),
    "staleness_head_max": last.get("staleness/head_max"),
    "trainer_idle_frac": last.get("perf/trainer_idle_frac_cum"),
    "groups_trained": sum(len(x) for x in run.trainer.trained_ids),
    "tool_cache_hits": last.get("tools/cache/hits"),
    "tool_cost_usd": last.get("tools/cost_usd"),
    "seconds": round(time.time() - t0, 1),
  }
  print(json.dumps(summary), flush=True)
  return 0
