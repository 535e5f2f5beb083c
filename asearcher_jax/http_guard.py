"""What every HTTP server of the project (the retrieval server, serve-model's OpenAI API) does
about clients it cannot trust: an optional bearer token, and timeouts for slow clients.

The token comes from the environment (`$ASEARCHER_SERVER_TOKEN`), never from a config file, so
it stays out of gin files, run directories and logs. When it is set, every request but
`/health` must carry `Authorization: Bearer <token>` (401 otherwise) and the project's own
clients send it. A server bound beyond loopback without a token logs a warning naming the
variable.

Slow clients (slowloris): aiohttp closes a connection whose request headers have not arrived
within its keep-alive timeout, so servers pass `header_timeout_s` as that; a body that trickles
in is cut by `read_body` after `body_timeout_s` with 408.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from collections.abc import Awaitable, Callable

from aiohttp import web

from asearcher_jax.errors import AsearcherError

log = logging.getLogger(__name__)

TOKEN_ENV = "ASEARCHER_SERVER_TOKEN"
LOOPBACK = ("127.0.0.1", "::1", "localhost")
OPEN_PATHS = ("/health",)  # liveness probes need no token


async def listen(runner: web.AppRunner, host: str, port: int) -> None:
  """Binds `runner` to host:port, or raises one line naming the address (a port in use, an
  unknown host, an address not on this machine) after freeing the runner."""
  try:
    await web.TCPSite(runner, host, port).start()
  except OSError as e:
    await asyncio.wait_for(runner.cleanup(), 30)
    reason = (e.strerror or str(e)).rsplit(": ", 1)[-1].lower()
    raise AsearcherError(f"cannot listen on {host}:{port}: {reason}") from e


def server_token(host: str) -> str | None:
  """The bearer token servers require (None: none); warns once per server bound beyond
  loopback without one."""
  token = os.environ.get(TOKEN_ENV) or None
  if token is None and host not in LOOPBACK:
    log.warning(
      "serving on %s without a bearer token: anyone who can reach it can use it; set $%s",
      host, TOKEN_ENV,
    )  # fmt: skip
  return token


def client_headers() -> dict[str, str]:
  """Headers the project's own clients send to its servers."""
  token = os.environ.get(TOKEN_ENV) or None
  return {"Authorization": f"Bearer {token}"} if token else {}


def bearer_middleware(token: str) -> Callable:
  """401 for any request to a path outside OPEN_PATHS without the token (compared in constant
  time; the token never appears in a response or a log line)."""
  expected = f"Bearer {token}".encode()

  @web.middleware
  async def check(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
  ) -> web.StreamResponse:
    if request.path not in OPEN_PATHS:
      got = request.headers.get("Authorization", "").encode()
      if not hmac.compare_digest(got, expected):
        return web.json_response({"error": "missing or wrong bearer token"}, status=401)
    return await handler(request)

  return check


def middlewares(host: str) -> list[Callable]:
  token = server_token(host)
  return [bearer_middleware(token)] if token else []


class SlowBody(ValueError):
  """The request body did not arrive within the body timeout (answered with 408)."""


async def read_body(request: web.Request, timeout_s: float) -> bytes:
  """The whole body, or SlowBody if it trickles in slower than `timeout_s` in all."""
  try:
    return await asyncio.wait_for(request.read(), timeout_s)
  except TimeoutError:
    raise SlowBody(f"request body not received within {timeout_s:g} s") from None
