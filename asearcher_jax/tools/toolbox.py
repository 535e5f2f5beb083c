"""The ToolBox: runs one parsed tool call and returns what the agent reads plus per-call stats.

It is the only place that combines provider, cache and budget, and the only place that decides
what a failure means: a provider failure (outage, timeout, bad key, empty budget, replay miss) is an
`environment_failure`, which RL must not score as the policy's mistake; an unknown tool or an empty
query is the policy's mistake (`invalid_call`). Either way the agent gets the same texts the
original ASearcher tools show, and nothing raises out of `execute`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections import Counter
from typing import Any

from asearcher_jax.errors import AsearcherError
from asearcher_jax.tools.access import (
  DirectFetcher,
  FetchConfig,
  JinaConfig,
  JinaReaderClient,
  UrlRefused,
)
from asearcher_jax.tools.budget import BudgetConfig, CostBudget
from asearcher_jax.tools.cache import CacheConfig, ToolCache, normalize_query, normalize_url
from asearcher_jax.tools.http_retry import CallStats, ToolFailure
from asearcher_jax.tools.search import (
  AccessProvider,
  Document,
  LocalRetrievalClient,
  LocalRetrievalConfig,
  SearchProvider,
  SerperClient,
  SerperConfig,
)

log = logging.getLogger(__name__)

NO_RESULTS = "<information>\nNo search results are found.\n</information>"
NO_PAGE = "<information>\nNo More Information is Found for this URL.\n</information>"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolBoxConfig:
  """What the agent sees (ASearcher's base-model agent defaults) and overall bounds."""

  # Documents per search.
  topk: int = 5
  # Characters of each document shown.
  doc_chars: int = 5000
  # Sentences of each document shown after its first line (its title), a search engine's snippet
  # that leaves the rest of the page to `access`; 0: the whole document (up to doc_chars).
  doc_sentences: int = 0
  # Characters of a page kept before chunking.
  max_page_chars: int = 250_000
  # Characters per page chunk (one read turn each).
  page_chunk_chars: int = 25_000
  # Chunks per page at most.
  max_page_chunks: int = 10
  # Characters of a chunk kept in its compacted stub.
  stub_chars: int = 100
  # Seconds one tool call may take in all (retries included) before it is an environment failure.
  call_timeout_s: float = 600.0


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """A parsed action: `name` is "search" or "access", `argument` the query or URL."""

  name: str
  argument: str


@dataclasses.dataclass(frozen=True)
class ToolJob:
  """One read turn: `text` is shown in full once, `short_text` stays in the context afterwards."""

  text: str
  short_text: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolStats:
  tool: str
  provider: str
  latency_s: float
  attempts: int
  retries: int
  cache_hit: bool
  cost_usd: float
  # The tool failed (not the policy): exclude the trajectory from scoring.
  environment_failure: bool
  # The policy asked for something malformed (unknown tool, empty query).
  invalid_call: bool
  # Whether anything was found (documents or a page).
  found: bool
  # "provider: reason" for failures and invalid calls.
  error: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolResult:
  call: ToolCall
  jobs: tuple[ToolJob, ...]
  stats: ToolStats
  documents: tuple[Document, ...] = ()
  page: str | None = None

  @property
  def text(self) -> str:
    return "\n\n".join(job.text for job in self.jobs)


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def snippet(contents: str, sentences: int) -> str:
  """The first line (a wiki-18 title) and the first `sentences` sentences after it."""
  title, _, text = contents.partition("\n")
  if not text:
    return contents
  return title + "\n" + " ".join(_SENTENCE_END.split(text.strip(), maxsplit=sentences)[:sentences])


def search_job(docs: list[Document], doc_chars: int, doc_sentences: int = 0) -> ToolJob:
  """ASearcher's rendering: `[Doc k](url):` + the first `doc_chars` characters, one block
  (with `doc_sentences`, only the title and that many sentences: a snippet)."""
  if not docs:
    return ToolJob(NO_RESULTS, NO_RESULTS)

  def shown(d: Document) -> str:
    text = snippet(d.contents, doc_sentences) if doc_sentences else d.contents
    return text[:doc_chars]

  body = "\n\n".join(f"[Doc {k}]({d.url}):\n{shown(d)}" for k, d in enumerate(docs, 1))
  text = f"<information>\n{body}\n</information>"
  return ToolJob(text, text)  # search results are never compacted


def page_jobs(page: str | None, config: ToolBoxConfig) -> tuple[ToolJob, ...]:
  """A page cut to `max_page_chars` and split into chunks, each with a 100-char stub."""
  if not page:
    return (ToolJob(NO_PAGE, NO_PAGE),)
  page = page[: config.max_page_chars]
  jobs = []
  for i in range(config.max_page_chunks):
    chunk = page[i * config.page_chunk_chars : (i + 1) * config.page_chunk_chars]
    if not chunk:
      break
    header = f"<information>\n>>>> Page {i + 1} >>>>\n\n"
    jobs.append(
      ToolJob(
        f"{header}{chunk}\n</information>", f"{header}{chunk[: config.stub_chars]}\n</information>"
      )
    )
  return tuple(jobs)


class ToolBox:
  """Dispatches `search` / `access` calls to providers through the cache and the budget."""

  def __init__(
    self,
    *,
    search: SearchProvider | None,
    access: AccessProvider | None,
    cache: ToolCache | None = None,
    budget: CostBudget | None = None,
    config: ToolBoxConfig | None = None,
  ) -> None:
    self.search_provider = search
    self.access_provider = access
    self.cache = cache if cache is not None else ToolCache(CacheConfig(mode="off"))
    self.budget = budget if budget is not None else CostBudget()
    self.config = config if config is not None else ToolBoxConfig()
    self.counts: Counter[str] = Counter()
    self.latency_s: Counter[str] = Counter()

  async def __aenter__(self) -> ToolBox:
    return self

  async def __aexit__(self, *exc: object) -> None:
    await self.close()

  async def close(self) -> None:
    providers = {id(p): p for p in (self.search_provider, self.access_provider) if p is not None}
    for p in providers.values():
      await p.close()
    if self.cache.enabled:
      log.info(self.cache.stats.report())
    self.cache.close()

  async def execute(self, call: ToolCall) -> ToolResult:
    """Never raises for tool or policy problems; see `ToolStats` for what happened."""
    provider, request, problem = self._route(call)
    if provider is None or problem is not None:
      env = problem is not None and problem.startswith("no ")  # a missing provider is ours
      return self._finish(call, "none", None, CallStats(), 0.0, False, 0.0, error=problem, env=env)
    stats = CallStats()
    t0 = time.perf_counter()
    cache_hit, value, cost, error, policy_side = False, None, 0.0, None, False
    try:
      async with asyncio.timeout(self.config.call_timeout_s):
        cache_hit, value, cost = await self._call(provider, call.name, request, stats)
    except ToolFailure as e:
      error = str(e)
    except UrlRefused as e:  # the policy asked for file://, an internal address, ...
      error, policy_side = f"{provider.name}: {e}", True
    except TimeoutError:
      error = f"{provider.name}: tool call exceeded {self.config.call_timeout_s:g} s"
    except Exception as e:  # a provider bug must not take a rollout down; it is attributed
      log.exception("%s provider %s raised", call.name, provider.name)
      error = f"{provider.name}: internal error {type(e).__name__}: {e}"
    latency = time.perf_counter() - t0
    env = error is not None and not policy_side
    return self._finish(
      call, provider.name, value, stats, latency, cache_hit, cost, error=error, env=env
    )

  def _route(self, call: ToolCall) -> tuple[Any, dict[str, Any], str | None]:
    """(provider, normalised request, problem): a problem means no provider is called."""
    if call.name == "search":
      request = {"query": normalize_query(call.argument), "topk": self.config.topk}
      provider, valid = self.search_provider, bool(request["query"])
    elif call.name == "access":
      try:
        request = {"url": normalize_url(call.argument)}
      except ValueError as e:  # not a URL the parser takes (an unbalanced "[" reads as IPv6)
        return self.access_provider, {}, f"malformed access URL: {e}"
      provider, valid = self.access_provider, bool(call.argument.strip())
    else:
      return None, {}, f"unknown tool {call.name[:50]!r}"
    if not valid:
      return provider, request, f"empty {call.name} argument"
    if provider is None:
      return None, request, f"no {call.name} provider configured"
    return provider, request, None

  async def _call(
    self, provider: Any, kind: str, request: dict[str, Any], stats: CallStats
  ) -> tuple[bool, Any, float]:
    found, cached = self.cache.lookup(provider.name, kind, request)
    if found:
      return True, cached, 0.0
    reserved = self.budget.reserve(provider.name)
    try:
      if kind == "search":
        docs = await provider.search(request["query"], request["topk"], stats)
        value: Any = [d.to_json() for d in docs]
      else:
        value = await provider.access(request["url"], stats)
    except BaseException:
      self.budget.settle(provider.name, reserved, succeeded=False)
      raise
    cost = self.budget.settle(provider.name, reserved, succeeded=True)
    self.cache.store(provider.name, kind, request, value)
    return False, value, cost

  def _finish(
    self,
    call: ToolCall,
    provider: str,
    value: Any,
    stats: CallStats,
    latency: float,
    cache_hit: bool,
    cost: float,
    *,
    error: str | None,
    env: bool,
  ) -> ToolResult:
    documents: tuple[Document, ...] = ()
    page = None
    if call.name == "search":
      documents = tuple(Document.from_json(d) for d in value or [])
      jobs: tuple[ToolJob, ...] = (
        search_job(list(documents), self.config.doc_chars, self.config.doc_sentences),
      )
      found = bool(documents)
    elif call.name == "access":
      page = value if isinstance(value, str) and value else None
      jobs = page_jobs(page, self.config)
      found = page is not None
    else:
      jobs = (ToolJob(NO_RESULTS, NO_RESULTS),)
      found = False
    invalid = error is not None and not env
    result = ToolResult(
      call=call,
      jobs=jobs,
      documents=documents,
      page=page,
      stats=ToolStats(
        tool=call.name,
        provider=provider,
        latency_s=latency,
        attempts=stats.attempts,
        retries=max(stats.attempts - 1, 0),
        cache_hit=cache_hit,
        cost_usd=cost,
        environment_failure=env,
        invalid_call=invalid,
        found=found,
        error=error,
      ),
    )
    self._count(result.stats)
    return result

  def _count(self, s: ToolStats) -> None:
    tool = s.tool if s.tool in ("search", "access") else "other"
    self.counts[f"{tool}/calls"] += 1
    self.counts[f"{tool}/environment_failures"] += s.environment_failure
    self.counts[f"{tool}/invalid_calls"] += s.invalid_call
    self.counts[f"{tool}/found"] += s.found
    self.counts[f"{tool}/cache_hits"] += s.cache_hit
    self.counts[f"{tool}/retries"] += s.retries
    self.latency_s[tool] += s.latency_s

  def metrics(self) -> dict[str, float]:
    """Flat counters for the metric writer: calls, failures, cache, cost (cumulative)."""
    out = {f"tools/{k}": float(v) for k, v in sorted(self.counts.items())}
    for tool, total in self.latency_s.items():
      calls = self.counts[f"{tool}/calls"]
      out[f"tools/{tool}/latency_mean_s"] = total / calls if calls else 0.0
    c = self.cache.stats
    out.update(
      {
        "tools/cache/hits": float(c.hits),
        "tools/cache/misses": float(c.misses),
        "tools/cache/replay_misses": float(c.replay_misses),
        "tools/cache/writes": float(c.writes),
      }
    )
    out.update(self.budget.metrics())
    return out


SEARCH_PROVIDERS = ("local", "serper", "none")
ACCESS_PROVIDERS = ("local", "jina", "direct", "none")


def make_toolbox(
  *,
  search: str = "local",
  access: str = "local",
  local: LocalRetrievalConfig | None = None,
  serper: SerperConfig | None = None,
  jina: JinaConfig | None = None,
  fetch: FetchConfig | None = None,
  cache: CacheConfig | None = None,
  budget: BudgetConfig | None = None,
  config: ToolBoxConfig | None = None,
) -> ToolBox:
  """A ToolBox for a setting named by its providers, e.g. local/local or serper/jina (web).

  Local search and access share one client (one retrieval server serves both). Each `*Config`
  left out takes its defaults; the local client then needs `local.addresses` or `local.addr_dir`.
  """
  if search not in SEARCH_PROVIDERS:
    raise AsearcherError(f"search provider must be one of {SEARCH_PROVIDERS}, got {search!r}")
  if access not in ACCESS_PROVIDERS:
    raise AsearcherError(f"access provider must be one of {ACCESS_PROVIDERS}, got {access!r}")
  local_client = None
  if "local" in (search, access):
    local_client = LocalRetrievalClient(local or LocalRetrievalConfig())
  search_provider: SearchProvider | None = {
    "local": local_client,
    "serper": SerperClient(serper or SerperConfig()) if search == "serper" else None,
    "none": None,
  }[search]
  access_provider: AccessProvider | None = {
    "local": local_client,
    "jina": JinaReaderClient(jina or JinaConfig()) if access == "jina" else None,
    "direct": DirectFetcher(fetch or FetchConfig()) if access == "direct" else None,
    "none": None,
  }[access]
  return ToolBox(
    search=search_provider,
    access=access_provider,
    cache=ToolCache(cache or CacheConfig()),
    budget=CostBudget(budget),
    config=config,
  )
