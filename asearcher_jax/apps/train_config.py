"""What `asearcher train` runs: one frozen config per part, nested in `TrainConfig`.

Each part keeps its own library defaults (EngineConfig, DriverConfig, ...); the CPU-sized values
of the smoke run live in one place, gin/runs/train.gin, which binds every part, so a single
binding (`staleness.StalenessConfig.max_staleness = 0`) changes one thing. Every program that
runs RL takes one (the quickstart's and long-horizon's `rl`, bound the same way in their
recipes), so a knob has the same name in each. `build_run` combines
the config with the runtime objects (policy, questions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import jax
from jax.sharding import Mesh

from asearcher_jax.agent import registry
from asearcher_jax.apps.wiring import ToolsConfig
from asearcher_jax.metric_writer import MetricWriterConfig
from asearcher_jax.model.sharding import MeshConfig
from asearcher_jax.model.steps import OptimizerConfig
from asearcher_jax.rl.learner import PPOConfig
from asearcher_jax.rl.losses import OffPolicyConfig
from asearcher_jax.rl.replay import ReplayConfig
from asearcher_jax.rl.rollout import RolloutConfig
from asearcher_jax.rl.staleness import StalenessConfig
from asearcher_jax.rl.weight_sync import WeightSyncConfig
from asearcher_jax.serving.client import RemoteClientConfig
from asearcher_jax.serving.driver import DriverConfig
from asearcher_jax.serving.engine import EngineConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentChoice:
  """Which registered agent is trained (`agent.registry`), with its config."""

  # "asearcher", "reasoning" or "search_r1" (or an alias the registry accepts).
  name: str = "asearcher"
  # Agent configs by agent name (AsearcherAgentConfig, ...), so switching `name` switches budgets
  # too; an agent without an entry takes its own defaults.
  configs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self) -> None:
    registry.resolve(self.name, self.config)  # an unknown agent or a config of another one

  @property
  def config(self) -> Any:
    """The chosen agent's config (None: its defaults)."""
    return self.configs.get(registry.ALIASES.get(self.name, self.name))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LearnerConfig:
  """The decoupled-PPO learner and its optimizer."""

  # Loss, normalisation and packing; None: the defaults with row_len = the engine's context and
  # the sampling temperature. Given, its temperature must be the sampling temperature.
  ppo: PPOConfig | None = None
  # AdamW and its schedule.
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  # The off-policy correction (decoupled PPO, truncated / masked IS, IcePop), bindable without
  # spelling out `ppo`; None: the PPOConfig's own (decoupled PPO, mask at 5).
  off_policy: OffPolicyConfig | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemoteEnginesConfig:
  """Generation on `asearcher serve-model` servers instead of the in-process engine."""

  # Address files of the servers (one server per group, least loaded); (): in-process engine.
  address_files: tuple[str, ...] = ()
  # Where each policy version is published for them (each server's own weights_dir): a weight
  # store both sides read (a local directory on one host; a shared filesystem or gs://bucket/dir
  # on a pod).
  weights_dir: str | None = None
  # How versions are published: their dtype (bf16 by default), versions kept, write timeout.
  sync: WeightSyncConfig = dataclasses.field(default_factory=WeightSyncConfig)
  # Longest wait at start for every server to load the trainer's weights.
  wait_s: float = 600.0
  # Timeouts and retries of the calls to the servers; None: the driver's request timeout and 6
  # retries backing off up to 8 s (a server restarted on the same address file is found again;
  # then the episode fails as an environment failure, retried per the rollout config).
  client: RemoteClientConfig | None = None

  @property
  def enabled(self) -> bool:
    return bool(self.address_files)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  """Asynchronous RL of a search agent (see `apps.train`); every part bindable from gin."""

  # Stop once the policy version reaches this (a resumed run counts on).
  train_steps: int = 4
  # Wall-clock budget of the training loop in seconds (steps end at the first one past it), for
  # fixed-time runs like the quickstart; None: train_steps alone.
  max_seconds: float | None = None
  # Checkpoint (and commit the consumed groups) every this many steps; 0 = never.
  checkpoint_every: int = 1
  # Checkpoints kept (older ones deleted); each holds 12 bytes a parameter (fp32 master weights
  # and Adam moments: `asearcher plan` states the GB and seconds of a recipe's).
  checkpoints_kept: int = 2
  # On an accelerator, compile the learner's step for this host's devices before anything else
  # starts and refuse a program that does not fit a device's memory (`apps.train.check_fit`);
  # CPU hosts have no fixed device memory and skip it.
  check_fit: bool = True
  # Where checkpoints go; None: <run_dir>/checkpoints. A gs:// URL goes to Orbax as it is (its
  # tensorstore GCS driver writes every host's shards; no gcsfuse mount on the path).
  checkpoint_dir: str | None = None
  # Where the run's logs are appended; None: <run_dir> itself. On a pod, whose run_dir is a
  # bucket mount (no appends there: gcsfuse re-uploads the whole object at every flush), a local
  # disk: the replay logs are shipped to <run_dir>/replay in sealed segments before each
  # checkpoint and at each commit; the episode export (segments), the resume log and metrics/
  # (whole files) every minute and at the end (`storage.ShippedLogs`); all rebuilt from there
  # where the local disk is gone.
  journal_dir: str | None = None
  # Fail if no batch of accepted groups arrives within this long.
  batch_timeout_s: float = 600.0
  # "answer": the ASearcher F1 reward; "smoke": the even-token fraction, for random policies that
  # never answer; "auto": answer for a loaded checkpoint, else smoke.
  reward: Literal["auto", "answer", "smoke"] = "auto"
  # Sampling temperature (the learner recomputes logprobs at the same one).
  temperature: float = 1.0
  # Init seed of a random policy.
  seed: int = 0
  # B (groups per step), eta (max staleness; 0 = synchronous) and groups in flight.
  staleness: StalenessConfig = dataclasses.field(
    default_factory=lambda: StalenessConfig(batch_groups=2)
  )
  # The in-process engine (with remote servers its max_seq_len still sets the learner's rows).
  engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
  # The engine driver (request timeout, prefix reuse, what a weight update does to the KV cache).
  driver: DriverConfig = dataclasses.field(default_factory=DriverConfig)
  # The trained agent.
  agent: AgentChoice = dataclasses.field(default_factory=AgentChoice)
  # The agents' tools: local retrieval, the web, or none.
  tools: ToolsConfig = dataclasses.field(default_factory=ToolsConfig)
  # The rollout controller: group size n, episode timeout, failure policy, curriculum.
  rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
  # The replay queue; its log lives in the run directory (leave `directory` unset), and an unset
  # max_head_staleness is eta (the hard staleness bound).
  replay: ReplayConfig = dataclasses.field(default_factory=ReplayConfig)
  # Decoupled PPO and AdamW.
  learner: LearnerConfig = dataclasses.field(default_factory=LearnerConfig)
  # Generation on serve-model servers (disaggregated); unset: the in-process engine.
  remote: RemoteEnginesConfig = dataclasses.field(default_factory=RemoteEnginesConfig)
  # The learner's (data, fsdp, tensor) mesh over every process's devices (-1 fills); None: one
  # device, or every device on fsdp when the program has several processes (jax.distributed).
  mesh: MeshConfig | None = None
  # Where metrics go besides <run_dir>/metrics/metrics.jsonl: TensorBoard (on by default) and
  # an optional W&B run (`metric_writer.WandbConfig`), both from process 0 only.
  metrics: MetricWriterConfig = dataclasses.field(default_factory=MetricWriterConfig)

  def __post_init__(self):
    if self.checkpoints_kept < 1:
      raise ValueError(f"checkpoints_kept must be >= 1, got {self.checkpoints_kept}")
    if self.reward not in ("auto", "answer", "smoke"):
      raise ValueError(f"reward must be 'auto', 'answer' or 'smoke', got {self.reward!r}")
    if self.replay.directory is not None:
      raise ValueError("replay.directory is the run's own (run_dir/replay): leave it unset")
    ppo = self.learner.ppo
    if ppo is not None and ppo.temperature != self.sampling_temperature:
      raise ValueError(
        f"learner.ppo.temperature {ppo.temperature} differs from the sampling temperature "
        f"{self.temperature}: the learner's logprobs must be the sampler's"
      )

  @property
  def sampling_temperature(self) -> float:
    """The temperature the learner recomputes logprobs at (0 stands for greedy)."""
    return max(self.temperature, 1e-6)

  def ppo(self) -> PPOConfig:
    """The learner's PPO settings (`learner.ppo`, else derived from the engine and sampling)."""
    ppo = self.learner.ppo or PPOConfig(
      row_len=self.engine.max_seq_len, temperature=self.sampling_temperature
    )
    if self.learner.off_policy is not None:
      ppo = dataclasses.replace(ppo, off_policy=self.learner.off_policy)
    return ppo

  def learner_mesh(self) -> Mesh | None:
    """The learner's mesh (see `mesh`); builds nothing for one device in one process."""
    if self.mesh is None and jax.process_count() == 1:
      return None
    return (self.mesh or MeshConfig()).build()

  def replay_config(self, directory: str) -> ReplayConfig:
    """The replay queue's config, its log in `directory`."""
    head = self.replay.max_head_staleness
    return dataclasses.replace(
      self.replay,
      directory=directory,
      max_head_staleness=self.staleness.max_staleness if head is None else head,
    )
