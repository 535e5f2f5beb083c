"""The local retrieval server: `/retrieve`, `/access`, `/health` over aiohttp.

Wire-compatible with ASearcher's and Search-R1's servers (same request fields, same
`{"result": ...}` shapes), so their clients work against it unchanged. Unlike them it does not
serialise every request behind one lock: concurrent `/retrieve` requests are micro-batched into one
scoring call on a worker thread, so the event loop keeps accepting while the index is searched.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web

from asearcher_jax import http_guard
from asearcher_jax.tools.retrieval.discovery import write_address_file
from asearcher_jax.tools.retrieval.index import Hits, LoadedIndex

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetrievalServerConfig:
  """How the server listens and what it accepts."""

  # Interface to bind; loopback by default so nothing is exposed by accident.
  host: str = "127.0.0.1"
  # TCP port; 0 picks a free one (read it from the address file or the log).
  port: int = 0
  # Directory for the discovery file `Host{ip}_IP{port}.txt` holding `ip:port`; None: none.
  addr_dir: str | None = None
  # topk used when a request omits it or sends 0 (ASearcher's server default).
  default_topk: int = 3
  # Largest topk a request may ask for.
  max_topk: int = 100
  # Most queries (or urls) one request may carry.
  max_batch: int = 512
  # Longest query accepted, in characters.
  max_query_chars: int = 4096
  # Largest request body in bytes (aiohttp answers 413 beyond it).
  max_request_bytes: int = 1 << 20
  # Requests being served at once; more get 503 so a flood cannot grow memory without bound.
  max_inflight: int = 1024
  # Most queries scored in one worker-thread call (micro-batch).
  micro_batch: int = 256
  # A connection whose request headers have not arrived within this is closed (slow clients).
  header_timeout_s: float = 15.0
  # A request body that has not fully arrived within this is answered with 408.
  body_timeout_s: float = 30.0


class RequestError(ValueError):
  """A malformed request; answered with HTTP 400 and this message."""


def _json_error(status: int, message: str) -> web.Response:
  return web.json_response({"error": message}, status=status)


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
  """Every error status as a JSON body, aiohttp's own too (404 unknown path, 405 wrong method,
  413 oversized body), so a client always parses the same shape."""
  try:
    return await handler(request)
  except web.HTTPException as e:
    if e.status < 400:
      raise
    message = f"{e.reason}: {request.method} {request.path}"
    if isinstance(e, web.HTTPMethodNotAllowed):
      message += f" (allowed: {', '.join(sorted(e.allowed_methods))})"
    elif isinstance(e, web.HTTPRequestEntityTooLarge):
      message = e.text or e.reason
    return _json_error(e.status, message)


def parse_retrieve(body: Any, config: RetrievalServerConfig) -> tuple[list[str], int, bool]:
  """Validates a /retrieve body; returns (queries, topk, return_scores)."""
  if not isinstance(body, dict):
    raise RequestError("body must be a JSON object")
  queries = body.get("queries")
  if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
    raise RequestError("'queries' must be a list of strings")
  if len(queries) > config.max_batch:
    raise RequestError(f"too many queries: {len(queries)} > {config.max_batch}")
  if any(len(q) > config.max_query_chars for q in queries):
    raise RequestError(f"a query is longer than {config.max_query_chars} characters")
  topk = body.get("topk")
  if topk is None or topk == 0:
    topk = config.default_topk
  if isinstance(topk, bool) or not isinstance(topk, int) or not 0 < topk <= config.max_topk:
    raise RequestError(f"'topk' must be an integer in [1, {config.max_topk}] or null")
  return_scores = body.get("return_scores", False)
  if not isinstance(return_scores, bool):
    raise RequestError("'return_scores' must be a boolean")
  return queries, topk, return_scores


def parse_access(body: Any, config: RetrievalServerConfig) -> list[str]:
  if not isinstance(body, dict):
    raise RequestError("body must be a JSON object")
  urls = body.get("urls")
  if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
    raise RequestError("'urls' must be a list of strings")
  if len(urls) > config.max_batch:
    raise RequestError(f"too many urls: {len(urls)} > {config.max_batch}")
  return urls


class MicroBatcher:
  """Coalesces concurrent searches into one `search_batch` call on a single worker thread.

  While one batch is being scored, newly arrived requests queue up; the next batch takes them all
  (up to `max_queries`). A lone request is scored at once, so batching adds no latency at low load.
  """

  def __init__(self, search_batch, executor: ThreadPoolExecutor, max_queries: int) -> None:
    self._search_batch = search_batch
    self._executor = executor
    self._max_queries = max_queries
    self._pending: collections.deque[tuple[list[str], int, asyncio.Future]] = collections.deque()
    self._drainer: asyncio.Task | None = None
    self.batches = 0
    self.queries = 0

  async def search(self, queries: list[str], k: int) -> list[Hits]:
    fut = asyncio.get_running_loop().create_future()
    self._pending.append((queries, k, fut))
    if self._drainer is None or self._drainer.done():
      self._drainer = asyncio.create_task(self._drain())
    return await fut

  async def _drain(self) -> None:
    loop = asyncio.get_running_loop()
    while self._pending:
      batch, n = [], 0
      while self._pending and (not batch or n + len(self._pending[0][0]) <= self._max_queries):
        item = self._pending.popleft()
        batch.append(item)
        n += len(item[0])
      flat = [q for queries, _, _ in batch for q in queries]
      k = max(k for _, k, _ in batch)
      try:
        hits = await loop.run_in_executor(self._executor, self._search_batch, flat, k)
      except Exception as e:  # a scoring bug fails these requests (500), not the server
        for _, _, fut in batch:
          if not fut.done():
            fut.set_exception(e)
        continue
      self.batches += 1
      self.queries += len(flat)
      start = 0
      for queries, k_req, fut in batch:
        if not fut.done():  # the client may have gone away
          fut.set_result([h[:k_req] for h in hits[start : start + len(queries)]])
        start += len(queries)


class RetrievalServer:
  """Holds the loaded index and serves it; `start()`/`stop()` for tests and the CLI alike."""

  def __init__(self, index: LoadedIndex, config: RetrievalServerConfig) -> None:
    self.index = index
    self.config = config
    self._rows = [p.to_row() for p in index.passages]
    self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retrieval")
    self._batcher = MicroBatcher(index.retriever.search_batch, self._executor, config.micro_batch)
    self._inflight = 0
    self._runner: web.AppRunner | None = None
    self.port: int | None = None
    self.addr_file: Path | None = None
    self.requests = {"retrieve": 0, "access": 0, "bad_request": 0, "busy": 0, "error": 0}

  def make_app(self) -> web.Application:
    app = web.Application(
      client_max_size=self.config.max_request_bytes,
      # bearer token when set; JSON bodies for aiohttp's own error statuses
      middlewares=[*http_guard.middlewares(self.config.host), json_errors],
    )
    app.router.add_post("/retrieve", self._retrieve)
    app.router.add_post("/access", self._access)
    app.router.add_get("/health", self._health)
    return app

  async def _read_json(self, request: web.Request) -> Any:
    raw = await http_guard.read_body(request, self.config.body_timeout_s)
    try:
      return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:  # too deep: 400
      raise RequestError(f"malformed JSON: {e}") from None

  async def _guarded(self, kind: str, request: web.Request, handler) -> web.StreamResponse:
    if self._inflight >= self.config.max_inflight:
      self.requests["busy"] += 1
      return _json_error(503, "server busy, retry later")
    self._inflight += 1
    try:
      body = await self._read_json(request)
      response = await handler(body)
      self.requests[kind] += 1
      return response
    except RequestError as e:
      self.requests["bad_request"] += 1
      return _json_error(400, str(e))
    except http_guard.SlowBody as e:
      self.requests["bad_request"] += 1
      return _json_error(408, str(e))
    except web.HTTPException:
      raise  # e.g. 413 for an oversized body
    except Exception as e:
      self.requests["error"] += 1
      log.exception("error serving %s", request.path)
      return _json_error(500, f"internal error: {type(e).__name__}")
    finally:
      self._inflight -= 1

  async def _retrieve(self, request: web.Request) -> web.StreamResponse:
    async def handle(body: Any) -> web.Response:
      queries, topk, return_scores = parse_retrieve(body, self.config)
      hits = await self._batcher.search(queries, topk) if queries else []
      rows = self._rows
      if return_scores:
        result = [[{"document": rows[i], "score": s} for i, s in h] for h in hits]
      else:
        result = [[rows[i] for i, _ in h] for h in hits]
      return web.json_response({"result": result})

    return await self._guarded("retrieve", request, handle)

  async def _access(self, request: web.Request) -> web.StreamResponse:
    async def handle(body: Any) -> web.Response:
      urls = parse_access(body, self.config)
      return web.json_response({"result": [self.index.pages.get(u) for u in urls]})

    return await self._guarded("access", request, handle)

  async def _health(self, request: web.Request) -> web.Response:
    m = self.index.manifest
    return web.json_response(
      {
        "status": "ok",
        "backend": m.get("backend"),
        "passages": len(self._rows),
        "pages": len(self.index.pages),
        "corpus_sha256": m.get("corpus_sha256"),
        "requests": self.requests,
        "batches": self._batcher.batches,
        "batched_queries": self._batcher.queries,
      }
    )

  async def start(self) -> int:
    """Binds and starts serving; returns the port and writes the address file."""
    self._runner = web.AppRunner(
      self.make_app(), access_log=None, keepalive_timeout=self.config.header_timeout_s
    )
    await self._runner.setup()
    await http_guard.listen(self._runner, self.config.host, self.config.port)
    sockets = [s for s in self._runner.addresses if isinstance(s, tuple)]
    self.port = int(sockets[0][1])
    if self.config.addr_dir:
      self.addr_file = write_address_file(Path(self.config.addr_dir), self.config.host, self.port)
    log.info(
      "retrieval server on http://%s:%d (%d passages, %d pages)",
      self.config.host,
      self.port,
      len(self._rows),
      len(self.index.pages),
    )
    return self.port

  async def stop(self) -> None:
    if self.addr_file is not None:
      self.addr_file.unlink(missing_ok=True)
      self.addr_file = None
    if self._runner is not None:
      await self._runner.cleanup()
      self._runner = None
    self._executor.shutdown(wait=False, cancel_futures=True)

  async def serve_forever(self, stop_event: asyncio.Event | None = None) -> None:
    await self.start()
    try:
      await (stop_event or asyncio.Event()).wait()
    finally:
      await self.stop()


async def run_server(index: LoadedIndex, config: RetrievalServerConfig) -> None:
  """Serves until SIGINT/SIGTERM, then removes the address file."""
  import signal

  stop = asyncio.Event()
  loop = asyncio.get_running_loop()
  for sig in (signal.SIGINT, signal.SIGTERM):
    with contextlib.suppress(NotImplementedError, RuntimeError):
      loop.add_signal_handler(sig, stop.set)
  server = RetrievalServer(index, config)
  t0 = time.perf_counter()
  await server.serve_forever(stop)
  log.info("retrieval server stopped after %.0f s", time.perf_counter() - t0)


def retrieve_rows(index: LoadedIndex, queries: Sequence[str], k: int) -> list[list[dict]]:
  """In-process search returning the same rows as the server (for scripts and tests)."""
  return [
    [index.passages[i].to_row() for i, _ in h] for h in index.retriever.search_batch(queries, k)
  ]
