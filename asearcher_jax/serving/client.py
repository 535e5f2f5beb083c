"""`GenerationClient` over HTTP: the same `generate` as the in-process Driver, served remotely.

Talks to the OpenAI facade (`serving/openai_api.py`) on its token-id path and rebuilds the exact
`GenerationResult` (tokens, behaviour logprobs, policy versions, stop reason) from the facade's
`asearcher` extension, so agents and the rollout code never care where the engine runs. Errors
mean the same as in process: ValueError for a request the server refuses (e.g. a prompt that does
not fit), EngineError when the engine failed or cannot be reached after bounded retries,
TimeoutError when a generation took too long.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from asearcher_jax import http_guard
from asearcher_jax.serving.driver import EngineError
from asearcher_jax.serving.types import GenerationResult, SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemoteClientConfig:
  """Attributes:
  timeout_s: longest one generate attempt may take (queueing + decoding on the server); then the
    connection is dropped and the server aborts the generation rather than finish it for nobody.
  connect_timeout_s: longest wait to open a connection.
  retries: extra attempts after a connection error or a 5xx answer (0: no retry). A 4xx is never
    retried, nor is a timeout (the generation itself is slow; retrying would double the load).
  backoff_s: first retry delay; doubled per retry (with jitter) up to max_backoff_s.
  max_backoff_s: longest delay between two attempts.
  max_connections: concurrent connections in the shared session pool.
  """

  timeout_s: float = 600.0
  connect_timeout_s: float = 10.0
  retries: int = 3
  backoff_s: float = 0.5
  max_backoff_s: float = 8.0
  max_connections: int = 512

  def __post_init__(self):
    if self.retries < 0 or self.timeout_s <= 0 or self.backoff_s < 0:
      raise ValueError("retries and backoff_s must be >= 0 and timeout_s > 0")


class RemoteRequestError(ValueError):
  """The server refused the request (HTTP 4xx); `status` and the server's message."""

  def __init__(self, status: int, message: str):
    super().__init__(f"HTTP {status}: {message}")
    self.status = status


def read_address(address_file: str | Path) -> str:
  """Base URL from a `serve-model` address file: JSON {"http": "ip:port", ...} or plain `ip:port`
  (ASearcher's discovery convention) or a URL."""
  text = Path(address_file).read_text().strip()
  if text.startswith("{"):
    text = json.loads(text)["http"]
  return text if "://" in text else f"http://{text}"


class RemoteGenerationClient:
  """A `GenerationClient` backed by a remote `serve-model` server.

  Give `base_url` ("http://127.0.0.1:8000") or `address_file` (re-read before each retry, so a
  restarted server on a new port is found). One aiohttp session is reused for all calls, created
  in the first calling event loop; `await close()` or use `async with`.
  """

  def __init__(
    self,
    base_url: str | None = None,
    *,
    address_file: str | Path | None = None,
    config: RemoteClientConfig = RemoteClientConfig(),
  ):
    if (base_url is None) == (address_file is None):
      raise ValueError("give exactly one of base_url and address_file")
    self._base_url = base_url.rstrip("/") if base_url else None
    self._address_file = Path(address_file) if address_file else None
    self.config = config
    self._session: aiohttp.ClientSession | None = None
    self.retried = 0  # attempts that were retried (connection errors and 5xx)

  @property
  def base_url(self) -> str:
    if self._base_url is not None:
      return self._base_url
    try:
      return read_address(self._address_file)
    except (OSError, ValueError, KeyError) as e:
      raise EngineError(f"cannot read server address from {self._address_file}: {e}") from e

  def _get_session(self) -> aiohttp.ClientSession:
    if self._session is None or self._session.closed:
      timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout_s)
      connector = aiohttp.TCPConnector(limit=self.config.max_connections)
      self._session = aiohttp.ClientSession(
        timeout=timeout, connector=connector, headers=http_guard.client_headers()
      )
    return self._session

  async def close(self) -> None:
    if self._session is not None:
      await self._session.close()
      self._session = None

  async def __aenter__(self) -> RemoteGenerationClient:
    return self

  async def __aexit__(self, *exc: object) -> None:
    await self.close()

  async def generate(
    self,
    token_ids: Sequence[int],
    sampling: SamplingParams,
    max_new_tokens: int,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] | None = None,
  ) -> GenerationResult:
    """Continues `token_ids` on the server; see GenerationClient."""
    body = {
      "prompt": [int(t) for t in token_ids],
      "max_tokens": int(max_new_tokens),
      "temperature": sampling.temperature,
      "top_p": sampling.top_p,
      "top_k": sampling.top_k,
      "seed": sampling.seed,
      "stop": list(stop),
      "stop_token_ids": None if stop_token_ids is None else [int(t) for t in stop_token_ids],
    }
    answer = await self.post("/v1/completions", body)
    try:
      ext = answer["choices"][0]["asearcher"]
      return GenerationResult(
        tokens=[int(t) for t in ext["token_ids"]],
        logprobs=[float(x) for x in ext["logprobs"]],
        versions=[int(v) for v in ext["versions"]],
        stop_reason=ext["stop_reason"],
      )
    except (KeyError, IndexError, TypeError, ValueError) as e:
      raise EngineError(f"malformed answer from {self.base_url}: {e!r}") from e

  async def health(self) -> dict[str, Any]:
    """The server's /health JSON (raises EngineError if unreachable)."""
    return await self._request("GET", "/health", None)

  async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POSTs JSON with bounded retries; returns the JSON answer."""
    return await self._request("POST", path, body)

  async def _request(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
    attempts = self.config.retries + 1
    last: Exception | None = None
    for attempt in range(attempts):
      if attempt:
        self.retried += 1
        delay = min(self.config.max_backoff_s, self.config.backoff_s * 2 ** (attempt - 1))
        await asyncio.sleep(delay * (0.5 + random.random() / 2))
      try:
        url = self.base_url + path
      except EngineError as e:  # no address file: a server between stop and restart
        last = e
        log.warning("attempt %d/%d: %s", attempt + 1, attempts, last)
        continue
      try:
        async with asyncio.timeout(self.config.timeout_s):
          async with self._get_session().request(method, url, json=body) as resp:
            text = await resp.text()
            status = resp.status
      except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
        last = EngineError(f"cannot reach {url}: {type(e).__name__}: {e}")
        log.warning("attempt %d/%d: %s", attempt + 1, attempts, last)
        continue
      message = _error_message(text)
      if status == 504:
        raise TimeoutError(f"{url}: {message}")
      if 400 <= status < 500:
        raise RemoteRequestError(status, message)
      if status >= 500:
        last = EngineError(f"{url}: HTTP {status}: {message}")
        log.warning("attempt %d/%d: %s", attempt + 1, attempts, last)
        continue
      try:
        return json.loads(text)
      except json.JSONDecodeError as e:
        raise EngineError(f"{url}: answer is not JSON: {text[:200]!r}") from e
    assert last is not None
    raise last


def _error_message(text: str) -> str:
  try:
    err = json.loads(text)["error"]
    return err["message"] if isinstance(err, dict) else str(err)
  except (json.JSONDecodeError, KeyError, TypeError):
    return text[:500]
