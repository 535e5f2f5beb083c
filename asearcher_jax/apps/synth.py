"""`asearcher synth`: synthesize hard, verified QA from a corpus's pages or a seed QA file.

A keyword-only function of nested frozen configs that gin binds (gin/runs/synth.gin): where the
seeds come from (`SeedSource`), the three roles (`synthesis.llm.Roles`), the loop's checks
(`SynthConfig`), the run's limits (`SynthLimits`) and the in-process endpoint (`LocalEndpoint`).
With no configuration at all it runs over the shipped HotpotQA-100 paragraphs with a random tiny
policy served in process as all three roles: the questions are garbage, but every stage (pages, link graph, calls, checks, logs,
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
from asearcher_jax.model.loading import PolicyConfig
from asearcher_jax.serving.engine import EngineConfig
from asearcher_jax.synthesis.links import LinkGraph, sample_pages
from asearcher_jax.synthesis.llm import Budget, Roles
from asearcher_jax.synthesis.loop import Seed, SynthConfig
from asearcher_jax.synthesis.run import run_synthesis
from asearcher_jax.tools.retrieval.corpus import PageStore, asset_path, load_passages

log = logging.getLogger(__name__)

HOTPOTQA_CORPUS = "corpus/hipporag_hotpotqa_train100_corpus.json.gz"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SeedSource:
  """Where the pages, the link graph and the seeds come from."""

  # Corpus files whose pages are sampled; None: the shipped HotpotQA-100 paragraphs.
  corpus_files: tuple[str, ...] | None = None
  # ASearcher's `{url, contents}` pages jsonl, instead of corpus files.
  pages_file: str | None = None
  # ASearcher's links json; None: links from title mentions.
  links_file: str | None = None
  # Start from these questions (a shipped QA set's name or a file) instead of sampled pages.
  seed_qa_file: str | None = None
  # Pages sampled (or seed questions read).
  num_seeds: int = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class SynthLimits:
  """How much of the run happens at once and in all."""

  # Seeds grown at once.
  concurrency: int = 4
  # LLM calls over all roles; 0: unlimited.
  max_calls: int = 0
  # Tokens (prompt + completion) over all roles; 0: unlimited.
  max_tokens: int = 0
  # The whole run's time limit (unfinished seeds are not marked done: a re-run continues them).
  run_timeout_s: float = 3600.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalEndpoint:
  """Our own `serve-model` facade, in process on loopback, for the roles whose base_url is "local"."""

  # Its policy; default: a random qwen2-tiny (plumbing only: it writes no question).
  policy: PolicyConfig = PolicyConfig()
  # Its engine's slots, context and prefill buckets (prompts carry a page: 2,048 positions).
  engine: EngineConfig = EngineConfig(max_seq_len=2048)


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
  local: LocalEndpoint = LocalEndpoint(), timeout_s: float = 300.0
) -> AsyncIterator[str]:
  """`local` served on 127.0.0.1 (an ephemeral port); yields its /v1 base URL."""
  from asearcher_jax.model.loading import load_policy
  from asearcher_jax.serving.driver import Driver
  from asearcher_jax.serving.engine import Engine
  from asearcher_jax.serving.openai_api import OpenAIServer, OpenAIServerConfig

  p = local.policy
  policy, tokenizer, what = load_policy(p.model_dir, p.model, p.tokenizer_dir, p.seed)
  eng = Engine.from_model(policy, tokenizer, local.engine)
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
  source: SeedSource = SeedSource(),
  seed: int = 0,
  config: SynthConfig = SynthConfig(),  # noqa: B008 (frozen config)
  roles: Roles = Roles(),
  limits: SynthLimits = SynthLimits(),
  local: LocalEndpoint = LocalEndpoint(),
) -> int:
  """Runs synthesis; returns 0 (the summary is in `{output_dir}/summary.json`).

  Args:
    output_dir: questions.jsonl, progress.jsonl, calls.jsonl, summary.json go here; re-running
      with the same directory resumes (done seeds are skipped, questions deduplicated).
    source: the corpus or pages file, the link graph, and the seeds (sampled pages or seed QA).
    seed: sampling seed (pages and actions).
    config: loop and check settings.
    roles: the generator's, solver's and judge's endpoints ("local": `local` below).
    limits: seeds at once, the call and token budget over all roles, the run's time limit.
    local: the in-process endpoint that "local" roles share (started only when one asks).
  """
  src = source
  store = load_store(src.corpus_files, src.pages_file)
  graph = LinkGraph.from_links_file(src.links_file, store) if src.links_file else (
    LinkGraph.from_mentions(store))  # fmt: skip
  log.info("synth: %d pages, %d links", len(store), graph.num_edges)
  if src.seed_qa_file:
    seeds = seeds_from_qa(src.seed_qa_file, store, src.num_seeds)
  else:
    seeds = seeds_from_pages(store, graph, src.num_seeds, seed)
  if not seeds:
    raise AsearcherError("no seeds: the corpus has no linked pages and no seed QA file was given")

  async def main() -> dict[str, Any]:
    resolved = roles
    async with contextlib.AsyncExitStack() as stack:
      if any(r.base_url == "local" for _, r in roles.items()):
        url = await stack.enter_async_context(local_endpoint(local))
        resolved = Roles(**{
          k: dataclasses.replace(r, base_url=url) if r.base_url == "local" else r
          for k, r in roles.items()
        })  # fmt: skip
      result = await run_synthesis(
        seeds, store=store, graph=graph, output_dir=output_dir, config=config, roles=resolved,
        concurrency=limits.concurrency, rng_seed=seed, run_timeout_s=limits.run_timeout_s,
        budget=Budget(max_calls=limits.max_calls, max_tokens=limits.max_tokens),
      )  # fmt: skip
      return result.summary

  summary = asyncio.run(main())
  print(json.dumps({k: summary[k] for k in ("candidates", "accepted", "written", "rejected")}))
  return 0
