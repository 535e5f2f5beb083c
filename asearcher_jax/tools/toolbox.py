"""The ToolBox: runs one parsed tool call and returns what the agent reads plus per-call stats.

It is the only place that combines a tool, the cache and the budget, and the only place that
decides what a failure means: a tool failure (outage, timeout, bad key, empty budget, replay miss)
is an `environment_failure`, which RL must not score as the policy's mistake; an unknown tool, an
empty or malformed argument is the policy's mistake (`invalid_call`). Tools are `tools.base.Tool`s
routed by tag (the built-in `search` / `access` and any registered one), so nothing here names a
tool. The agent gets the same texts the original ASearcher tools show, and nothing raises out of
`execute`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from asearcher_jax.errors import AsearcherError
from asearcher_jax.tools import registry
from asearcher_jax.tools.access import (
  DirectFetcher,
  FetchConfig,
  JinaConfig,
  JinaReaderClient,
  UrlRefused,
)
from asearcher_jax.tools.base import InvalidArgument, Rendered, Tool, ToolBoxConfig, ToolJob
from asearcher_jax.tools.budget import BudgetConfig, CostBudget
from asearcher_jax.tools.builtin import (
  NO_PAGE,
  NO_RESULTS,
  AccessTool,
  SearchTool,
  page_jobs,
  search_job,
  snippet,
)
from asearcher_jax.tools.cache import CacheConfig, ToolCache
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

__all__ = [
  "NO_PAGE",
  "NO_RESULTS",
  "ToolBox",
  "ToolBoxConfig",
  "ToolCall",
  "ToolJob",
  "ToolResult",
  "ToolStats",
  "make_toolbox",
  "page_jobs",
  "search_job",
  "snippet",
]


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """A parsed action: `name` is a tool's tag, `argument` the query, URL or code."""

  name: str
  argument: str


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
  # Whether anything was found (documents, a page, a tool's output).
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
  # The tool's JSON value (None when the call failed), for agents that render it their own way.
  value: Any = None

  def __post_init__(self) -> None:
    if self.value is None and (self.documents or self.page):  # built from documents or a page
      value = [d.to_json() for d in self.documents] if self.documents else self.page
      object.__setattr__(self, "value", value)

  @property
  def text(self) -> str:
    return "\n\n".join(job.text for job in self.jobs)


class ToolBox:
  """Dispatches tool calls by tag to `Tool`s through the cache and the budget.

  `search` / `access` give the built-in tools their providers (either may be None: a call then
  fails as an unconfigured tool); `tools` adds more (a registered or user-written `Tool`).
  """

  def __init__(
    self,
    *,
    search: SearchProvider | None = None,
    access: AccessProvider | None = None,
    tools: Sequence[Tool] = (),
    cache: ToolCache | None = None,
    budget: CostBudget | None = None,
    config: ToolBoxConfig | None = None,
  ) -> None:
    self.tools: dict[str, Tool] = {
      SearchTool.tag: SearchTool(search),
      AccessTool.tag: AccessTool(access),
    }
    for tool in tools:
      registry.build(tool)  # a user's tool becomes known to views and counters by its tag
      self.tools[tool.tag] = tool
    self.cache = cache if cache is not None else ToolCache(CacheConfig(mode="off"))
    self.budget = budget if budget is not None else CostBudget()
    self.config = config if config is not None else ToolBoxConfig()
    self.counts: Counter[str] = Counter()
    self.latency_s: Counter[str] = Counter()

  @property
  def search_provider(self) -> SearchProvider | None:
    return getattr(self.tools.get(SearchTool.tag), "backend", None)

  @property
  def access_provider(self) -> AccessProvider | None:
    return getattr(self.tools.get(AccessTool.tag), "backend", None)

  @property
  def tags(self) -> tuple[str, ...]:
    """The tags of this ToolBox's tools, built-ins first (what its agents parse)."""
    return tuple(self.tools)

  async def __aenter__(self) -> ToolBox:
    return self

  async def __aexit__(self, *exc: object) -> None:
    await self.close()

  async def close(self) -> None:
    seen: set[int] = set()
    for tool in self.tools.values():
      backend = getattr(tool, "backend", tool)  # local search and access share one client
      if backend is None or id(backend) in seen:
        continue
      seen.add(id(backend))
      await tool.close()
    if self.cache.enabled:
      log.info(self.cache.stats.report())
    self.cache.close()

  async def execute(self, call: ToolCall) -> ToolResult:
    """Never raises for tool or policy problems; see `ToolStats` for what happened."""
    tool, request, problem = self._route(call)
    if tool is None or problem is not None:
      env = problem is not None and problem.startswith("no ")  # a missing provider is ours
      return self._finish(
        call, tool, "none", None, CallStats(), 0.0, False, 0.0, error=problem, env=env
      )
    stats = CallStats()
    t0 = time.perf_counter()
    cache_hit, value, cost, error, policy_side = False, None, 0.0, None, False
    try:
      async with asyncio.timeout(self.config.call_timeout_s):
        cache_hit, value, cost = await self._call(tool, call.name, request, stats)
    except ToolFailure as e:
      error = str(e)
    except (UrlRefused, InvalidArgument) as e:  # file://, an internal address, bad input, ...
      error, policy_side = f"{tool.provider}: {e}", True
    except TimeoutError:
      error = f"{tool.provider}: tool call exceeded {self.config.call_timeout_s:g} s"
    except Exception as e:  # a tool bug must not take a rollout down; it is attributed
      log.exception("%s tool %s raised", call.name, tool.provider)
      error = f"{tool.provider}: internal error {type(e).__name__}: {e}"
    latency = time.perf_counter() - t0
    env = error is not None and not policy_side
    return self._finish(
      call, tool, tool.provider, value, stats, latency, cache_hit, cost, error=error, env=env
    )

  def _route(self, call: ToolCall) -> tuple[Tool | None, dict[str, Any], str | None]:
    """(tool, normalised request, problem): a problem means nothing is called."""
    tool = self.tools.get(call.name)
    if tool is None:
      return None, {}, f"unknown tool {call.name[:50]!r}"
    try:
      request = tool.request(call.argument, self.config)
    except InvalidArgument as e:
      return tool, {}, str(e)
    if request is None:
      return tool, {}, f"empty {call.name} argument"
    if not tool.available:
      return tool, request, f"no {call.name} provider configured"
    return tool, request, None

  async def _call(
    self, tool: Tool, kind: str, request: dict[str, Any], stats: CallStats
  ) -> tuple[bool, Any, float]:
    if tool.cacheable:
      found, cached = self.cache.lookup(tool.provider, kind, request)
      if found:
        return True, cached, 0.0
    reserved = self.budget.reserve(tool.provider)
    try:
      value = await tool.run(request, stats)
    except BaseException:
      self.budget.settle(tool.provider, reserved, succeeded=False)
      raise
    cost = self.budget.settle(tool.provider, reserved, succeeded=True)
    if tool.cacheable:
      self.cache.store(tool.provider, kind, request, value)
    return False, value, cost

  def _finish(
    self,
    call: ToolCall,
    tool: Tool | None,
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
    if tool is not None:
      rendered = tool.render(value, self.config)
    else:
      rendered = Rendered(jobs=(ToolJob(NO_RESULTS, NO_RESULTS, call.name[:50]),), found=False)
    invalid = error is not None and not env
    result = ToolResult(
      call=call,
      jobs=rendered.jobs,
      documents=rendered.documents,
      page=rendered.page,
      value=value,
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
        found=rendered.found,
        error=error,
      ),
    )
    self._count(result.stats)
    return result

  def _count(self, s: ToolStats) -> None:
    tool = s.tool if s.tool in self.tools else "other"
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
  tools: Sequence[str | Tool] = (),
) -> ToolBox:
  """A ToolBox for a setting named by its providers, e.g. local/local or serper/jina (web), plus
  `tools`: more tools by registered name, `"module:Class"`, or as instances.

  Local search and access share one client (one retrieval server serves both). Each `*Config`
  left out takes its defaults; the local client then needs `local.addresses` or `local.addr_dir`.
  """
  extra = [registry.build(t) for t in tools]  # a bad name fails before any client is opened
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
    tools=extra,
    cache=ToolCache(cache or CacheConfig()),
    budget=CostBudget(budget),
    config=config,
  )
