"""`asearcher eval`: run an agent over QA sets, score it, and write the report.

A keyword-only function that gin binds. `asearcher eval` with no --gin_file uses
gin/runs/eval.gin: the asearcher agent with a random qwen2-tiny policy in process on 20 shipped
HotpotQA questions, against the retrieval server that `asearcher serve-retrieval` starts. `compare=(dir_a, dir_b)` only
prints a side-by-side comparison, and `report_only=True` only rewrites the report of the run
directory this configuration maps to.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from asearcher_jax.agent import registry
from asearcher_jax.agent.registry import agent_factory
from asearcher_jax.data.qa import load_dataset
from asearcher_jax.errors import AsearcherError
from asearcher_jax.evaluation import report
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
  return asyncio.run(
    _evaluate(
      loaded, agent=agent, agent_config=agent_config, generation=generation, sampling=sampling,
      runner_config=runner, tools=tools, judge=judge, report_only=report_only,
    )
  )  # fmt: skip


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
    return client, tokenizer, identity, None
  if generation == "openai":
    from asearcher_jax.evaluation.clients import OpenAICompletionsClient, OpenAICompletionsConfig

    if server_url is None:
      raise AsearcherError("openai generation needs server_url (the API root, '.../v1')")
    tokenizer = Tokenizer.from_dir(tokenizer_dir) if tokenizer_dir else Tokenizer.qwen2()
    config = OpenAICompletionsConfig(base_url=server_url, model=server_model)
    identity = {"generation": "openai", "server": server_url, "server_model": server_model}
    return OpenAICompletionsClient(config, tokenizer), tokenizer, identity, None
  raise AsearcherError(
    f"Generation.backend must be 'engine', 'remote' or 'openai', got {generation!r}"
  )


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
) -> int:
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
  client, tokenizer, gen_identity, closer = _generation_client(generation)
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
    if closer is not None:
      await asyncio.wait_for(asyncio.to_thread(closer), 60)
    elif close is not None:
      await asyncio.wait_for(close(), 30)
  return 0
