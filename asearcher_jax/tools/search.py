"""Search providers: the local retrieval server (with discovery and failover) and Serper.

A provider turns a query into `Document`s or raises `ToolFailure`; an empty list means the search
ran and found nothing (the policy's problem, not the environment's).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from asearcher_jax import http_guard
from asearcher_jax.errors import AsearcherError
from asearcher_jax.tools.http_retry import (
  CallStats,
  RetryConfig,
  SessionOwner,
  ToolFailure,
  call_with_retries,
  classify_status,
  read_json,
)
from asearcher_jax.tools.retrieval.discovery import read_address_files


@dataclasses.dataclass(frozen=True, kw_only=True)
class Document:
  """One search hit as the agent sees it: `[Doc k](url):\\n` + contents."""

  contents: str
  url: str
  title: str = ""
  score: float | None = None

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, row: dict[str, Any]) -> Document:
    return cls(**row)


class SearchProvider(Protocol):
  """`name` keys the cache, the price table and the stats."""

  name: str

  async def search(self, query: str, topk: int, stats: CallStats) -> list[Document]: ...

  async def close(self) -> None: ...


class AccessProvider(Protocol):
  name: str

  async def access(self, url: str, stats: CallStats) -> str | None:
    """The page as text (markdown where it was HTML), or None when there is no such page."""
    ...

  async def close(self) -> None: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalRetrievalConfig:
  """Where the local retrieval servers are and how hard to try them."""

  # Fixed server addresses, "host:port" (the eval setting).
  addresses: tuple[str, ...] = ()
  # Directory where servers announce `Host*_IP*.txt` (the training setting); re-read on failure.
  addr_dir: str | None = None
  # Requests in flight to the local servers from this client.
  concurrency: int = 64
  # Attempts across servers; a failed server is swapped for another one before the next.
  retry: RetryConfig = dataclasses.field(
    default_factory=lambda: RetryConfig(
      timeout_s=30.0, max_attempts=5, backoff_s=0.5, max_backoff_s=5.0
    )
  )
  # Longest query sent; longer ones are cut (the server refuses > 4096 chars).
  max_query_chars: int = 2000


class LocalRetrievalClient(SessionOwner):
  """Client of our `/retrieve` + `/access` server (and of ASearcher's / Search-R1's)."""

  name = "local"

  def __init__(self, config: LocalRetrievalConfig) -> None:
    if not config.addresses and not config.addr_dir:
      raise AsearcherError("local retrieval needs `addresses` or `addr_dir`")
    self.config = config
    self._semaphore = asyncio.Semaphore(config.concurrency)
    self._current: str | None = None

  def _make_session(self) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(headers=http_guard.client_headers())  # the servers' token

  def servers(self) -> list[str]:
    found = list(self.config.addresses)
    if self.config.addr_dir:
      found += [a for a in read_address_files(Path(self.config.addr_dir)) if a not in found]
    return found

  def _pick(self, avoid: str | None) -> str:
    """The server for the next request: round robin over every known server (the replicas of
    a retrieval tier share the load), skipping `avoid` (the one that just failed)."""
    servers = self.servers()
    if not servers:
      raise aiohttp.ClientConnectionError(
        f"no retrieval server announced in {self.config.addr_dir}"
      )
    usable = [s for s in servers if s != avoid] or servers
    if self._current not in usable:  # first call, or the next one in turn failed or left
      self._current = random.choice(usable)
    pick = self._current
    self._current = usable[(usable.index(pick) + 1) % len(usable)]
    return pick

  async def _post(self, path: str, payload: dict[str, Any], stats: CallStats) -> Any:
    failed: list[str | None] = [None]

    async def attempt() -> Any:
      server = self._pick(failed[0])
      url = server if server.startswith("http") else f"http://{server}"
      try:
        async with self.session().post(url + path, json=payload) as resp:
          if resp.status >= 500 or resp.status == 429:
            failed[0] = server
          classify_status(resp.status, resp.headers)
          body = await read_json(resp)
      except (aiohttp.ClientError, OSError, TimeoutError):
        failed[0] = server
        raise
      if not isinstance(body, dict) or not isinstance(body.get("result"), list):
        raise ToolFailure(self.name, f"unexpected response from {server}{path}")
      return body["result"]

    return await call_with_retries(
      self.name, attempt, self.config.retry, semaphore=self._semaphore, stats=stats
    )

  async def search(self, query: str, topk: int, stats: CallStats) -> list[Document]:
    payload = {
      "queries": [query[: self.config.max_query_chars]],
      "topk": topk,
      "return_scores": True,
    }
    result = await self._post("/retrieve", payload, stats)
    docs = []
    for item in result[0] if result else []:
      row, score = (item["document"], item.get("score")) if "document" in item else (item, None)
      docs.append(
        Document(
          contents=str(row.get("contents", "")),
          url=str(row.get("url", "")),
          title=str(row.get("title", "")),
          score=None if score is None else float(score),
        )
      )
    return docs

  async def access(self, url: str, stats: CallStats) -> str | None:
    result = await self._post("/access", {"urls": [url]}, stats)
    row = result[0] if result else None
    if not row:
      return None
    return str(row.get("contents", "")) or None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SerperConfig:
  """Google search through serper.dev (`POST /search {"q", "num"}`)."""

  # API root; tests point it at a local server.
  base_url: str = "https://google.serper.dev"
  # Environment variable holding the API key (the key itself never sits in a config or a log).
  api_key_env: str = "SERPER_API_KEY"
  # Requests in flight to Serper from this process (ASearcher's training client: 20).
  concurrency: int = 20
  # ASearcher's training client: 4 attempts, 30 s, backoff 1, 2, 4 s.
  retry: RetryConfig = dataclasses.field(
    default_factory=lambda: RetryConfig(timeout_s=30.0, max_attempts=4, backoff_s=1.0)
  )
  # Serper's query length limit as used by ASearcher.
  max_query_chars: int = 2000


class SerperClient(SessionOwner):
  name = "serper"

  def __init__(self, config: SerperConfig) -> None:
    key = os.environ.get(config.api_key_env, "")
    if not key:
      raise AsearcherError(f"web search needs ${config.api_key_env} set in the environment")
    self.config = config
    self._key = key
    self._semaphore = asyncio.Semaphore(config.concurrency)

  def __repr__(self) -> str:  # never show the key
    return f"SerperClient(base_url={self.config.base_url!r})"

  async def search(self, query: str, topk: int, stats: CallStats) -> list[Document]:
    payload = {"q": query[: self.config.max_query_chars], "num": topk}
    headers = {"X-API-KEY": self._key, "Content-Type": "application/json"}
    url = self.config.base_url.rstrip("/") + "/search"

    async def attempt() -> Any:
      async with self.session().post(url, json=payload, headers=headers) as resp:
        classify_status(resp.status, resp.headers)
        return await read_json(resp)

    body = await call_with_retries(
      self.name, attempt, self.config.retry, semaphore=self._semaphore, stats=stats
    )
    return parse_serper(body, topk)


def parse_serper(body: Any, topk: int) -> list[Document]:
  """`organic[i].{title, link, snippet}` -> documents `title + " " + snippet` (as ASearcher)."""
  if not isinstance(body, dict):
    raise ToolFailure("serper", "response is not a JSON object")
  organic: Sequence[Any] = body.get("organic") or []
  docs = []
  for item in organic[:topk]:
    if not isinstance(item, dict) or not item.get("link"):
      continue
    title, snippet = str(item.get("title", "")), str(item.get("snippet", ""))
    docs.append(Document(contents=f"{title} {snippet}".strip(), url=str(item["link"]), title=title))
  return docs
