"""Asynchronous (eta = 4) vs synchronous (eta = 0) RL on the same agent workload, in one run.

Runs with no arguments (10 steps per mode plus ~2 minutes of compile warm-up; 8-15 minutes on 2
busy CPU cores; `--steps`, `--batch-groups`, ... scale it, `--verbose` logs every step). Both
modes train the same number of steps with the same batch (B = 4 groups of n = 4 episodes) on
the same objects -- one engine + driver, one learner (engine buckets and every learner row
bucket compiled once up front, or on first use with `--no-warmup`: the engine's busy seconds
exclude its compile seconds either way; weights reset to the same init before each mode) --
through the real `Trainer`, `RolloutController`, `StalenessManager`, in-memory `ReplayQueue`
(hard eta bound on) and in-process weight sync; no checkpoints in either mode. Synchronous
mode is the same code path with eta = 0 and max_concurrent = B: exactly B groups per version,
the trainer waits for all of them. Asynchronous mode: eta = 4, max_concurrent = 20 groups (80
episodes), the most the staleness rule ever admits ((eta + 1) x B), so that rule alone bounds
what is in flight.

Workload (chosen to resemble ASearcher's training rollouts, scaled to a CPU):
  policy    a random 2-layer model (hidden 32) over a byte-level vocabulary (260 ids), sampled at
            temperature 1 by the in-process engine (continuous batching, 80 slots, 2048-token
            context); every sampled token is the engine's.
  agent     the real `AsearcherAgent` loop (act/read turns, stops, tool-result rendering, context
            policy) with a shortened prompt (~230 byte tokens instead of ~1.1k, so that learner
            and prefill cost fit a CPU), steered by `harness.agent_workload.SteeringClient`: an
            episode makes K searches then answers (a random policy never writes the tags). One
            search = an act turn, the tool call, a read turn: an episode is 2K + 1 LLM calls.
  K         per episode, log-normal with median 3 and sigma 0.9, rounded and clipped to [1, 12]:
            most episodes make 1-4 searches, ~15% make 8 or more, ~7% hit the cap (25 LLM
            turns). ASearcher's trajectories are likewise mostly short with a tail to tens of
            turns (its turn limit is 128; our 2048-token context sets the cap).
  output    tokens per LLM call: log-normal, median 12, sigma 0.6, clipped to [4, 32].
  tools     an in-process search stub (`LatencySearch`) whose latency per call is log-normal,
            median 1.0 s, sigma 0.7, clipped to [0.05, 8] s (p90 ~2.5 s, p99 ~5 s: a web search
            API with a heavy tail). This is wall-clock waiting, which asynchronous RL overlaps.
  reward    the stand-in "smoke" reward (fraction of even token ids, `apps.train.smoke_scorer`):
            varied within every group, so groups pass the zero-variance filter and the learner
            does real PPO updates. A random policy cannot earn an answer reward.
  learner   decoupled PPO (prox logprobs recomputed), 4 minibatches (optimizer steps) per
            training step, packed rows of 2048 tokens.

Reported per mode: wall time of `Trainer.run()` (first batch included: end to end), trained
tokens/s (sum of `ppo/tokens` / wall), trainer idle fraction (time waiting for a batch / wall),
mean engine slot occupancy (sampled every 20 ms), generated tokens/s, staleness max from the
token versions the learner trained on, episodes and tool calls. speedup = async trained
tokens/s / sync trained tokens/s; also the steady-state ratio (steps after the first).

Caveat (one machine, no accelerator): the engine thread and the learner share the CPU, so in
async mode generation and training steps slow each other down -- unlike AReaL, where generation
and training run on separate GPUs. An LLM call that continues its episode's previous call is
admitted into that call's parked slot and prefills only the new suffix (driver prefix reuse,
`--no-prefix-reuse` turns it off; hits, reused and prefilled tokens are reported per mode under
"prefix"). The engine has one slot per episode that async mode keeps in flight (20 groups x 4
= 80), so an episode's parked slot is not reclaimed while it waits for a tool: measured with 16
slots, async mode re-prefilled 3x more prompt tokens (1,186 evictions in 10 steps) and the
speedup was 1.97x instead of 2.75x. By default (`DriverConfig.kv_on_update="recompute"`, AReaL)
every weight update re-prefills all in-flight slots and forgets the parked ones, so an episode's
next turn after an update prefills its whole context again; `--kv-on-update keep` (PipelineRL)
keeps both, and `--kv-on-update both` runs the async mode once with each, side by side (under
"keep" in the JSON). Generation here is compute-heavy, and async mode can only win what sync mode leaves
idle (tool waits, the long-tail barrier). Decode steps compute only the live
slots (`EngineConfig.decode_rows`, 8, 16 and 32 rows of the 80; ~8.5 rows per step on average here):
that took the async run from 54 s to 44 s (train step 3.2 -> 2.6 s, since the learner shares the
cores). The per-mode "engine" entry gives prefill, weight-update and decode seconds, and the
engine thread's busy seconds per trained token. By default (`--engine-settings both`) the async
mode runs twice, with the new engine settings (up to 8 decode steps per call,
`EngineConfig.decode_steps_per_call`, `--decode-steps`; suffix prefills of turns that arrive
together in one call, `EngineConfig.suffix_batch`; an update's re-prefills batched by bucket,
`DriverConfig.batch_reprefill`; a turn that continues its last call with nothing new admitted
with no prefill, `DriverConfig.continue_in_decode`) and with the old ones (one call per slot for
each), and
"engine_settings" in the JSON compares them (issue 27's bar: new busy per trained token <= 0.6 x
old). The last line is one JSON object.

`--engine process` runs async mode's engine as a separate program, the pod layout: the real
`serve-model` in a child process (OpenAI facade on loopback, its own XLA runtime and GIL), the
agents calling it over HTTP, each new version written to a weights directory that the server
polls (`serve(weights_dir=...)`); sync mode stays in process (colocated, like sync AReaL).
`--engine-cpus 0-7` pins the server to those cores and the trainer process to the rest (AReaL's
disjoint inference/training devices). On this 2-core machine it does not pay: 20 steps, hidden
32, recompute, measured 2026-11-24 (async only): in-process thread 76.9 s, idle 0.29; process
sharing both cores 110.0 s, idle 0.40; process pinned 1 + 1 cores 130.9 s, idle 0.44 (HTTP and
JSON per LLM call, a second GIL, and a one-core engine). It is there for machines with cores to
split.

What bounds async mode's trainer idle here is the staleness rule, not the engine. The rule keeps
at most (eta + 1) x B = 20 groups in flight, and a group is done when its slowest episode is
(K searches x ~1.3 s of tool wait, plus its LLM calls), so by Little's law it delivers B groups
per step only while the mean group latency stays under (eta + 1) train steps. Each mode reports
`group_s_mean` (admission to acceptance) and `capacity_ratio` = (eta + 1) x train step / group
latency. Measured 2026-11-24, 10 steps: default workload 3.83x, idle 0.298 (steady 0.208), group
latency 10.2 s (max 18.9) against a 2.56 s train step, capacity_ratio 1.26; the same run with
`--tool-median-s 0.5`: 2.53x, idle 0.110, all of it the first batch (steady 0.0006), group
latency 6.8 s, capacity_ratio 1.87, with the engine thread as busy; and with `--tool-median-s
0.5 --steps 20` (first batch amortized): 2.72x with trainer idle 0.057 (steady 0.008), staleness
max 4, capacity_ratio 1.97 -- both targets in one run. A faster engine shortens
only the LLM share of a group's latency (the tool waits stay) and a faster trainer shortens the
step, so more cores alone do not close the gap; a real model's train step (minutes) against
the same tool latency does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import multiprocessing
import os
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax
import jax.numpy as jnp
from flax import nnx

from asearcher_jax import compile_cache
from asearcher_jax.agent import AsearcherAgent, AsearcherAgentConfig, Limits
from asearcher_jax.apps import serve_model as serving_commands
from asearcher_jax.apps.train import smoke_scorer
from asearcher_jax.data.qa import QAExample
from asearcher_jax.model import steps, transformer
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.model.loading import PolicyConfig
from asearcher_jax.rl.learner import Learner, PPOConfig
from asearcher_jax.rl.replay import Group, ReplayConfig, ReplayQueue
from asearcher_jax.rl.rollout import AgentSource, RolloutConfig, RolloutController
from asearcher_jax.rl.staleness import StalenessConfig, StalenessManager
from asearcher_jax.rl.trainer import Trainer, TrainerConfig
from asearcher_jax.rl.weight_sync import DirectoryWeightPublisher, InProcessWeightSync
from asearcher_jax.serving.client import RemoteClientConfig, RemoteGenerationClient, read_address
from asearcher_jax.serving.driver import KV_ON_UPDATE, Driver, DriverConfig
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.serving.types import SamplingParams
from asearcher_jax.tokenizer import Tokenizer
from asearcher_jax.tools.cache import CacheConfig, ToolCache
from asearcher_jax.tools.toolbox import ToolBox
from harness.agent_workload import (
  BYTE_VOCAB,
  LatencySearch,
  LogNormal,
  SafeRng,
  SteeringClient,
  write_byte_tokenizer,
)

MAX_SEQ = 2048
log = logging.getLogger(__name__)
# The real prompt is ~1.1k byte tokens; this one (~230) keeps CPU training cheap. The agent loop,
# stops, tool rendering and context handling are the real ones.
SHORT_PROMPT = (
  "A conversation between User and Assistant. The Assistant thinks, searches with <search> "
  "query </search>, reads the results in <information>, and gives the final answer as "
  "<answer> answer </answer>.\nUser: {question}\n\nAssistant: \n<think>"
)


class BenchAgent(AsearcherAgent):
  """The ASearcher agent with a shortened prompt (see SHORT_PROMPT)."""

  def prompt(self, question: str, valid_inst: bool) -> str:
    return SHORT_PROMPT.format(question=question)


# Searches per episode, tokens per LLM call, seconds per tool call (module docstring: why).
K_TOOLS = LogNormal(median=3.0, sigma=0.9, low=1, high=12)
OUTPUT_LEN = LogNormal(median=12.0, sigma=0.6, low=4, high=32)
TOOL_LATENCY = LogNormal(median=1.0, sigma=0.7, low=0.05, high=8.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
  """Everything both modes share (see the module docstring for why these values)."""

  steps: int = 10
  batch_groups: int = 4
  group_size: int = 4
  eta: int = 4
  async_concurrent: int = 20  # (eta + 1) x batch_groups: 12 gave 3.21x / idle 0.40 (keep)
  slots: int | None = None  # None: one per episode in flight in async mode (20 x 4 = 80)
  decode_rows: tuple[int, ...] = (8, 16, 32)  # EngineConfig.decode_rows; () decodes every slot
  prefill_buckets: tuple[int, ...] = (512, 1024)  # EngineConfig.prefill_buckets (+ 2048)
  minibatches: int = 4
  hidden: int = 32
  layers: int = 2
  k_tools: LogNormal = K_TOOLS
  output_len: LogNormal = OUTPUT_LEN
  tool_latency: LogNormal = TOOL_LATENCY
  seed: int = 0
  prefix_reuse: bool = True
  # DriverConfig.kv_on_update; "both": the async mode once with each, side by side.
  kv_on_update: str = "recompute"
  # Where async mode generates: "thread" (the in-process driver, as `asearcher train`) or
  # "process" (`serve-model` in a child process over loopback HTTP, new weights through a
  # versioned directory: the pod layout). Sync mode always runs in process (colocated).
  engine: str = "thread"
  # Engine settings of the async mode: "new" (the defaults: batched suffix prefills and
  # re-prefills), "old" (one prefill call per slot, as before 2026-11-26), "both": async mode once
  # with each, side by side (the figures of issue 27: engine busy seconds per trained token).
  engine_settings: str = "both"
  # The new settings' decode steps per generate call (EngineConfig.decode_steps_per_call); the
  # old settings run one step per call.
  decode_steps: int = 8
  engine_cpus: tuple[int, ...] = ()  # "process": the cores the engine gets; the trainer the rest
  # The engine thread's niceness (DriverConfig.thread_nice): > 0 gives the learner the cores
  # first when both compute (both modes run the same driver).
  engine_nice: int = 0
  # DriverConfig.yield_to_learner: the engine thread pauses while the learner steps ("auto": on
  # CPU, where the two share the cores).
  yield_to_learner: str = DriverConfig().yield_to_learner
  # DriverConfig.yield_share: the engine's share of the time while the learner steps.
  yield_share: float = DriverConfig().yield_share
  # Batches per mode whose learner step is timed again alone afterwards (`learner_alone`);
  # 0: none.
  alone_steps: int = 5
  # Compile every engine shape and learner bucket before the timed runs. False (smoke runs and
  # tests): shapes compile on first use, inside the runs, so the figures include compile time.
  warmup: bool = True


@dataclasses.dataclass
class Shared:
  """Objects both modes use: compiled once, state reset before each mode."""

  tokenizer: Tokenizer
  graphdef: nnx.GraphDef
  engine: Engine
  driver: Driver
  learner: Learner
  init_state: steps.TrainState
  init_params: nnx.State


class EngineServer:
  """The engine as a separate program (AReaL's disaggregated layout, on one host): a child
  process serving the policy over HTTP on loopback, fed new weights through a versioned
  directory. cpus: the cores it may use (the trainer process gets the others); None: shared."""

  def __init__(self, w: Workload, tmp: Path, cpus: set[int] | None) -> None:
    self.weights_dir = tmp / "weights"
    self.address_file = tmp / "engine.json"
    self.cpus = cpus
    every = os.sched_getaffinity(0)  # the cores this process may use, not all the host has
    self.trainer_cpus = (every - cpus) or every if cpus else None
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: its own XLA runtime
    self.process = ctx.Process(
      target=serving_commands.serve, name="engine-server", daemon=True,
      kwargs=dict(
        # the same random init as the learner: same config, same seed
        policy=PolicyConfig(model=model_config(w), tokenizer_dir=str(tmp / "tok"), seed=w.seed),
        engine=engine_config(w), driver=driver_config(w), address_file=str(self.address_file),
        weights_dir=str(self.weights_dir), weights_poll_s=0.01,
        warmup_modes=("sample",) if w.warmup else (), cpus=tuple(sorted(cpus or ())),
      ),
    )  # fmt: skip
    self.process.start()

  def wait_ready(self, timeout: float = 600.0) -> str:
    """Waits for the address file (written after the engine has compiled); the base URL."""
    deadline = time.monotonic() + timeout
    while not self.address_file.exists():
      if not self.process.is_alive():
        raise RuntimeError(f"engine server exited with code {self.process.exitcode}")
      if time.monotonic() > deadline:
        raise TimeoutError(f"engine server not ready after {timeout:g} s")
      time.sleep(0.2)
    return read_address(self.address_file)

  def stats(self) -> dict[str, float]:
    """The served driver's stats (its /health)."""
    with urllib.request.urlopen(f"{read_address(self.address_file)}/health", timeout=10) as r:
      return json.loads(r.read())["driver"]

  def stop(self) -> None:
    if self.process.is_alive():
      self.process.terminate()  # SIGTERM: serve-model shuts down cleanly
      self.process.join(60)
    if self.process.is_alive():
      self.process.kill()


def model_config(w: Workload) -> ModelConfig:
  return ModelConfig(
    vocab_size=BYTE_VOCAB, hidden_size=w.hidden, intermediate_size=2 * w.hidden,
    num_layers=w.layers, num_heads=4, num_kv_heads=2, rope_theta=10000.0,
    max_position_embeddings=MAX_SEQ,
  )  # fmt: skip


def row_buckets(w: Workload) -> tuple[int, ...]:
  """Powers of two up to the most rows one minibatch can need (whole groups per minibatch, at
  most one row per trajectory since a trajectory fits the 4096-token context)."""
  need = -(-w.batch_groups // w.minibatches) * w.group_size
  warm = tuple(1 << i for i in range(need.bit_length() + (need & (need - 1) != 0)))
  return (*warm, 2 * warm[-1])  # the last one: never expected, so not compiled in advance


def engine_config(w: Workload) -> EngineConfig:
  return EngineConfig(
    max_slots=w.slots or w.async_concurrent * w.group_size,
    max_seq_len=MAX_SEQ,
    prefill_buckets=w.prefill_buckets,
    decode_rows=w.decode_rows,
    suffix_batch=(1, 2, 4, 8),  # agents' next turns that arrive together: one call
    decode_steps_per_call=w.decode_steps,
  )


def driver_config(w: Workload) -> DriverConfig:
  return DriverConfig(
    request_timeout_s=600.0,
    prefix_reuse=w.prefix_reuse,
    kv_on_update="recompute" if w.kv_on_update == "both" else w.kv_on_update,
    thread_nice=w.engine_nice,
    yield_to_learner=w.yield_to_learner,
    yield_share=w.yield_share,
  )


def build_shared(w: Workload, tok_dir: Path) -> Shared:
  tokenizer = Tokenizer.from_dir(str(write_byte_tokenizer(tok_dir)))
  policy = transformer.Transformer(model_config(w), rngs=nnx.Rngs(w.seed))
  graphdef, params = nnx.split(policy)
  engine = Engine.from_model(policy, tokenizer, engine_config(w))
  driver = Driver(engine, driver_config(w))
  learner = Learner(
    graphdef,
    jax.tree.map(jnp.copy, params),  # the learner donates; the engine keeps its own
    ppo=PPOConfig(row_len=MAX_SEQ, ppo_n_minibatches=w.minibatches, row_buckets=row_buckets(w)),
    optimizer=steps.OptimizerConfig(learning_rate=1e-3, weight_decay=0.0),
  )
  return Shared(
    tokenizer=tokenizer, graphdef=graphdef, engine=engine, driver=driver, learner=learner,
    init_state=jax.tree.map(jnp.copy, learner.state), init_params=jax.tree.map(jnp.copy, params),
  )  # fmt: skip


def use_old_engine_settings(shared: Shared) -> None:
  """The engine as it was before 2026-11-25 and 26: one decode step per call, one suffix prefill
  call per parked slot (a turn that continues its last call with nothing new included) and one
  re-prefill call per in-flight slot on a weight update (the driver reads these settings live;
  warm-up compiled the one-step calls too)."""
  shared.engine.cfg = dataclasses.replace(
    shared.engine.cfg, suffix_batch=(1,), decode_steps_per_call=1
  )
  shared.driver.cfg = dataclasses.replace(
    shared.driver.cfg, batch_reprefill=False, continue_in_decode=False
  )


def warm_up(shared: Shared, w: Workload) -> dict[str, float]:
  """Compiles the engine (prefill buckets, decode windows) and every learner row bucket now, so
  neither mode pays a compile inside its timed run."""
  t0 = time.perf_counter()
  shared.engine.warmup(chunks=(1, 2, 4, 8), modes=("sample",))
  t1 = time.perf_counter()
  learner = shared.learner
  for rows in row_buckets(w)[:-1]:
    n = rows * w.minibatches
    seq = {
      "tokens": np.ones(MAX_SEQ - 8, np.int32), "loss_mask": np.ones(MAX_SEQ - 8, np.int32),
      "logprobs": np.zeros(MAX_SEQ - 8, np.float32), "versions": np.zeros(MAX_SEQ - 8, np.int32),
    }  # fmt: skip
    groups = [
      Group(group_id=f"warm{rows}/{i}", trajectories=[[seq]], advantages=[float(i % 2)],
            created_version=0)
      for i in range(n)
    ]  # fmt: skip
    learner.train_step(groups)
  t2 = time.perf_counter()
  return {"engine_warmup_s": t1 - t0, "learner_warmup_s": t2 - t1}


def reset(shared: Shared) -> None:
  """Both modes start from the same weights at version 0, in the learner and the engine."""
  shared.learner.restore(jax.tree.map(jnp.copy, shared.init_state), 0)
  # recompute=True: whatever kv_on_update is, nothing cached under the previous mode's weights
  # survives into the next mode.
  shared.driver.update_params(jax.tree.map(jnp.copy, shared.init_params), 0, recompute=True)


def record_batches(learner: Learner) -> list[list[Group]]:
  """The groups of every `train_step` the learner takes from now on (an instance attribute
  shadows the method until `del learner.train_step`)."""
  batches: list[list[Group]] = []
  step = learner.train_step

  def recording(groups):
    batches.append(list(groups))
    return step(groups)

  learner.train_step = recording
  return batches


def learner_alone(
  shared: Shared, batches: list[list[Group]], history: list[dict[str, float]], n: int
) -> dict[str, float] | None:
  """Times the learner's step on the last `n` batches of a mode again, the engine idle and the
  rollouts stopped (from the run's last weights: a step's cost does not depend on them; the
  learner's state and version are put back afterwards). history: the trainer's metrics per
  step of the run. Never the first step (it may include a compile). The step's two phases side
  by side: the host's packing (Python, contends for the GIL with the rollouts) and the device
  part (XLA, contends for the cores with the engine)."""
  picked = list(range(max(1, len(batches) - n), len(batches)))
  if not picked or n <= 0:
    return None
  learner = shared.learner
  state, version = jax.tree.map(jnp.copy, learner.state), learner.version
  times, phases = [], []
  try:
    for i in picked:
      t0 = time.perf_counter()
      phases.append(learner.train_step(batches[i]))
      times.append(time.perf_counter() - t0)
  finally:
    learner.restore(state, version)
  alone = float(np.mean(times))
  in_run = float(np.mean([history[i]["timing/train_s"] for i in picked]))
  out = {
    "steps": len(picked),
    "train_s_alone": round(alone, 3),
    "train_s_in_run": round(in_run, 3),
    "in_run_vs_alone": round(in_run / max(alone, 1e-9), 3),
  }
  for phase in ("prepare_s", "device_s"):
    key = f"timing/{phase}"
    if all(key in history[i] for i in picked):
      out[f"{phase}_alone"] = round(float(np.mean([m[key] for m in phases])), 4)
      out[f"{phase}_in_run"] = round(float(np.mean([history[i][key] for i in picked])), 4)
  return out


class OccupancySampler:
  """Mean engine slot occupancy over a run, sampled on its own thread."""

  def __init__(self, stats: Callable[[], dict[str, float]], every_s: float = 0.02) -> None:
    self.stats, self.every_s = stats, every_s
    self.samples: list[float] = []
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="occupancy", daemon=True)

  def _run(self) -> None:
    while not self._stop.wait(self.every_s):
      self.samples.append(float(self.stats()["slot_occupancy"]))

  def __enter__(self) -> OccupancySampler:
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()

  @property
  def mean(self) -> float:
    return float(np.mean(self.samples)) if self.samples else 0.0


def run_mode(
  shared: Shared,
  w: Workload,
  *,
  eta: int,
  max_concurrent: int,
  server: EngineServer | None = None,
) -> dict:
  """Trains `w.steps` steps in one mode; returns its figures. server: generate on that engine
  process (over HTTP, weights through its directory) instead of the in-process driver."""
  reset(shared)
  if server is None:
    gen_client, engine_stats = shared.driver, shared.driver.stats
  else:
    gen_client = RemoteGenerationClient(
      server.wait_ready(), config=RemoteClientConfig(timeout_s=600.0, retries=0)
    )
    engine_stats = server.stats
  staleness = StalenessManager(
    StalenessConfig(batch_groups=w.batch_groups, max_staleness=eta, max_concurrent=max_concurrent)
  )
  replay = ReplayQueue(
    ReplayConfig(directory=None, max_head_staleness=eta),
    on_discard=lambda g: staleness.on_discard(),
  )
  rng = SafeRng(w.seed)  # the same draw sequence in both modes
  search = LatencySearch(w.tool_latency, rng)
  toolbox = ToolBox(search=search, access=None, cache=ToolCache(CacheConfig(mode="off")))
  agent_cfg = AsearcherAgentConfig(
    max_turns=2 * int(w.k_tools.high) + 2, max_new_tokens=int(w.output_len.high) + 16,
    max_tokens=MAX_SEQ, topk=1, doc_chars=80, search_only=True,
  )  # fmt: skip
  episodes: list[int] = []

  def episode_client(group: str) -> SteeringClient:
    k = rng.draw_int(w.k_tools)
    episodes.append(k)
    return SteeringClient(
      gen_client,
      shared.tokenizer,
      k=k,
      rng=rng,
      output_len=w.output_len,
      tag=f"e{len(episodes)}",
    )

  def make_agent(client, tools) -> BenchAgent:
    return BenchAgent(
      client=client, tokenizer=shared.tokenizer, toolbox=tools, config=agent_cfg,
      sampling=SamplingParams(temperature=1.0), limits=Limits(llm_timeout_s=600, tool_timeout_s=60),
    )  # fmt: skip

  items = [
    QAExample(id=str(i), dataset="bench", question=f"Benchmark question number {i}: who, where and when?",
           answers=("unknown",))
    for i in range(64)
  ]  # fmt: skip
  rollout = RolloutController(
    config=RolloutConfig(group_size=w.group_size, seed=w.seed, occupancy_sample_s=0),
    items=items,
    agents=AgentSource(
      factory=make_agent, client=episode_client, toolbox=toolbox,
      stop_token_ids=shared.tokenizer.stop_token_ids,
    ),
    staleness=staleness, replay=replay,
    scorer=smoke_scorer, engine_stats=engine_stats,
  )  # fmt: skip
  if server is not None:
    rollout.add_closer(gen_client.close)  # after every episode is cancelled
  if server is None:
    weight_sync = InProcessWeightSync(shared.driver)
  else:
    weight_sync = DirectoryWeightPublisher(server.weights_dir, shared.graphdef)
  trainer = Trainer(
    config=TrainerConfig(
      train_steps=w.steps, batch_groups=w.batch_groups, checkpoint_every=0, batch_timeout_s=600
    ),
    learner=shared.learner, replay=replay, staleness=staleness,
    weight_sync=weight_sync, rollout=rollout, engine_stats=engine_stats,
    learner_step=shared.driver.learner_step if server is None else None,
  )  # fmt: skip
  stats0 = engine_stats()
  tokens0 = float(stats0["tokens_generated"])
  cpus_before = os.sched_getaffinity(0)
  batches = record_batches(shared.learner)
  try:
    with OccupancySampler(engine_stats) as occ:
      rollout.start()
      if server is not None and server.trainer_cpus:
        serving_commands.pin_cpus(server.trainer_cpus)
      t0 = time.perf_counter()
      trainer.run()
      wall = time.perf_counter() - t0
  finally:
    del shared.learner.train_step  # the method again (record_batches shadowed it)
    serving_commands.pin_cpus(cpus_before)
    rollout.stop()
    replay.close()
  h = trainer.history
  alone = learner_alone(shared, batches, h, w.alone_steps)
  for i, m in enumerate(h):
    log.info(
      "eta=%d step %d: wait %.2f s, train %.2f s, sync %.2f s, %d tokens, episode %.1f s",
      eta, i + 1, m["timing/wait_batch_s"], m["timing/train_s"], m["timing/sync_s"],
      m["ppo/tokens"], m.get("rollout/episode_s", float("nan")),
    )  # fmt: skip
  trained = [m["ppo/tokens"] for m in h]
  step_s = [m["timing/step_s"] for m in h]
  idle = sum(m["timing/wait_batch_s"] for m in h)
  steady = sum(step_s[1:])
  steady_idle = sum(m["timing/wait_batch_s"] for m in h[1:])
  ro = rollout.metrics(reset=False)
  end = engine_stats()
  served = None
  if server is not None:  # how long the served engine takes to run the last published version
    t1, deadline = time.perf_counter(), time.monotonic() + 120
    while engine_stats()["version"] != shared.learner.version and time.monotonic() < deadline:
      time.sleep(0.01)
    served = {
      "version": int(engine_stats()["version"]),
      "lag_s": round(time.perf_counter() - t1, 2),
    }
  steps_n = end["decode_steps"] - stats0["decode_steps"]
  # Net of compiles: with --no-warmup the first calls of each shape compile inside them.
  compile_s = end.get("compile_s", 0.0) - stats0.get("compile_s", 0.0)
  busy = sum(end[k] - stats0[k] for k in ("prefill_s", "update_s", "decode_s")) - compile_s
  train_s = float(np.mean([m["timing/train_s"] for m in h]))
  # per step (the trainer resets the rollout's samples every step): means of step means, max
  group_s = float(np.mean([m["rollout/group_s"] for m in h if "rollout/group_s" in m] or [0.0]))
  group_s_max = max([m.get("rollout/group_s_max", 0.0) for m in h], default=0.0)
  rows_n = (end["decode_rows_per_step"] * end["decode_steps"]
            - stats0["decode_rows_per_step"] * stats0["decode_steps"])  # fmt: skip
  return {
    "steps": len(h),
    "wall_s": round(wall, 2),
    "trained_tokens": int(sum(trained)),
    "trained_tokens_per_s": round(sum(trained) / wall, 1),
    "steady_tokens_per_s": round(sum(trained[1:]) / steady, 1) if steady else None,
    "trainer_idle_frac": round(idle / wall, 4),
    "steady_idle_frac": round(steady_idle / steady, 4) if steady else None,
    "train_s_mean": round(train_s, 3),
    # The learner's step on the same batches again with nothing else running (engine idle):
    # in_run / alone > 1 is the cost of sharing the CPU with generation (learner_alone).
    "learner_alone": alone,
    "sync_s_mean": round(float(np.mean([m["timing/sync_s"] for m in h])), 3),
    "occupancy": round(occ.mean, 4),
    "generated_tokens_per_s": round((float(end["tokens_generated"]) - tokens0) / wall, 1),
    "staleness_max": int(max(m.get("staleness/token_max", 0.0) for m in h)),
    "staleness_head_max": int(max(m.get("staleness/head_max", 0.0) for m in h)),
    "episodes": len(episodes),
    "tool_calls": search.calls,
    "tool_wait_s": round(search.waited_s, 1),
    "groups_accepted": int(ro.get("rollout/groups_accepted", 0)),
    "groups_rejected": int(staleness.stats()["rejected"]),
    # Admission -> acceptance per group. The staleness rule keeps at most (eta + 1) x B groups
    # in flight, so it can deliver B groups per training step only while the mean group latency
    # stays under (eta + 1) step times (Little's law): capacity_ratio = (eta + 1) x train step /
    # group latency; near or below 1, the trainer waits however fast the engine is.
    "group_s_mean": round(group_s, 2),
    "group_s_max": round(group_s_max, 2),
    "capacity_ratio": round((eta + 1) * train_s / group_s, 3) if group_s else None,
    "rollout": {k.removeprefix("rollout/"): round(v, 3) for k, v in ro.items()},
    # Prefix reuse (DriverConfig.prefix_reuse): agent turns admitted into their previous turn's
    # parked slot, prompt tokens whose keys/values were reused vs prefilled during this mode.
    "prefix": {
      k: int(end.get(k, 0) - stats0.get(k, 0))
      for k in ("prefix_hits", "prefix_tokens_reused", "prefill_tokens", "prefix_evictions")
    },
    # Engine thread time: admissions' prefills, weight updates (swap + the re-prefill of every
    # in-flight slot under kv_on_update="recompute") and decode steps; rows per step < slots
    # where EngineConfig.decode_rows let a step skip idle slots.
    "engine": {
      "prefill_s": round(end["prefill_s"] - stats0["prefill_s"], 2),
      "updates": int(end["updates"] - stats0["updates"]),
      # --engine process: the version the server ran once it caught up, and how long after the
      # last step that took (loading from the weights directory, swap, re-prefill).
      "served": served,
      "update_s": round(end["update_s"] - stats0["update_s"], 2),
      "reprefill_tokens": int(end["reprefill_tokens"] - stats0["reprefill_tokens"]),
      "decode_s": round(end["decode_s"] - stats0["decode_s"], 2),
      # Seconds the engine thread paused for the learner's steps (DriverConfig.yield_to_learner).
      "learner_yield_s": round(
        end.get("learner_yield_s", 0.0) - stats0.get("learner_yield_s", 0.0), 2
      ),
      # The engine thread's busy time (prefill + updates + decode calls, less the compiles in
      # them) per trained token.
      "busy_s_per_trained_token": round(busy / max(sum(trained), 1), 8),
      "compile_s": round(compile_s, 2),
      "prefill_calls": int(end["prefill_calls"] - stats0["prefill_calls"]),
      "suffix_prefill_s": round(end["suffix_prefill_s"] - stats0["suffix_prefill_s"], 2),
      "suffix_prefill_calls": int(end["suffix_prefill_calls"] - stats0["suffix_prefill_calls"]),
      "decode_continuations": int(end["decode_continuations"] - stats0["decode_continuations"]),
      "decode_steps": int(steps_n),
      "rows_per_step": round(rows_n / max(steps_n, 1), 2),
    },
  }


def parse(argv: list[str] | None) -> Workload:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  d = Workload()
  p.add_argument("--steps", type=int, default=d.steps)
  p.add_argument(
    "--alone-steps",
    type=int,
    default=d.alone_steps,
    help="batches per mode whose learner step is timed again with the engine idle (0: none)",
  )
  p.add_argument("--batch-groups", type=int, default=d.batch_groups)
  p.add_argument("--group-size", type=int, default=d.group_size)
  p.add_argument("--eta", type=int, default=d.eta)
  p.add_argument("--async-concurrent", type=int, default=d.async_concurrent)
  p.add_argument(
    "--slots", type=int, default=d.slots, help="engine slots (default: async episodes in flight)"
  )
  p.add_argument(
    "--decode-rows", default=",".join(map(str, d.decode_rows)),
    help="decode-step sizes below the slot count, comma-separated ('' = every slot each step)",
  )  # fmt: skip
  p.add_argument(
    "--prefill-buckets", default=",".join(map(str, d.prefill_buckets)),
    help=f"padded prompt lengths below the {MAX_SEQ}-token context, comma-separated",
  )  # fmt: skip
  p.add_argument("--minibatches", type=int, default=d.minibatches)
  p.add_argument("--hidden", type=int, default=d.hidden)
  p.add_argument("--layers", type=int, default=d.layers)
  p.add_argument("--tool-median-s", type=float, default=d.tool_latency.median)
  p.add_argument("--k-median", type=float, default=d.k_tools.median)
  p.add_argument("--k-max", type=int, default=int(d.k_tools.high))
  p.add_argument("--seed", type=int, default=d.seed)
  p.add_argument("--no-prefix-reuse", action="store_true", help="re-prefill every LLM call")
  p.add_argument(
    "--kv-on-update", default=d.kv_on_update, choices=(*KV_ON_UPDATE, "both"),
    help="what a weight update does to in-flight and parked keys/values (DriverConfig)",
  )  # fmt: skip
  p.add_argument(
    "--engine", default=d.engine, choices=("thread", "process"),
    help="async mode's engine: in-process thread, or a serve-model child process",
  )  # fmt: skip
  p.add_argument(
    "--engine-cpus", default="",
    help="with --engine process: cores for the engine, e.g. '0-7' or '0,1' (the trainer gets the "
    "rest); '' = all cores shared",
  )  # fmt: skip
  p.add_argument(
    "--engine-settings", default=None, choices=("new", "old", "both"),
    help="async mode's engine: batched suffix prefills and re-prefills (new), one call per slot "
    "(old), or both side by side (the default with --engine thread; new with --engine process)",
  )  # fmt: skip
  p.add_argument(
    "--decode-steps", type=int, default=d.decode_steps,
    help="the new engine settings' decode steps per generate call (the old ones: 1)",
  )  # fmt: skip
  p.add_argument(
    "--engine-nice", type=int, default=d.engine_nice,
    help="the engine thread's niceness (0-19; DriverConfig.thread_nice)",
  )  # fmt: skip
  p.add_argument(
    "--yield-to-learner", choices=("auto", "on", "off"), default=d.yield_to_learner,
    help="the engine thread pauses while the learner steps (DriverConfig.yield_to_learner)",
  )  # fmt: skip
  p.add_argument(
    "--yield-share", type=float, default=d.yield_share,
    help="the engine's share of the time while the learner steps (DriverConfig.yield_share)",
  )  # fmt: skip
  p.add_argument("--verbose", action="store_true", help="log every training step")
  p.add_argument(
    "--no-warmup", action="store_true",
    help="compile on first use instead of up front (a short device lease): wall and speedup "
    "figures then include compiles; the engine's busy seconds do not (their compile_s is "
    "subtracted)",
  )  # fmt: skip
  a = p.parse_args(argv)
  if a.engine == "process" and a.kv_on_update == "both":
    p.error("--kv-on-update both needs --engine thread")
  if a.engine_settings is None:
    a.engine_settings = d.engine_settings if a.engine == "thread" else "new"
  if a.engine == "process" and a.engine_settings == "both":
    p.error("--engine-settings both needs --engine thread")
  if a.engine_cpus and a.engine != "process":
    p.error("--engine-cpus needs --engine process")
  if a.verbose:
    handler = logging.StreamHandler(sys.stdout)
    for name in ("asearcher_jax.rl.trainer", __name__):
      logging.getLogger(name).addHandler(handler)
      logging.getLogger(name).setLevel(logging.INFO)
      logging.getLogger(name).propagate = False  # one line each, whatever the root logger has
  return Workload(
    steps=a.steps, alone_steps=a.alone_steps, batch_groups=a.batch_groups, group_size=a.group_size, eta=a.eta,
    async_concurrent=a.async_concurrent, slots=a.slots, minibatches=a.minibatches,
    decode_rows=tuple(int(x) for x in a.decode_rows.split(",") if x.strip()),
    prefill_buckets=tuple(int(x) for x in a.prefill_buckets.split(",") if x.strip()),
    hidden=a.hidden, layers=a.layers,
    k_tools=dataclasses.replace(d.k_tools, median=a.k_median, high=a.k_max),
    tool_latency=dataclasses.replace(d.tool_latency, median=a.tool_median_s), seed=a.seed,
    prefix_reuse=not a.no_prefix_reuse, kv_on_update=a.kv_on_update, engine=a.engine,
    engine_settings=a.engine_settings, decode_steps=a.decode_steps,
    engine_cpus=parse_cpus(a.engine_cpus), engine_nice=a.engine_nice,
    yield_to_learner=a.yield_to_learner, yield_share=a.yield_share, warmup=not a.no_warmup,
  )  # fmt: skip


def parse_cpus(text: str) -> tuple[int, ...]:
  """'0-3,6' -> (0, 1, 2, 3, 6)."""
  cpus: set[int] = set()
  for part in filter(None, (x.strip() for x in text.split(","))):
    lo, _, hi = part.partition("-")
    cpus.update(range(int(lo), int(hi or lo) + 1))
  return tuple(sorted(cpus))


def main(argv: list[str] | None = None) -> dict:
  """Runs both modes; prints the side-by-side table and, last, one JSON line (also returned)."""
  compile_cache.enable_if_asked()  # $ASEARCHER_COMPILE_CACHE: reuse an earlier run's compiles
  w = parse(argv)
  print(f"workload: {w}", flush=True)
  with tempfile.TemporaryDirectory() as tmp:
    shared = build_shared(w, Path(tmp) / "tok")
    server = None
    if w.engine == "process":  # compiles in the child while this process warms up
      server = EngineServer(w, Path(tmp), set(w.engine_cpus) or None)
    try:
      warm = warm_up(shared, w) if w.warmup else None
      print(f"warm-up: {warm}", flush=True)
      if server is not None:
        print(f"engine process: {server.wait_ready()}, cpus {w.engine_cpus or 'all'}", flush=True)
      if w.engine_settings == "old":
        use_old_engine_settings(shared)
      sync = run_mode(shared, w, eta=0, max_concurrent=w.batch_groups)
      print(f"sync  (eta=0): {sync}", flush=True)
      asyn = run_mode(shared, w, eta=w.eta, max_concurrent=w.async_concurrent, server=server)
      print(f"async (eta={w.eta}): {asyn}", flush=True)
      old = None
      if w.engine_settings == "both":  # the same async mode again, one prefill call per slot
        new_settings = shared.engine.cfg, shared.driver.cfg
        use_old_engine_settings(shared)
        old = run_mode(shared, w, eta=w.eta, max_concurrent=w.async_concurrent)
        shared.engine.cfg, shared.driver.cfg = new_settings
        print(f"async (eta={w.eta}, old engine settings): {old}", flush=True)
      keep = None
      if w.kv_on_update == "both":  # the same async mode again, keeping the old keys/values
        shared.driver.cfg = dataclasses.replace(shared.driver.cfg, kv_on_update="keep")
        keep = run_mode(shared, w, eta=w.eta, max_concurrent=w.async_concurrent)
        print(f"async (eta={w.eta}, kv_on_update=keep): {keep}", flush=True)
    finally:
      if server is not None:
        server.stop()
      shared.driver.close()
  speedup = asyn["trained_tokens_per_s"] / max(sync["trained_tokens_per_s"], 1e-9)
  steady = (
    asyn["steady_tokens_per_s"] / sync["steady_tokens_per_s"]
    if asyn["steady_tokens_per_s"] and sync["steady_tokens_per_s"]
    else None
  )
  rows = ("wall_s", "trained_tokens_per_s", "trainer_idle_frac", "steady_idle_frac",
          "occupancy", "generated_tokens_per_s", "staleness_max", "episodes", "tool_calls",
          "group_s_mean", "capacity_ratio")  # fmt: skip
  print(
    f"{'':>26}{'sync':>12}{'async':>12}\n"
    + "\n".join(f"{k:>26}{sync[k]!s:>12}{asyn[k]!s:>12}" for k in rows)
    + f"\nspeedup (trained tokens/s, async / sync): {speedup:.2f}x "
    f"(steady state {steady if steady is None else round(steady, 2)}x; target >= 2.5 with "
    "trainer idle < 10%; AReaL's published end-to-end figure at 1.5B: 2.77x)",
    flush=True,
  )
  for name, mode in (("sync", sync), ("async", asyn)):
    if mode["learner_alone"]:
      a = mode["learner_alone"]
      print(
        f"learner step, {name}: {a['train_s_in_run']} s in the run, {a['train_s_alone']} s "
        f"alone on the same batches ({a['in_run_vs_alone']}x; host packing "
        f"{a.get('prepare_s_in_run')} vs {a.get('prepare_s_alone')} s, device "
        f"{a.get('device_s_in_run')} vs {a.get('device_s_alone')} s)",
        flush=True,
      )
  result = {
    "speedup": round(speedup, 3),
    "speedup_steady": None if steady is None else round(steady, 3),
    "trainer_idle_async": asyn["trainer_idle_frac"],
    "trainer_idle_sync": sync["trainer_idle_frac"],
    # The learner's step in the async run against the same batches alone (no engine running):
    # near 1, generation leaves the learner its cores; well above, the two contend.
    "learner_in_run_vs_alone_async": (asyn["learner_alone"] or {}).get("in_run_vs_alone"),
    "learner_in_run_vs_alone_sync": (sync["learner_alone"] or {}).get("in_run_vs_alone"),
    "capacity_ratio_async": asyn["capacity_ratio"],
    "occupancy_async": asyn["occupancy"],
    "occupancy_sync": sync["occupancy"],
    "steps": w.steps,
    "eta": w.eta,
    "kv_on_update": w.kv_on_update,
    "engine": w.engine,
    "engine_cpus": list(w.engine_cpus),
    "warmup": w.warmup,
    "sync": sync,
    "async": asyn,
    "platform": jax.devices()[0].platform,
    # The XLA flags this ran with (XLA:CPU's threading, say: benchmarks/cpu_sharing.py).
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }
  if old is not None:
    new_busy = asyn["engine"]["busy_s_per_trained_token"]
    old_busy = old["engine"]["busy_s_per_trained_token"]
    result["engine_settings"] = {
      # Issue 27's figure: engine busy seconds per trained token, new / old (bar <= 0.6).
      "busy_per_trained_token_new_vs_old": round(new_busy / max(old_busy, 1e-12), 3),
      "busy_s_per_trained_token_new": new_busy,
      "busy_s_per_trained_token_old": old_busy,
      "prefill_s_new_vs_old": round(
        asyn["engine"]["prefill_s"] / max(old["engine"]["prefill_s"], 1e-9), 3
      ),
      "update_s_new_vs_old": round(
        asyn["engine"]["update_s"] / max(old["engine"]["update_s"], 1e-9), 3
      ),
      "speedup_old": round(
        old["trained_tokens_per_s"] / max(sync["trained_tokens_per_s"], 1e-9), 3
      ),
      "trainer_idle_async_old": old["trainer_idle_frac"],
      "async_old": old,
    }
    print(
      "engine busy s per trained token, async: new "
      f"{new_busy:.3g} vs old {old_busy:.3g} = "
      f"{result['engine_settings']['busy_per_trained_token_new_vs_old']:.2f}x (target <= 0.6)",
      flush=True,
    )
  if keep is not None:
    result["keep"] = {
      "speedup": round(keep["trained_tokens_per_s"] / max(sync["trained_tokens_per_s"], 1e-9), 3),
      "trainer_idle_async": keep["trainer_idle_frac"],
      "steady_idle_async": keep["steady_idle_frac"],
      "wall_s": keep["wall_s"],
      "async": keep,
    }
    print(
      f"kv_on_update=keep: speedup {result['keep']['speedup']:.2f}x, trainer idle "
      f"{keep['trainer_idle_frac']} (steady {keep['steady_idle_frac']})",
      flush=True,
    )
  print(json.dumps(result), flush=True)
  return result


if __name__ == "__main__":
  main()
