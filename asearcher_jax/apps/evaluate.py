"""`asearcher eval`: run an agent over QA sets, score it, and write the report.

A keyword-only function that gin binds. `asearcher eval` with no --gin_file uses
gin/runs/eval.gin: the asearcher agent with a random qwen2-tiny policy in process on 20 shipped
HotpotQA questions, against the retrieval server that `asearcher serve-retrieval` starts. `compare=(dir_a, dir_b)` only prints a side-by-side comparison, and
`report_only=True` only rewrites the report of the run directory this configuration maps to.
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
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.serving.types import SamplingParams
from asearcher_jax.tokenizer import Tokenizer
from asearcher_jax.tools.cache import CacheConfig
from asearcher_jax.tools.retrieval.discovery import read_address_files
from asearcher_jax.tools.search import LocalRetrievalConfig
from asearcher_jax.tools.toolbox import make_toolbox

log = logging.getLogger(__name__)


def evaluate(
  *,
  datasets: Sequence[str] = ("hotpotqa_train100",),
  data_dir: str | None = None,
  split: str = "test",
  limit: int | None = None,
  output_dir: str = "runs/eval",
  agent: str = "asearcher",
  agent_config: Any = None,
  generation: str = "engine",
  model_dir: str | None = None,
  model: ModelConfig | None = None,
  tokenizer_dir: str | None = None,
  engine: Any = None,
  driver: Any = None,
  server_url: str | None = None,
  server_address_file: str | None = None,
  server_model: str = "asearcher-policy",
  temperature: float = 0.6,
  top_p: float = 0.95,
  top_k: int = 0,
  num_runs: int = 1,
  seed: int = 0,
  concurrency: int = 16,
  question_timeout_s: float = 3600.0,
  search: str = "local",
  access: str = "local",
  retrieval_addresses: Sequence[str] = (),
  retrieval_addr_dir: str | None = None,
  tool_cache: str = "off",
  tool_cache_path: str | None = None,
  judge_url: str | None = None,
  judge_model: str = "gpt-4o-mini-2024-07-18",
  judge_max_attempts: int = 3,
  save_trajectories: bool = True,
  progress: bool = True,
  report_only: bool = False,
  compare: Sequence[str] | None = None,
) -> int:
  """Evaluates and reports; returns 0 (the process exit code).

  Args:
    datasets: shipped names (see data.qa.SHIPPED), QA files, or names under `data_dir`.
    limit: first N questions of each dataset (None: all).
    generation: "engine" (in process: `model_dir` checkpoint, else a random `model`), "remote"
      (`serve-model` at `server_url` or via `server_address_file`: exact tokens) or "openai" (any
      OpenAI-compatible /v1/completions at `server_url` = ".../v1" serving `server_model`; text
      re-tokenized with `tokenizer_dir`'s tokenizer).
    temperature / top_p / top_k: sampling (ASearcher's eval scripts: 0.6 / 0.95 / off).
    num_runs / seed: k seeded runs (run r uses seed + r) for Avg@k and Pass@k.
    search / access: ToolBox providers ("local" needs retrieval_addresses or retrieval_addr_dir).
    tool_cache: "off", "read-write" (record tool results) or "replay-only" (exact offline re-run);
      the cache lives at `tool_cache_path` (default {output_dir}/tool_cache.sqlite).
    judge_url: an OpenAI-compatible API root (".../v1") to judge with; None: no LLM judge.
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
  data = {
    name: load_dataset(name, data_dir=data_dir, split=split, limit=limit) for name in datasets
  }
  data = {examples[0].dataset: examples for examples in data.values()}
  return asyncio.run(
    _evaluate(
      data=data, output_dir=output_dir, agent=agent, agent_config=agent_config,
      generation=generation, model_dir=model_dir, model=model, tokenizer_dir=tokenizer_dir,
      engine=engine, driver=driver, server_url=server_url, server_address_file=server_address_file,
      server_model=server_model,
      sampling=SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k),
      runner_config=RunnerConfig(
        output_dir=output_dir, num_runs=num_runs, seed=seed, concurrency=concurrency,
        question_timeout_s=question_timeout_s, save_trajectories=save_trajectories,
        progress=progress,
      ),
      search=search, access=access, retrieval_addresses=tuple(retrieval_addresses),
      retrieval_addr_dir=retrieval_addr_dir, tool_cache=tool_cache,
      tool_cache_path=tool_cache_path or str(Path(output_dir) / "tool_cache.sqlite"),
      judge=JudgeConfig(base_url=judge_url, model=judge_model, max_attempts=judge_max_attempts)
      if judge_url else None,
      report_only=report_only,
    )
  )  # fmt: skip


def _generation_client(
  generation: str, *, model_dir, model, tokenizer_dir, engine, driver, server_url,
  server_address_file, server_model,
) -> tuple[Any, Tokenizer, dict[str, Any], Any]:  # fmt: skip
  """(client, tokenizer, identity, closer) for the chosen generation backend."""
  if generation == "engine":
    from asearcher_jax.model.loading import load_policy
    from asearcher_jax.serving.driver import Driver, DriverConfig
    from asearcher_jax.serving.engine import Engine, EngineConfig

    policy, tokenizer, what = load_policy(model_dir, model, tokenizer_dir)
    eng = Engine.from_model(policy, tokenizer, engine or EngineConfig())
    drv = Driver(eng, driver or DriverConfig())
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
  raise AsearcherError(f"generation must be 'engine', 'remote' or 'openai', got {generation!r}")


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


async def _evaluate(
  *, data, output_dir, agent, agent_config, generation, model_dir, model, tokenizer_dir, engine,
  driver, server_url, server_address_file, server_model, sampling, runner_config, search, access,
  retrieval_addresses, retrieval_addr_dir, tool_cache, tool_cache_path, judge, report_only,
) -> int:  # fmt: skip
  _, agent_config = registry.resolve(agent, agent_config)  # a bad name fails before any work
  cache = CacheConfig(mode=tool_cache, path=tool_cache_path)
  local = None
  if "local" in (search, access):
    if not retrieval_addresses and not retrieval_addr_dir:
      raise AsearcherError(
        "local tools need retrieval_addresses or retrieval_addr_dir (start one with "
        "`asearcher serve-retrieval --gin_param='serve_retrieval.serve.addr_dir=\"DIR\"'`)"
      )
    local = LocalRetrievalConfig(addresses=retrieval_addresses, addr_dir=retrieval_addr_dir)
  toolbox = make_toolbox(
    search=search, access=access, local=local, cache=cache,
    config=agent_config.toolbox_config() if hasattr(agent_config, "toolbox_config") else None,
  )  # fmt: skip
  identity_tools = {"search": search, "access": access, "index": await _index_identity(local)}
  client, tokenizer, gen_identity, closer = _generation_client(
    generation, model_dir=model_dir, model=model, tokenizer_dir=tokenizer_dir, engine=engine,
    driver=driver, server_url=server_url, server_address_file=server_address_file,
    server_model=server_model,
  )  # fmt: skip
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
        "agent_config": dataclasses.asdict(agent_config),
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
