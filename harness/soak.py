"""A soak of asynchronous RL under tool faults: many steps of a tiny policy, restarts included.

The real run (`apps.train.build_run`: in-process engine, rollout controller, replay queue,
learner, a weight update every step, Orbax checkpoints) trains against the real BM25 retrieval
server on 127.0.0.1 seen through a `harness.faults.FaultProxy` that breaks a set fraction of
tool requests (429, 500, timeouts, truncated and non-UTF-8 bodies, dropped connections). The run
is closed and rebuilt from its directory `restarts` times, and the retrieval server is stopped
and started again (on a new port) once per life. Afterwards the run directory alone is audited
(`rl.audit`): no group lost or trained twice, no trained token older than eta.
Operators' questions answered: does it hang after a few hundred steps, does memory grow, does
staleness stay bounded across restarts.

A project harness, not a user command (it steers a random policy and breaks its tools on
purpose): `benchmarks/reliability.py` (the `soak` part) and tests/reliability/test_soak.py run it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import traceback
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
from asearcher_jax.rl.audit import audit_run
from asearcher_jax.rl.rollout import RolloutConfig
from asearcher_jax.rl.staleness import StalenessConfig
from asearcher_jax.serving.driver import DriverConfig
from asearcher_jax.serving.engine import EngineConfig
from asearcher_jax.tools.http_retry import RetryConfig
from asearcher_jax.tools.retrieval.index import load_index
from asearcher_jax.tools.retrieval.server import RetrievalServer, RetrievalServerConfig
from asearcher_jax.tools.search import LocalRetrievalConfig
from harness.agent_workload import LogNormal, SafeRng, SteeringClient
from harness.faults import FaultConfig, FaultProxy, LoopThread

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
  max_seconds: wall-clock budget of the whole soak (None: none): each life gets an equal share
    and ends after the step that crosses it, so fewer steps may run (reported as `steps`).
  """

  steps: int = 300
  restarts: int = 2
  eta: int = 1
  tool_fault_rate: float = 0.1
  server_outage_s: float = 2.0
  hang_s: float = 300.0
  seed: int = 0
  max_seconds: float | None = None


def rss_mb() -> float:
  """This process's resident set size (Linux /proc)."""
  for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith("VmRSS:"):
      return int(line.split()[1]) / 1024.0
  return float("nan")


def rss_slope_per_100(samples: list[tuple[int, int, float]]) -> float:
  """Least-squares slope of RSS (MB) against step, per 100 steps, within each life (a restart
  in the same process builds a new engine and learner: that step is reported apart, as
  `rss_mb_per_life`), averaged over lives weighted by their steps; the first fifth of each
  life (compilation, caches filling) is left out. NaN with too few steps."""
  slopes, weights = [], []
  for life in sorted({s[0] for s in samples}):
    pts = [(v, mb) for n, v, mb in samples if n == life]
    pts = pts[len(pts) // 5 :]
    if len(pts) >= 4:
      x, y = np.asarray(pts, float).T
      slopes.append(float(np.polyfit(x, y, 1)[0] * 100.0))
      weights.append(len(pts))
  return float(np.average(slopes, weights=weights)) if slopes else float("nan")


def rss_windows(samples: list[tuple[int, int, float]], width: int = 100) -> list[list[float]]:
  """[life, first step, mean MB] of each `width`-step window: where growth happens (compilation
  and caches early in a life, or steadily: a leak), which one slope cannot tell."""
  windows: dict[tuple[int, int], list[float]] = {}
  for n, v, mb in samples:
    windows.setdefault((n, (v - 1) // width * width + 1), []).append(mb)
  return [[n, v, round(float(np.mean(mbs)), 1)] for (n, v), mbs in sorted(windows.items())]


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


def steer(run: commands.TrainRun, seed: int) -> None:
  """Every episode makes two searches then answers (`harness.agent_workload.SteeringClient`;
  every sampled token is still the engine's): a random policy alone never calls a tool, so the
  faults would never be met."""
  rng, out_len = SafeRng(seed), LogNormal(median=8, sigma=0.5, low=2, high=16)
  drv, tok = run.driver, run.tokenizer
  run.rollout.agents = dataclasses.replace(
    run.rollout.agents,
    client=lambda group: SteeringClient(drv, tok, k=2, rng=rng, output_len=out_len, tag="Paris"),
  )


def soak_train_config(config: SoakConfig, steps: int, tools_addr: str) -> TrainConfig:
  retry = RetryConfig(timeout_s=2.0, max_attempts=4, backoff_s=0.05, max_backoff_s=0.5)
  return TrainConfig(
    train_steps=steps, batch_timeout_s=config.hang_s, reward="smoke",
    staleness=StalenessConfig(batch_groups=1, max_staleness=config.eta, max_concurrent=2),
    engine=EngineConfig(max_slots=4, max_seq_len=2048, prefill_buckets=(1024,)),
    driver=DriverConfig(request_timeout_s=120.0),
    agent=AgentChoice(
      configs={"asearcher": AsearcherAgentConfig(max_turns=6, max_new_tokens=48, max_tokens=2048)}
    ),
    tools=wiring.ToolsConfig(local=LocalRetrievalConfig(addresses=(tools_addr,), retry=retry)),
    rollout=RolloutConfig(group_size=2, episode_timeout_s=300.0, max_env_retries=2),
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
  rss: list[tuple[int, int, float]] = []  # (life, version, MB)
  out: dict[str, Any] = {"hangs": 0, "errors": [], "lives": 0, "resumed_at": []}
  items = load_training_qa(limit=64)
  t0 = time.monotonic()
  try:
    for life, end in enumerate(bounds):
      run = commands.build_run(
        soak_train_config(config, end, tools.proxy.address), run_dir=str(run_dir),
        policy=wiring.policy(model=SOAK_MODEL, tokenizer_dir=tokenizer_dir), items=items,
      )  # fmt: skip
      steer(run, config.seed + life)
      # The server outage comes after the life's second step (set at start; sooner in short lives).
      outage_at = [1 << 30]
      restart: list[threading.Thread] = []

      def on_step(m: dict[str, float], run=run, restart=restart, at=outage_at, n=life) -> None:
        rss.append((n, run.learner.version, rss_mb()))
        if config.server_outage_s > 0 and run.learner.version >= at[0] and not restart:
          restart.append(tools.outage(config.server_outage_s))

      try:
        out["resumed_at"].append(run.start())
        outage_at[0] = min(run.learner.version + 2, end - 1)
        share = None if config.max_seconds is None else config.max_seconds / lives
        run.trainer.run(on_step=on_step, max_seconds=share)
      except TimeoutError as e:  # no batch within hang_s
        out["hangs"] += 1
        where = traceback.extract_tb(e.__traceback__)[-1]  # an empty message names no place
        out["errors"].append(
          f"life {life}: {e!r} at {where.filename}:{where.lineno} ({where.name})"
        )
        log.warning("soak life %d ended on a timeout", life, exc_info=e)
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
    rss_mb_per_life=[round(max(mb for n, _, mb in rss if n == i), 1) for i in sorted({r[0] for r in rss})],
    rss_mb_last=rss[-1][2] if rss else float("nan"), rss_slope_mb_per_100_steps=rss_slope_per_100(rss),
    rss_mb_per_100_steps=rss_windows(rss),
  )  # fmt: skip
  return out
