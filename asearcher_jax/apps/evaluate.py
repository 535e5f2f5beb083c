"""`asearcher eval`: run an agent over QA sets, score it, and write the report.

A keyword-only function that gin binds. `asearcher eval` with no --gin_file uses
gin/runs/eval.gin: the asearcher agent with a random qwen2-tiny policy in process on 20 shipped
HotpotQA questions, against the retrieval server that `asearcher serve-retrieval` starts. `compare=(dir_a, dir_b)` only
prints a side-by-side comparison, and `report_only=True` only rewrites the report of the run
directory this configuration maps to.

`watch` evaluates a training run while it trains: each version its trainer publishes to the
weights store (or every N-th) is loaded into this process's own engine between two evaluations,
so every token of one evaluation comes from one version, and a check on the versions the engine
stamps on each result refuses anything else. Results land under `{output_dir}/v{version}/`, and
`{output_dir}/versions.jsonl` gets one line per evaluated version.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from asearcher_jax import storage
from asearcher_jax.agent import registry
from asearcher_jax.agent.registry import agent_factory
from asearcher_jax.data.qa import load_dataset
from asearcher_jax.errors import AsearcherError, CheckpointError
from asearcher_jax.evaluation import report
from asearcher_jax.evaluation.clients import PinnedVersionClient
from asearcher_jax.evaluation.judge import JudgeConfig, LLMJudge, VerdictCache
from asearcher_jax.evaluation.runner import EvalRunner, RunnerConfig
from asearcher_jax.model.loading import PolicyConfig, load_policy
from asearcher_jax.serving.types import SamplingParams
from asearcher_jax.tokenizer import Tokenizer
from asearcher_jax.tools.cache import CacheConfig
from asearcher_jax.tools.retrieval.discovery import read_address_files
from asearcher_jax.tools.search import LocalRetrievalConfig
from asearcher_jax.tools.toolbox import make_toolbox

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalData:
  """Which questions are evaluated."""

  # Shipped names (see data.qa.SHIPPED), QA files, or names under `data_dir`.
  datasets: tuple[str, ...] = ("hotpotqa_train100",)
  # Where named datasets live (None: the shipped ones only).
  data_dir: str | None = None
  # Split to read from sets that have several.
  split: str = "test"
  # The first N questions of each dataset; None: all.
  limit: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Generation:
  """Where the agent's generations come from."""

  # "engine" (in process: the policy below), "remote" (a `serve-model` at server_url or via
  # server_address_file: exact tokens) or "openai" (any OpenAI-compatible /v1/completions at
  # server_url = ".../v1" serving server_model; text re-tokenized with policy.tokenizer_dir).
  backend: str = "engine"
  # The in-process policy (engine), or just its tokenizer (remote, openai).
  policy: PolicyConfig = PolicyConfig()
  # Slots, context and prefill buckets of the in-process engine; None: EngineConfig().
  engine: Any = None
  # The in-process driver's settings; None: DriverConfig().
  driver: Any = None
  # Server root ("http://host:port", or ".../v1" for "openai").
  server_url: str | None = None
  # A `serve-model` address file (remote only), instead of server_url.
  server_address_file: str | None = None
  # The model name sent to an OpenAI-compatible server.
  server_model: str = "asearcher-policy"
  # A trainer's weights store (serving/weights_dir.py: a directory or gs://) and the version in
  # it to evaluate: the in-process engine loads it before the first question; a remote server's
  # results are checked to carry it (None: the policy's own weights, no check).
  weights_dir: str | None = None
  weights_version: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class VersionWatch:
  """Evaluate the versions a training run publishes while it trains, each pinned to itself."""

  # The trainer's weights store (a directory or gs://; launch/ passes the run's).
  weights_dir: str
  # Evaluate versions divisible by this (1: every version); version 0 (the init) is skipped.
  every: int = 1
  # Seconds between looks at the store.
  poll_s: float = 10.0
  # Stop once this file is written after the watch started (launch/ names the trainer's operative
  # config, written when training ends) and every chosen version then present is evaluated.
  done_file: str | None = None
  # Stop once this version is evaluated (None: no such bound).
  last_version: int | None = None
  # Stop after this many seconds without a new version to evaluate.
  idle_timeout_s: float = 7200.0

  def __post_init__(self) -> None:
    if self.every < 1 or self.poll_s <= 0 or self.idle_timeout_s <= 0:
      raise AsearcherError(
        f"VersionWatch: every must be >= 1 and poll_s, idle_timeout_s > 0, got {self.every}, "
        f"{self.poll_s}, {self.idle_timeout_s}"
      )


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalTools:
  """The agent's ToolBox."""

  # Search and access providers ("local" needs retrieval_addresses or retrieval_addr_dir).
  search: str = "local"
  access: str = "local"
  # Retrieval servers ("host:port"), or a directory of their address files.
  retrieval_addresses: tuple[str, ...] = ()
  retrieval_addr_dir: str | None = None
  # "off", "read-write" (record tool results) or "replay-only" (exact offline re-run).
  cache: str = "off"
  # The cache file; None: {output_dir}/tool_cache.sqlite.
  cache_path: str | None = None
  # More tools beside search and access: registered names, "module:Class" strings, or Tool
  # instances (see `wiring.ToolsConfig.extra`).
  extra: tuple[Any, ...] = ()


def evaluate(
  *,
  data: EvalData = EvalData(),
  agent: str = "asearcher",
  agent_config: Any = None,
  generation: Generation = Generation(),
  sampling: SamplingParams = SamplingParams(temperature=0.6, top_p=0.95),
  runner: RunnerConfig = RunnerConfig(output_dir="runs/eval"),
  tools: EvalTools = EvalTools(),
  judge: JudgeConfig | None = None,
  report_only: bool = False,
  compare: Sequence[str] | None = None,
  watch: VersionWatch | None = None,
) -> int:
  """Evaluates and reports; returns 0 (the process exit code).

  Args:
    data: the datasets and how many questions of each.
    agent / agent_config: a registered agent (agent.registry) and its config (None: defaults).
    generation: the in-process engine, a `serve-model`, or an OpenAI-compatible server.
    sampling: temperature / top_p / top_k (ASearcher's eval scripts: 0.6 / 0.95 / off).
    runner: output directory, k seeded runs (run r uses seed + r), concurrency, timeouts.
    tools: the ToolBox providers, retrieval servers and the tool cache.
    judge: an OpenAI-compatible LLM judge; None: no judge.
    report_only: only rewrite the report of the run directory this configuration maps to.
    compare: two run directories: print them side by side and return.
    watch: evaluate each version a training run publishes (module docstring) until it ends.
  """
  if compare is not None:
    if len(compare) != 2:
      raise AsearcherError(f"compare takes two run directories, got {len(compare)}")
    for d in compare:
      if not (Path(d) / "config.json").exists():
        raise AsearcherError(f"{d} is not an eval run directory (no config.json)")
    cmp = report.compare(*compare)
    print(report.format_comparison(cmp))
    return 0
  loaded = {
    name: load_dataset(name, data_dir=data.data_dir, split=data.split, limit=data.limit)
    for name in data.datasets
  }
  loaded = {examples[0].dataset: examples for examples in loaded.values()}
  if tools.cache_path is None:
    tools = dataclasses.replace(
      tools, cache_path=str(Path(runner.output_dir) / "tool_cache.sqlite")
    )
  kwargs = dict(agent=agent, agent_config=agent_config, generation=generation, sampling=sampling,
                runner_config=runner, tools=tools, judge=judge)  # fmt: skip
  if watch is not None:
    if generation.backend != "engine":
      raise AsearcherError(
        "watch loads each version into its own engine: Generation.backend must be 'engine', "
        f"got {generation.backend!r}"
      )
    return asyncio.run(_watch(loaded, watch=watch, **kwargs))
  asyncio.run(_evaluate(loaded, report_only=report_only, **kwargs))
  return 0


def _generation_client(g: Generation) -> tuple[Any, Tokenizer, dict[str, Any], Any]:
  """(client, tokenizer, identity, closer) for the chosen generation backend."""
  p = g.policy
  model_dir, tokenizer_dir = p.model_dir, p.tokenizer_dir
  server_url, server_address_file, server_model = (
    g.server_url,
    g.server_address_file,
    g.server_model,
  )
  generation = g.backend
  if generation == "engine":
    from asearcher_jax.serving.driver import Driver, DriverConfig
    from asearcher_jax.serving.engine import Engine, EngineConfig
    from asearcher_jax.serving.mesh import engine_layout

    ecfg = g.engine or EngineConfig()
    layout = lambda cfg: engine_layout(cfg, ecfg.mesh)  # noqa: E731 (weights into their shards)
    policy, tokenizer, what = load_policy(model_dir, p.model, tokenizer_dir, p.seed, layout=layout)
    eng = Engine.from_model(policy, tokenizer, ecfg)
    drv = Driver(eng, g.driver or DriverConfig())
    identity = {"generation": "engine", "model_dir": model_dir, "model": what}
    if g.weights_version is not None:
      try:
        _load_version(drv, g.weights_dir, g.weights_version)
      except Exception:
        drv.close()
        raise
      identity.update(weights_dir=g.weights_dir, weights_version=g.weights_version)
      return PinnedVersionClient(drv, g.weights_version), tokenizer, identity, drv.close
    return drv, tokenizer, identity, drv.close
  if generation == "remote":
    from asearcher_jax.serving.client import RemoteGenerationClient

    if (server_url is None) == (server_address_file is None):
      raise AsearcherError("remote generation needs exactly one of server_url, server_address_file")
    client = RemoteGenerationClient(server_url, address_file=server_address_file)
    tokenizer = Tokenizer.from_dir(tokenizer_dir) if tokenizer_dir else Tokenizer.qwen2()
    identity = {
      "generation": "remote",
      "model_dir": model_dir,
      "server": server_url or "address_file",
    }
    if g.weights_version is not None:  # the server loads what it loads: checked, not chosen
      identity.update(weights_dir=g.weights_dir, weights_version=g.weights_version)
      return PinnedVersionClient(client, g.weights_version), tokenizer, identity, None
    return client, tokenizer, identity, None
  if generation == "openai":
    from asearcher_jax.evaluation.clients import OpenAICompletionsClient, OpenAICompletionsConfig

    if g.weights_version is not None:
      raise AsearcherError("an OpenAI-compatible server stamps no versions: weights_version is "
                           "for the 'engine' and 'remote' backends")  # fmt: skip

    if server_url is None:
      raise AsearcherError("openai generation needs server_url (the API root, '.../v1')")
    tokenizer = Tokenizer.from_dir(tokenizer_dir) if tokenizer_dir else Tokenizer.qwen2()
    config = OpenAICompletionsConfig(base_url=server_url, model=server_model)
    identity = {"generation": "openai", "server": server_url, "server_model": server_model}
    return OpenAICompletionsClient(config, tokenizer), tokenizer, identity, None
  raise AsearcherError(
    f"Generation.backend must be 'engine', 'remote' or 'openai', got {generation!r}"
  )


def _load_version(driver: Any, weights_dir: str | None, version: int) -> None:
  """Version `version` of the store into the driver's engine, in the engine's own placement and
  dtype, as serve-model's watcher loads it; nothing may be in flight (keys/values recomputed)."""
  from asearcher_jax.serving.weights_dir import load_version, version_dir

  if weights_dir is None:
    raise AsearcherError("Generation.weights_version needs Generation.weights_dir (the store)")
  params = load_version(version_dir(weights_dir, version), driver.engine.load_params().state)
  driver.update_params(params, version, recompute=True)


def _chosen_versions(watch: VersionWatch, done: set[int]) -> list[int]:
  from asearcher_jax.serving.weights_dir import versions

  return [
    v for v in versions(watch.weights_dir)
    if v > 0 and v % watch.every == 0 and v not in done
    and (watch.last_version is None or v <= watch.last_version)
  ]  # fmt: skip


def _evaluated_versions(output_dir: Path) -> set[int]:
  """Versions whose evaluation finished (a line in versions.jsonl): a restarted watch skips them."""
  path = output_dir / "versions.jsonl"
  if not path.exists():
    return set()
  done = set()
  for line in storage.jsonl_lines(path.read_text(encoding="utf-8")):
    with contextlib.suppress(json.JSONDecodeError, KeyError, TypeError):
      done.add(int(json.loads(line)["version"]))
  return done


async def _watch(data: dict[str, Any], *, watch: VersionWatch, **kwargs: Any) -> int:
  """Evaluates each chosen version as it appears (module docstring); returns 0 when the run is
  over (its done file, the last version) and 1 after idle_timeout_s without a new version."""
  runner_config: RunnerConfig = kwargs["runner_config"]
  generation: Generation = kwargs["generation"]
  root = Path(runner_config.output_dir)
  started = time.time()
  client, tokenizer, identity, closer = _generation_client(generation)
  done = _evaluated_versions(root)
  last_new = time.monotonic()
  try:
    while True:
      if watch.last_version is not None and any(v >= watch.last_version for v in done):
        return 0  # a restarted watch whose run was evaluated to the end
      finished = watch.done_file is not None and _written_since(watch.done_file, started)
      for v in await asyncio.to_thread(_chosen_versions, watch, done):
        try:
          await asyncio.wait_for(asyncio.to_thread(_load_version, client, watch.weights_dir, v),
                                 600)  # fmt: skip
        except CheckpointError as e:  # pruned before its turn: said, not fatal
          log.warning("version %d cannot be evaluated: %s", v, e)
          done.add(v)
          continue
        pinned = PinnedVersionClient(client, v)
        parts = (pinned, tokenizer, {**identity, "weights_dir": watch.weights_dir,
                                     "weights_version": v}, None)  # fmt: skip
        config = dataclasses.replace(runner_config, output_dir=str(root / f"v{v:08d}"))
        run_dir = await _evaluate(
          data, **{**kwargs, "runner_config": config}, report_only=False, parts=parts
        )
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
        line = {"version": v, "run_dir": str(run_dir), "checked_tokens": pinned.checked_tokens,
                "datasets": summary.get("datasets", {}), "time": time.time()}  # fmt: skip
        root.mkdir(parents=True, exist_ok=True)
        with (root / "versions.jsonl").open("a", encoding="utf-8") as f:
          f.write(json.dumps(line) + "\n")
        print(f"eval: version {v} evaluated -> {run_dir}", flush=True)
        done.add(v)
        last_new = time.monotonic()
      if finished:
        return 0
      if time.monotonic() - last_new > watch.idle_timeout_s:
        log.warning("no new version in %s for %.0f s: stopping", watch.weights_dir,
                    watch.idle_timeout_s)  # fmt: skip
        return 1
      await asyncio.sleep(watch.poll_s)
  finally:
    await asyncio.wait_for(asyncio.to_thread(closer), 60)


def _written_since(path: str, since: float) -> bool:
  try:
    return Path(path).stat().st_mtime >= since
  except OSError:
    return False


async def _index_identity(local: LocalRetrievalConfig | None) -> dict[str, Any] | None:
  """The retrieval index behind the servers (backend, corpus checksum), so results over another
  corpus land in another directory; None when unknown (the runner's preflight then explains)."""
  if local is None:
    return None
  servers = list(local.addresses)
  if local.addr_dir:
    servers += read_address_files(Path(local.addr_dir))
  for server in servers:
    url = (server if server.startswith("http") else f"http://{server}") + "/health"
    try:
      async with (
        asyncio.timeout(10),
        aiohttp.ClientSession() as session,
        session.get(url) as resp,
      ):
        health = await resp.json()
      return {"backend": health.get("backend"), "corpus_sha256": health.get("corpus_sha256")}
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
      continue
  return None


def _tool_identity(spec: Any) -> str:
  """A tool as the run directory's identity names it: its spec, or its class and config."""
  if isinstance(spec, str):
    return spec
  config = getattr(spec, "config", None)
  return f"{type(spec).__module__}:{type(spec).__qualname__}" + (f" {config!r}" if config else "")


async def _evaluate(
  data: dict[str, Any],
  *,
  agent: str,
  agent_config: Any,
  generation: Generation,
  sampling: SamplingParams,
  runner_config: RunnerConfig,
  tools: EvalTools,
  judge: JudgeConfig | None,
  report_only: bool,
  parts: tuple[Any, Tokenizer, dict[str, Any], Any] | None = None,
) -> Path:
  """One evaluation; returns its run directory. `parts`: a generation client the caller built
  and closes (client, tokenizer, identity, None), instead of one built from `generation`."""
  _, agent_config = registry.resolve(agent, agent_config)  # a bad name fails before any work
  output_dir = runner_config.output_dir
  search, access = tools.search, tools.access
  cache = CacheConfig(mode=tools.cache, path=tools.cache_path)
  local = None
  if "local" in (search, access):
    if not tools.retrieval_addresses and not tools.retrieval_addr_dir:
      raise AsearcherError(
        "local tools need retrieval_addresses or retrieval_addr_dir (start one with "
        "`asearcher serve-retrieval --gin_param='server.RetrievalServerConfig.addr_dir=\"DIR\"'`)"
      )
    local = LocalRetrievalConfig(
      addresses=tuple(tools.retrieval_addresses), addr_dir=tools.retrieval_addr_dir
    )
  toolbox = make_toolbox(
    search=search, access=access, local=local, cache=cache, tools=tools.extra,
    config=agent_config.toolbox_config() if hasattr(agent_config, "toolbox_config") else None,
  )  # fmt: skip
  identity_tools = {"search": search, "access": access, "index": await _index_identity(local)}
  if tools.extra:  # a run with another tool set is another configuration (its own run dir)
    identity_tools["extra"] = [_tool_identity(t) for t in tools.extra]
  owned = parts is None
  client, tokenizer, gen_identity, closer = parts or _generation_client(generation)
  llm_judge = None
  if judge is not None:
    llm_judge = LLMJudge(judge, cache=VerdictCache(Path(output_dir) / "judge_cache.jsonl"))
  try:
    runner = EvalRunner(
      config=runner_config,
      agent_factory=agent_factory(
        agent, agent_config, client=client, tokenizer=tokenizer, toolbox=toolbox
      ),
      identity={
        "agent": agent,
        "agent_config": (
          dataclasses.asdict(agent_config) if dataclasses.is_dataclass(agent_config) else None
        ),
        **gen_identity,
        "tools": identity_tools,
      },
      sampling=sampling,
      judge=llm_judge,
      client=client,
      toolbox=toolbox,
    )
    if not report_only:
      result = await runner.run(data)
      print(
        f"eval: {result.total} results ({result.generated} computed, {result.reused} resumed, "
        f"{result.judged} judged) in {result.wall_s:.1f} s -> {result.run_dir}"
      )
    elif not runner.run_dir.exists():
      raise AsearcherError(f"no results for this configuration yet ({runner.run_dir})")
    summary = report.write_report(runner.run_dir, llm_judge.key if llm_judge else None)
    print(report.format_table(summary))
    print(f"report: {runner.run_dir}/summary.json, results.csv, questions.csv, plots/*.png")
    print(json.dumps({"run_dir": str(runner.run_dir)}))
  finally:
    with contextlib.suppress(Exception):
      await asyncio.wait_for(toolbox.close(), 30)
    if llm_judge is not None:
      await asyncio.wait_for(llm_judge.close(), 30)
    close = getattr(client, "close", None)
    if not owned:  # the caller's client: it closes it
      pass
    elif closer is not None:
      await asyncio.wait_for(asyncio.to_thread(closer), 60)
    elif close is not None:
      await asyncio.wait_for(close(), 30)
  return runner.run_dir
