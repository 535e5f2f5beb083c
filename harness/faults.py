"""Fault injection on loopback: an HTTP proxy that breaks a set fraction of requests, a process
that can be killed and restarted, and a checkpoint write that runs out of disk.

`FaultProxy` stands between a client and a real server (the retrieval server, a web tool
stand-in, `serve-model`) on 127.0.0.1 and speaks the same wire format: most requests are
forwarded byte for byte; a seeded fraction get one of the faults operators see from real
providers instead: 429 with Retry-After, 500, a response that never comes (the client's timeout
must fire), a body cut short, a body that is not UTF-8, or a dropped connection. Every injected
fault is counted by kind, so a run can report what it survived.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
from aiohttp import web

FAULT_KINDS = ("429", "500", "timeout", "truncated", "non_utf8", "reset")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultConfig:
  """Attributes:
  rate: fraction of requests that get a fault (0 = a plain proxy).
  kinds: which faults, drawn uniformly.
  seed: seeds which requests fail and how.
  hang_s: how long a "timeout" fault holds the request before dropping it (longer than the
    client's timeout, or the client is not being tested).
  upstream_timeout_s: bound on one forwarded request.
  """

  rate: float = 0.1
  kinds: tuple[str, ...] = FAULT_KINDS
  seed: int = 0
  hang_s: float = 5.0
  upstream_timeout_s: float = 60.0

  def __post_init__(self):
    if not 0.0 <= self.rate <= 1.0:
      raise ValueError(f"rate must be in [0, 1], got {self.rate}")
    unknown = set(self.kinds) - set(FAULT_KINDS)
    if unknown or not self.kinds:
      raise ValueError(f"fault kinds must be among {FAULT_KINDS}, got {self.kinds}")


class FaultProxy:
  """A loopback HTTP proxy in front of `upstream()` ("host:port", re-read per request so the
  server behind it may restart on another port) that injects faults at `config.rate`."""

  def __init__(self, upstream: Callable[[], str | None], config: FaultConfig) -> None:
    self.upstream = upstream
    self.config = config
    self.injected: Counter[str] = Counter()
    self.forwarded = 0
    self.upstream_errors = 0  # the server behind was down: answered 502
    self._rng = random.Random(config.seed)
    self._runner: web.AppRunner | None = None
    self._session: aiohttp.ClientSession | None = None
    self.address = ""

  async def start(self) -> str:
    app = web.Application(client_max_size=64 << 20)
    app.router.add_route("*", "/{tail:.*}", self._handle)
    self._runner = web.AppRunner(app, handle_signals=False)
    await self._runner.setup()
    site = web.TCPSite(self._runner, "127.0.0.1", 0)
    await site.start()
    port = self._runner.addresses[0][1]
    self.address = f"127.0.0.1:{port}"
    self._session = aiohttp.ClientSession(
      timeout=aiohttp.ClientTimeout(total=self.config.upstream_timeout_s)
    )
    return self.address

  async def stop(self) -> None:
    if self._session is not None:
      await self._session.close()
    if self._runner is not None:
      await self._runner.cleanup()

  @property
  def faults_injected(self) -> int:
    return sum(self.injected.values())

  def _draw(self) -> str | None:
    if self._rng.random() >= self.config.rate:
      return None
    return self._rng.choice(self.config.kinds)

  async def _handle(self, request: web.Request) -> web.StreamResponse:
    body = await request.read()
    fault = self._draw()
    if fault in ("429", "500", "timeout", "reset"):
      self.injected[fault] += 1
      return await self._fail(request, fault)
    target = self.upstream()
    if target is None:
      self.upstream_errors += 1
      return web.json_response({"error": "no upstream"}, status=502)
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
    try:
      async with self._session.request(
        request.method, f"http://{target}{request.path_qs}", data=body, headers=headers
      ) as up:
        payload = await up.read()
        status, ctype = up.status, up.headers.get("Content-Type", "application/octet-stream")
    except (aiohttp.ClientError, TimeoutError):
      self.upstream_errors += 1
      return web.json_response({"error": f"upstream {target} unreachable"}, status=502)
    self.forwarded += 1
    if fault == "truncated" and len(payload) > 1:
      self.injected[fault] += 1
      payload = payload[: len(payload) // 2]
    elif fault == "non_utf8":
      self.injected[fault] += 1
      payload = b"\xff\xfe\xfa" + payload[:16] + b"\xc3\x28"
    return web.Response(body=payload, status=status, headers={"Content-Type": ctype})

  async def _fail(self, request: web.Request, fault: str) -> web.StreamResponse:
    if fault == "429":
      return web.json_response({"error": "rate limited"}, status=429, headers={"Retry-After": "0"})
    if fault == "500":
      return web.json_response({"error": "injected"}, status=500)
    if fault == "timeout":
      await asyncio.sleep(self.config.hang_s)
    # "reset" (and a timeout that outlived its client): drop the connection with no response.
    transport = request.transport
    if transport is not None:
      transport.close()
    raise ConnectionResetError("injected")


_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


class LoopThread:
  """An asyncio loop on a daemon thread, for servers and proxies a synchronous test drives."""

  def __init__(self) -> None:
    self.loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self.loop.run_forever, name="faults", daemon=True)
    self._thread.start()

  def run(self, coro: Any, timeout: float = 60.0) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

  def close(self) -> None:
    self.loop.call_soon_threadsafe(self.loop.stop)
    self._thread.join(10)


# --- disk faults ---------------------------------------------------------------------------------


@contextlib.contextmanager
def no_space_on_save(checkpointer: Any, *, failures: int = 1) -> Iterator[list[int]]:
  """Makes the next `failures` saves of `checkpointer` (a `checkpoint.Checkpointer`) raise
  OSError(ENOSPC) inside Orbax's manager, as a full disk does; yields the steps that failed."""
  manager = checkpointer._manager
  real = manager.save
  failed: list[int] = []

  def save(step: int, *args: Any, **kw: Any) -> bool:
    if len(failed) < failures:
      failed.append(step)
      raise OSError(errno.ENOSPC, "No space left on device (injected)", str(step))
    return real(step, *args, **kw)

  manager.save = save
  try:
    yield failed
  finally:
    manager.save = real
