"""A soak of asynchronous RL under tool faults: many steps of a tiny policy, restarts included.

The real run (`apps.train.build_run`: in-process engine, rollout controller, replay queue,
learner, a weight update every step, Orbax checkpoints) trains against the real BM25 retrieval
server on 127.0.0.1 seen through a `testing.faults.FaultProxy` that breaks a set fraction of
tool requests (429, 500, timeouts, truncated and non-UTF-8 bodies, dropped connections). The run
is closed and rebuilt from its directory `restarts` times, and the retrieval server is stopped
and started again (on a new port) once per life. Afterwards the run directory alone is audited
(`testing.run_audit`): no group lost or trained twice, no trained token older than eta.
Operators' questions answered: does it hang after a few hundred steps, does memory grow, does
staleness stay bounded across restarts.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from asearcher_jax.agent import AsearcherAgentConfig
from asearcher_jax.apps import train as commands
from asearcher_jax.apps import wiring
from asearcher_jax.apps.train_config import AgentChoice, LearnerConfig, TrainConfig
from asearcher_jax.data.qa import load_training_qa
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.model.steps import OptimizerConfig
from asearcher_jax.rl.rollout import RolloutConfig
from asearcher_jax.rl.staleness import StalenessConfig
from asearcher_jax.serving.driver import DriverConfig
from asearcher_jax.serving.engine import EngineConfig
from asearcher_jax.testing.faults import FaultConfig, FaultProxy, LoopThread
from asearcher_jax.testing.run_audit import audit_run
from asearcher_jax.tools.http_retry import RetryConfig
from asearcher_jax.tools.retrieval.index import load_index
from asearcher_jax.tools.retrieval.server import RetrievalServer, RetrievalServerConfig
from asearcher_jax.tools.search import LocalRetrievalConfig

log = logging.getLogger(__name__)

# A byte-level policy (259 ids) small enough for hundreds of CPU steps.
SOAK_MODEL = ModelConfig(
  vocab_size=260, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
  num_kv_heads=2, rope_theta=10000.0, max_position_embeddings=4096,
)  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class SoakConfig:
  """Attributes:
  steps: RL steps in all (one group per step, B = 1).
  restarts: times the run is closed and rebuilt from its directory (lives = restarts + 1).
  eta: the staleness bound checked from the trained tokens' versions.
  tool_fault_rate: fraction of tool requests the proxy breaks.
  server_outage_s: once per life the retrieval server is stopped this long (0: never).
  hang_s: a step that takes longer than this counts as a hang (and ends the soak).
  seed: seeds the faults.
  """

  steps: int = 300
  restarts: int = 2
  eta: int = 1
  tool_fault_rate: float = 0.1
  server_outage_s: float = 2.0
  hang_s: float = 300.0
  seed: int = 0


def rss_mb() -> float:
  """This process's resident set size (Linux /proc)."""
  for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith("VmRSS:"):
      return int(line.split()[1]) / 1024.0
  return float("nan")


def rss_slope_per_100(samples: list[tuple[int, float]]) -> float:
  """Least-squares slope of RSS (MB) against step, per 100 steps; the first life's first tenth
  (compilation, caches filling) is left out."""
  if len(samples) < 4:
    return float("nan")
  skip = max(1, len(samples) // 10)
  x, y = np.asarray(samples[skip:], float).T
  return float(np.polyfit(x, y, 1)[0] * 100.0)


class _Tools:
  """The retrieval server (restartable) behind a fault proxy, on their own loop thread."""

  def __init__(self, index_dir: str, faults: FaultConfig) -> None:
    self.loop = LoopThread()
    self.index = load_index(Path(index_dir))
    self.server: RetrievalServer | None = None
    self.addr: str | None = None
    self.restarts = 0
    self.proxy = FaultProxy(lambda: self.addr, faults)
    self.loop.run(self.proxy.start())
    self._start()

  def _start(self) -> None:
    server = RetrievalServer(self.index, RetrievalServerConfig(port=0))
    port = self.loop.run(server.start())
    self.server, self.addr = server, f"127.0.0.1:{port}"

  def outage(self, seconds: float) -> threading.Thread:
    """Stops the server now and starts a new one (another port) after `seconds`."""
    server, self.addr = self.server, None
    self.loop.run(server.stop())

    def back() -> None:
      time.sleep(seconds)
      self._start()
      self.restarts += 1

    t = threading.Thread(target=back, name="retrieval-restart", daemon=True)
    t.start()
    return t

  def close(self) -> None:
    if self.server is not None:
      self.loop.run(self.server.stop())
    self.loop.run(self.proxy.stop())
    self.loop.close()


def soak_train_config(config: SoakConfig, steps: int, tools_addr: str) -> TrainConfig:
  retry = RetryConfig(timeout_s=2.0, max_attempts=4, backoff_s=0.05, max_backoff_s=0.5)
  return TrainConfig(
    train_steps=steps, batch_timeout_s=config.hang_s, reward="smoke",
    staleness=StalenessConfig(batch_groups=1, max_staleness=config.eta, max_concurrent=2),
    engine=EngineConfig(max_slots=4, max_seq_len=2048, prefill_buckets=(1024,)),
    driver=DriverConfig(request_timeout_s=120.0),
    agent=AgentChoice(
      configs={"asearcher": AsearcherAgentConfig(max_turns=2, max_new_tokens=24, max_tokens=2048)}
    ),
    tools=wiring.ToolsConfig(local=LocalRetrievalConfig(addresses=(tools_addr,), retry=retry)),
    rollout=RolloutConfig(group_size=2, episode_timeout_s=60.0, max_env_retries=2),
    learner=LearnerConfig(optimizer=OptimizerConfig(learning_rate=1e-3, weight_decay=0.0)),
  )  # fmt: skip


def run_soak(
  config: SoakConfig, *, run_dir: str | Path, tokenizer_dir: str, index_dir: str
) -> dict[str, Any]:
  """Runs the soak; returns its figures (see `benchmarks/reliability.py`)."""
  run_dir = Path(run_dir)
  tools = _Tools(index_dir, FaultConfig(rate=config.tool_fault_rate, seed=config.seed, hang_s=3.0))
  lives = config.restarts + 1
  bounds = [round(config.steps * (i + 1) / lives) for i in range(lives)]
  rss: list[tuple[int, float]] = []
  out: dict[str, Any] = {"hangs": 0, "errors": [], "lives": 0, "resumed_at": []}
  items = load_training_qa(limit=64)
  t0 = time.monotonic()
  try:
    for life, end in enumerate(bounds):
      run = commands.build_run(
        soak_train_config(config, end, tools.proxy.address), run_dir=str(run_dir),
        policy=wiring.policy(model=SOAK_MODEL, tokenizer_dir=tokenizer_dir), items=items,
      )  # fmt: skip
      outage_at = run.learner.version + max(1, (end - run.learner.version) // 2)
      restart: list[threading.Thread] = []

      def on_step(m: dict[str, float], run=run, outage_at=outage_at, restart=restart) -> None:
        rss.append((run.learner.version, rss_mb()))
        if config.server_outage_s > 0 and run.learner.version == outage_at and not restart:
          restart.append(tools.outage(config.server_outage_s))

      try:
        out["resumed_at"].append(run.start())
        run.trainer.run(on_step=on_step)
      except TimeoutError as e:  # no batch within hang_s
        out["hangs"] += 1
        out["errors"].append(f"life {life}: {e}")
        break
      finally:
        run.close()
        for t in restart:
          t.join(config.server_outage_s + 30)
      out["lives"] += 1
      out.setdefault("rollout", []).append(run.rollout.metrics(reset=False))
  finally:
    tools.close()
  audit = audit_run(run_dir)
  rollout = out.pop("rollout", [])
  tool_failures = sum(m.get("tools/failures", 0.0) for m in rollout)
  out.update(
    steps=audit.committed, seconds=round(time.monotonic() - t0, 1), eta=config.eta,
    max_staleness=audit.max_staleness, lost_groups=audit.lost,
    duplicated_groups=audit.duplicated, versions_backwards=audit.versions_backwards,
    faults_injected=tools.proxy.faults_injected, fault_kinds=dict(tools.proxy.injected),
    upstream_down_502=tools.proxy.upstream_errors, server_restarts=tools.restarts,
    tool_failures=tool_failures,
    env_failures=sum(m.get("rollout/env_failures", 0.0) for m in rollout),
    rss_mb_first=rss[0][1] if rss else float("nan"), rss_mb_last=rss[-1][1] if rss else float("nan"),
    rss_slope_mb_per_100_steps=rss_slope_per_100(rss),
  )  # fmt: skip
  return out
