"""The local retrieval server: `/retrieve`, `/access`, `/health` over aiohttp.

Wire-compatible with ASearcher's and Search-R1's servers (same request fields, same
`{"result": ...}` shapes), so their clients work against it unchanged, whatever the backend.
Unlike them it does not serialise every request behind one lock: concurrent `/retrieve` requests
are collected for a short window, then scored as one batch split over `workers` threads (tantivy
and numpy release the GIL while they score), so the event loop keeps accepting while the index is
searched and throughput grows with the workers. `/access` page lookups run on the same threads
(an on-disk page store reads from disk).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import json
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from aiohttp import web

from asearcher_jax import http_guard
from asearcher_jax.tools.retrieval.discovery import write_address_file
from asearcher_jax.tools.retrieval.index import LoadedIndex, RowHits, load_index

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
  # Most queries scored in one batch (split over the workers).
  micro_batch: int = 256
  # Threads (or processes) that score batches (and look up pages) at once; more than 1 pays only
  # with cores to spare beside the clients (docs/measurements.md: 2 cost ~21% q/s on 2 cores).
  workers: int = 1
  # "thread": workers share this process's index and GIL (tantivy, faiss and numpy release it
  # while they score, but each search re-takes it, queued behind the event loop's Python);
  # "process": each worker is a process with its own GIL that loads the index directory itself
  # (memory-mapped for tantivy and faiss, so the page cache holds one copy; bm25s and the
  # passages of an in-memory index are loaded once a worker).
  worker_kind: Literal["thread", "process"] = "thread"
  # Process workers: how long they may take to load the index before the server gives up
  # (it does not listen until they have).
  worker_load_timeout_s: float = 1800.0
  # While a batch is being scored, requests arriving within this many ms join the next batch
  # together; a request that finds the server idle is scored at once (no added latency).
  batch_window_ms: float = 2.0
  # A search or page lookup not answered within this is a 503 (the client retries elsewhere).
  search_timeout_s: float = 30.0
  # A connection whose request headers have not arrived within this is closed (slow clients).
  header_timeout_s: float = 15.0
  # A request body that has not fully arrived within this is answered with 408.
  body_timeout_s: float = 30.0

  def __post_init__(self):
    for name in ("workers", "micro_batch", "max_batch", "max_inflight", "max_topk"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if self.worker_kind not in ("thread", "process"):
      raise ValueError(f"worker_kind must be 'thread' or 'process', got {self.worker_kind!r}")
    if not self.batch_window_ms >= 0:
      raise ValueError(f"batch_window_ms must be >= 0, got {self.batch_window_ms!r}")
    if not self.worker_load_timeout_s > 0:
      raise ValueError(f"worker_load_timeout_s must be > 0, got {self.worker_load_timeout_s!r}")
    if not self.search_timeout_s > 0:
      raise ValueError(f"search_timeout_s must be > 0, got {self.search_timeout_s!r}")


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


class SearchTimeout(Exception):
  """A search or lookup that outlived `search_timeout_s`; answered with 503."""


class MicroBatcher:
  """Coalesces concurrent searches into batches scored by up to `workers` threads at once.

  A request that finds every worker idle starts a batch at once. Otherwise requests queue: when
  a worker frees up, the queue is given `window_s` more to fill, then taken whole (up to
  `max_queries`) and split, by request, over the free workers. One `search_batch` call per
  chunk; each request's futures resolve as soon as its own chunk is scored. Dispatch happens in
  the callbacks themselves (no drain task): a freed worker takes the next batch before the
  answers of the last one are written, so it never waits on the event loop's other work.
  """

  def __init__(
    self,
    search_batch,
    executor: Executor,
    max_queries: int,
    *,
    workers: int = 1,
    window_s: float = 0.0,
  ) -> None:
    self._search_batch = search_batch
    self._executor = executor
    self._max_queries = max_queries
    self._workers = workers
    self._window_s = window_s
    self._pending: collections.deque[tuple[list[str], int, asyncio.Future]] = collections.deque()
    self._busy = 0
    self._window: asyncio.TimerHandle | None = None
    self.batches = 0
    self.queries = 0

  async def search(self, queries: list[str], k: int, timeout_s: float = 30.0) -> list[RowHits]:
    fut = asyncio.get_running_loop().create_future()
    self._pending.append((queries, k, fut))
    self._next()
    try:
      return await asyncio.wait_for(fut, timeout_s)
    except TimeoutError:
      raise SearchTimeout(f"search not answered within {timeout_s:g} s") from None

  def _next(self) -> None:
    """Start a batch if a worker is free, after the window when another batch is running."""
    if not self._pending or self._busy >= self._workers or self._window is not None:
      return
    if self._busy and self._window_s > 0:  # under load: let the next batch fill
      self._window = asyncio.get_running_loop().call_later(self._window_s, self._window_closed)
      return
    self._dispatch(self._workers - self._busy)

  def _window_closed(self) -> None:
    self._window = None
    if self._pending and self._busy < self._workers:
      self._dispatch(self._workers - self._busy)

  def _dispatch(self, free: int) -> None:
    batch, n = [], 0
    while self._pending and (not batch or n + len(self._pending[0][0]) <= self._max_queries):
      item = self._pending.popleft()
      batch.append(item)
      n += len(item[0])
    # Split by request into up to `free` chunks of about n / free queries each.
    chunks, chunk, size, target = [], [], 0, -(-n // min(free, len(batch)))
    for item in batch:
      chunk.append(item)
      size += len(item[0])
      if size >= target:
        chunks.append(chunk)
        chunk, size = [], 0
    if chunk:
      chunks.append(chunk)
    loop = asyncio.get_running_loop()
    for chunk in chunks:
      flat = [q for queries, _, _ in chunk for q in queries]
      k = max(k for _, k, _ in chunk)
      self._busy += 1
      done = loop.run_in_executor(self._executor, self._search_batch, flat, k)
      done.add_done_callback(functools.partial(self._finish, chunk=chunk, n=len(flat)))

  def _finish(self, done: asyncio.Future, *, chunk: list, n: int) -> None:
    self._busy -= 1
    try:
      self._next()  # keep the worker busy first; the answers below are written after
    finally:
      self._answer(done, chunk=chunk, n=n)

  def _answer(self, done: asyncio.Future, *, chunk: list, n: int) -> None:
    if done.cancelled() or done.exception() is not None:
      # a scoring bug fails these requests (500), not the server
      error = RuntimeError("search cancelled") if done.cancelled() else done.exception()
      for _, _, fut in chunk:
        if not fut.done():
          fut.set_exception(error)
      return
    hits = done.result()
    self.batches += 1
    self.queries += n
    start = 0
    for queries, k_req, fut in chunk:
      if not fut.done():  # the client may have gone away
        fut.set_result([h[:k_req] for h in hits[start : start + len(queries)]])
      start += len(queries)


# The index a process worker loaded (`worker_kind="process"`), one per worker process.
_WORKER_INDEX: LoadedIndex | None = None


def _load_worker_index(directory: str) -> None:
  global _WORKER_INDEX
  _WORKER_INDEX = load_index(Path(directory))


def _worker_search_rows(queries: list[str], k: int) -> list[RowHits]:
  assert _WORKER_INDEX is not None
  return _WORKER_INDEX.search_rows(queries, k)


def _worker_pages(urls: list[str]) -> list[dict[str, str] | None]:
  assert _WORKER_INDEX is not None
  return [_WORKER_INDEX.pages.get(u) for u in urls]


def _worker_ready() -> int:
  assert _WORKER_INDEX is not None
  return len(_WORKER_INDEX.passages)


class RetrievalServer:
  """Holds the loaded index and serves it; `start()`/`stop()` for tests and the CLI alike."""

  def __init__(self, index: LoadedIndex, config: RetrievalServerConfig) -> None:
    self.index = index
    self.config = config
    self._executor: Executor
    if config.worker_kind == "process":
      if index.directory is None:
        raise ValueError("process workers need an index loaded from a directory (load_index)")
      import multiprocessing

      # spawn, not fork: the server has threads, and a dense index's encoder may hold jax state.
      self._executor = ProcessPoolExecutor(
        max_workers=config.workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_load_worker_index,
        initargs=(str(index.directory),),
      )
      search_rows, self._pages = _worker_search_rows, _worker_pages
    else:
      self._executor = ThreadPoolExecutor(
        max_workers=config.workers, thread_name_prefix="retrieval"
      )
      search_rows = index.search_rows
      self._pages = lambda urls: [self.index.pages.get(u) for u in urls]
    self._batcher = MicroBatcher(
      search_rows,
      self._executor,
      config.micro_batch,
      workers=config.workers,
      window_s=config.batch_window_ms / 1000,
    )
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
    except SearchTimeout as e:
      self.requests["busy"] += 1
      return _json_error(503, str(e))
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
      timeout = self.config.search_timeout_s
      hits = await self._batcher.search(queries, topk, timeout) if queries else []
      if return_scores:
        result = [[{"document": row, "score": s} for row, s in h] for h in hits]
      else:
        result = [[row for row, _ in h] for h in hits]
      return web.json_response({"result": result})

    return await self._guarded("retrieve", request, handle)

  async def _access(self, request: web.Request) -> web.StreamResponse:
    async def handle(body: Any) -> web.Response:
      urls = parse_access(body, self.config)
      if not urls:
        return web.json_response({"result": []})
      lookup = asyncio.get_running_loop().run_in_executor(self._executor, self._pages, urls)
      try:
        pages = await asyncio.wait_for(lookup, self.config.search_timeout_s)
      except TimeoutError:
        raise SearchTimeout(
          f"access not answered within {self.config.search_timeout_s:g} s"
        ) from None
      return web.json_response({"result": pages})

    return await self._guarded("access", request, handle)

  async def _health(self, request: web.Request) -> web.Response:
    m = self.index.manifest
    return web.json_response(
      {
        "status": "ok",
        "backend": m.get("backend"),
        "passages": len(self.index.passages),
        "workers": self.config.workers,
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
    if self.config.worker_kind == "process":  # the workers load the index before we listen
      loop = asyncio.get_running_loop()
      ready = [
        loop.run_in_executor(self._executor, _worker_ready) for _ in range(self.config.workers)
      ]
      try:
        await asyncio.wait_for(asyncio.gather(*ready), self.config.worker_load_timeout_s)
      except TimeoutError:
        raise RuntimeError(
          f"retrieval workers did not load {self.index.directory} within "
          f"{self.config.worker_load_timeout_s:.0f} s (RetrievalServerConfig.worker_load_timeout_s)"
        ) from None
    await http_guard.listen(self._runner, self.config.host, self.config.port)
    sockets = [s for s in self._runner.addresses if isinstance(s, tuple)]
    self.port = int(sockets[0][1])
    if self.config.addr_dir:
      self.addr_file = write_address_file(Path(self.config.addr_dir), self.config.host, self.port)
    log.info(
      "retrieval server on http://%s:%d (%d passages, %d pages)",
      self.config.host,
      self.port,
      len(self.index.passages),
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
  return [[row for row, _ in h] for h in index.search_rows(queries, k)]
