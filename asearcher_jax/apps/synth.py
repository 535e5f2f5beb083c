"""`asearcher synth`: synthesize hard, verified QA from a corpus's pages or a seed QA file.

A keyword-only function that gin binds (gin/runs/synth.gin). With no configuration at all it runs
over the shipped HotpotQA-100 paragraphs with a random tiny policy served in process as all three
roles: the questions are garbage, but every stage (pages, link graph, calls, checks, logs,
output) runs for real. Point the roles at real servers (`serve-model` with a checkpoint, vLLM,
SGLang, OpenAI) for real data.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from asearcher_jax.data.qa import load_dataset
from asearcher_jax.errors import AsearcherError
from asearcher_jax.synthesis.links import LinkGraph, sample_pages
from asearcher_jax.synthesis.llm import Budget, RoleConfig
from asearcher_jax.synthesis.loop import Seed, SynthConfig
from asearcher_jax.synthesis.run import run_synthesis
from asearcher_jax.tools.retrieval.corpus import PageStore, asset_path, load_passages

log = logging.getLogger(__name__)

HOTPOTQA_CORPUS = "corpus/hipporag_hotpotqa_train100_corpus.json.gz"


def load_store(corpus_files: Sequence[str] | None, pages_file: str | None) -> PageStore:
  """A pages file (ASearcher's `{url, contents}` jsonl) or the pages of corpus files (default:
  the shipped HotpotQA-100 paragraphs)."""
  if pages_file:
    return PageStore.from_file(Path(pages_file))
  paths = [Path(p) for p in corpus_files] if corpus_files else [asset_path(HOTPOTQA_CORPUS)]
  return PageStore.from_passages(load_passages(paths))


def seeds_from_pages(
  store: PageStore, graph: LinkGraph, n: int, seed: int, min_degree: int = 1
) -> list[Seed]:
  """`n` linked pages sampled deterministically; a seed's id is derived from its URL."""
  import hashlib

  return [
    Seed(id="p" + hashlib.sha256(u.encode()).hexdigest()[:12], url=u)
    for u in sample_pages(store, graph, n, seed=seed, min_degree=min_degree)
  ]


def seeds_from_qa(spec: str, store: PageStore, limit: int | None = None) -> list[Seed]:
  """Seed questions: a shipped QA set's name (e.g. "hotpotqa_train100") or a file in any format
  `data.qa` reads. A jsonl row's `url` / `statement` fields are used when present; else the
  source is the page whose title is the answer, when the store has one."""
  examples = load_dataset(spec, limit=limit)
  rows: dict[str, dict[str, Any]] = {}
  if Path(spec).suffix == ".jsonl" and Path(spec).is_file():
    for line in Path(spec).read_text(encoding="utf-8").splitlines():
      if line.strip():
        r = json.loads(line)
        rows[str(r.get("id", r.get("_id", len(rows))))] = r
  by_title = {(r.get("title") or "").lower(): r["url"] for r in store.rows()}
  out = []
  for ex in examples:
    extra = rows.get(ex.id, {})
    url = extra.get("url") or by_title.get(ex.answers[0].lower(), "")
    out.append(Seed(
      id=f"q{ex.id}", question=ex.question, answer=ex.answers[0], aliases=ex.answers[1:], url=url,
      statement=str(extra.get("statement", "")), source=url or ex.source,
    ))  # fmt: skip
  return out


@contextlib.asynccontextmanager
async def local_endpoint(
  model: Any = None, engine: Any = None, seed: int = 0, timeout_s: float = 300.0
) -> AsyncIterator[str]:
  """Our own `serve-model` facade in process on loopback (a random tiny policy by default);
  yields its /v1 base URL."""
  from asearcher_jax.model.loading import load_policy
  from asearcher_jax.serving.driver import Driver
  from asearcher_jax.serving.engine import Engine, EngineConfig
  from asearcher_jax.serving.openai_api import OpenAIServer, OpenAIServerConfig

  policy, tokenizer, what = load_policy(None, model, None, seed)
  eng = Engine.from_model(policy, tokenizer, engine or EngineConfig(max_seq_len=2048))
  driver = Driver(eng)
  server = OpenAIServer(driver, OpenAIServerConfig(port=0, request_timeout_s=timeout_s))
  try:
    port = await asyncio.wait_for(server.start(), 60)
    log.info("synth: serving %s on 127.0.0.1:%d for the 'local' roles", what, port)
    yield f"http://127.0.0.1:{port}/v1"
  finally:
    await asyncio.wait_for(server.stop(), 60)
    await asyncio.to_thread(driver.close)


def synth(
  *,
  output_dir: str = "runs/synth",
  corpus_files: Sequence[str] | None = None,
  pages_file: str | None = None,
  links_file: str | None = None,
  seed_qa_file: str | None = None,
  num_seeds: int = 8,
  seed: int = 0,
  concurrency: int = 4,
  config: SynthConfig = SynthConfig(),  # noqa: B008 (frozen config)
  generator: RoleConfig = RoleConfig(),  # noqa: B008 (frozen config)
  solver: RoleConfig = RoleConfig(temperature=0.6),  # noqa: B008 (frozen config)
  judge: RoleConfig = RoleConfig(temperature=0.6),  # noqa: B008 (frozen config)
  max_calls: int = 0,
  max_tokens: int = 0,
  local_model: Any = None,
  local_engine: Any = None,
  run_timeout_s: float = 3600.0,
) -> int:
  """Runs synthesis; returns 0 (the summary is in `{output_dir}/summary.json`).

  Args:
    output_dir: questions.jsonl, progress.jsonl, calls.jsonl, summary.json go here; re-running
      with the same directory resumes (done seeds are skipped, questions deduplicated).
    corpus_files: corpus files whose pages are sampled (default: shipped HotpotQA-100).
    pages_file: ASearcher's `{url, contents}` pages jsonl instead of corpus files.
    links_file: ASearcher's links json; without it the graph comes from title mentions.
    seed_qa_file: start from these questions (a shipped QA set's name or a file) instead of
      sampled pages.
    num_seeds: pages sampled (or seed questions read).
    seed: sampling seed (pages and actions).
    concurrency: seeds grown at once.
    config: loop and check settings.
    generator, solver, judge: the three roles' endpoints ("local": in-process tiny serve-model).
    max_calls, max_tokens: budget over all roles (0: unlimited).
    local_model, local_engine: ModelConfig / EngineConfig of the "local" endpoint.
    run_timeout_s: the whole run's time limit.
  """
  store = load_store(corpus_files, pages_file)
  graph = LinkGraph.from_links_file(links_file, store) if links_file else (
    LinkGraph.from_mentions(store))  # fmt: skip
  log.info("synth: %d pages, %d links", len(store), graph.num_edges)
  if seed_qa_file:
    seeds = seeds_from_qa(seed_qa_file, store, num_seeds)
  else:
    seeds = seeds_from_pages(store, graph, num_seeds, seed)
  if not seeds:
    raise AsearcherError("no seeds: the corpus has no linked pages and no seed QA file was given")

  async def main() -> dict[str, Any]:
    roles = {"generator": generator, "solver": solver, "judge": judge}
    async with contextlib.AsyncExitStack() as stack:
      if any(r.base_url == "local" for r in roles.values()):
        url = await stack.enter_async_context(local_endpoint(local_model, local_engine, seed))
        roles = {
          k: dataclasses.replace(r, base_url=url) if r.base_url == "local" else r
          for k, r in roles.items()
        }
      result = await run_synthesis(
        seeds, store=store, graph=graph, output_dir=output_dir, config=config,
        concurrency=concurrency, budget=Budget(max_calls=max_calls, max_tokens=max_tokens),
        rng_seed=seed, run_timeout_s=run_timeout_s, **roles,
      )  # fmt: skip
      return result.summary

  summary = asyncio.run(main())
  print(json.dumps({k: summary[k] for k in ("candidates", "accepted", "written", "rejected")}))
  return 0
