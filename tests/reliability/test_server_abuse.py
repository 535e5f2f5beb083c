"""Both HTTP servers (retrieval, serve-model's OpenAI API) under abuse: malformed requests derived
from each endpoint's valid body (seeded, and hypothesis-generated JSON), oversized bodies, slow
clients sending a byte a second, floods past the in-flight limit, and the optional bearer token.

Always a 4xx (or 503 when shedding load), never a 5xx, never a hang; a valid request still works
afterwards.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asearcher_jax import http_guard
from asearcher_jax.serving.openai_api import OpenAIServer, OpenAIServerConfig
from asearcher_jax.tools.http_retry import CallStats
from asearcher_jax.tools.retrieval.server import RetrievalServer, RetrievalServerConfig
from asearcher_jax.tools.search import LocalRetrievalClient, LocalRetrievalConfig
from harness import abuse
from harness.faults import LoopThread
from tests.serving.conftest import tokenizer  # noqa: F401
from tests.serving.test_openai_api import driver  # noqa: F401
from tests.tools.conftest import shipped_index  # noqa: F401

T = 60
RETRIEVE = abuse.Endpoint(path="/retrieve", valid={"queries": ["Lothair II"], "topk": 3})
ACCESS = abuse.Endpoint(path="/access", valid={"urls": ["https://en.wikipedia.org/wiki/Lilu"]})
COMPLETIONS = abuse.Endpoint(
  path="/v1/completions", valid={"prompt": [9, 3, 88, 31], "max_tokens": 2, "temperature": 0.0}
)
CHAT = abuse.Endpoint(
  path="/v1/chat/completions",
  valid={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
)
SLOW = dict(header_timeout_s=2.0, body_timeout_s=2.0)


@pytest.fixture
async def retrieval(shipped_index):  # noqa: F811
  server = RetrievalServer(shipped_index, RetrievalServerConfig(max_inflight=4, **SLOW))
  port = await asyncio.wait_for(server.start(), T)
  yield server, port
  await asyncio.wait_for(server.stop(), T)


@pytest.fixture
async def openai_api(driver):  # noqa: F811
  server = OpenAIServer(driver, OpenAIServerConfig(max_body_bytes=64 << 10, max_inflight=4, **SLOW))
  port = await asyncio.wait_for(server.start(), T)
  yield server, port
  await asyncio.wait_for(server.stop(), T)


async def still_serves(port: int, ep: abuse.Endpoint) -> None:
  timeout = aiohttp.ClientTimeout(total=T)
  url = f"http://127.0.0.1:{port}{ep.path}"
  async with aiohttp.ClientSession(timeout=timeout) as s, s.post(url, json=ep.valid) as r:
    assert r.status == 200, await r.text()


async def check_abuse(port: int, endpoints: list[abuse.Endpoint], body_limit: int) -> None:
  base = f"http://127.0.0.1:{port}"
  # A body that drops max_tokens is valid and generates (and may compile a shape): 120 s bound.
  report = await abuse.malformed_requests(base, endpoints, n=40, seed=1, timeout_s=120)
  assert report.tried == 40 * len(endpoints)
  assert report.hangs == 0 and report.server_errors == 0, report.failures[:5]
  assert set(report.statuses) <= {200, 400, 408, 413, 422, 499}, report.statuses
  assert report.statuses[400] >= report.tried // 2  # most of them really are bad
  assert await abuse.oversized(base, endpoints[0], body_limit + 1) == 413
  # Slow clients: a byte a second is cut off by the 2 s header / body timeouts.
  secs, got = await abuse.slow_client("127.0.0.1", port, endpoints[0].path, body=False)
  assert secs < 10 and not got.startswith(b"HTTP/1.1 200")
  secs, got = await abuse.slow_client("127.0.0.1", port, endpoints[0].path, body=True)
  assert secs < 10 and got.startswith(b"HTTP/1.1 408"), got[:60]
  # A flood past max_inflight = 4: every request answered, 200 or 503.
  report = await abuse.flood(base, endpoints[0], n=200, concurrency=64, timeout_s=120)
  assert report.hangs == 0 and set(report.statuses) <= {200, 503} and report.statuses[200] > 0
  await still_serves(port, endpoints[0])


async def test_retrieval_server_under_abuse(retrieval):
  server, port = retrieval
  await check_abuse(port, [RETRIEVE, ACCESS], server.config.max_request_bytes)
  assert server.requests["error"] == 0


async def test_openai_server_under_abuse(openai_api):
  server, port = openai_api
  await check_abuse(port, [COMPLETIONS, CHAT], server.config.max_body_bytes)
  assert server.requests["error"] == 0


JSON = st.recursive(
  st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
  lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
  max_leaves=12,
)


def field_bodies(ep: abuse.Endpoint) -> st.SearchStrategy:
  """The endpoint's valid body with any subset of its fields replaced by arbitrary JSON."""
  keys = sorted(ep.valid)
  return (
    st.fixed_dictionaries(
      {}, optional={k: JSON for k in [*keys, "n", "stop", "logprobs", "return_scores"]}
    ).map(lambda d: {**ep.valid, **d})
    | JSON
  )


@pytest.fixture(scope="module")
def live_servers(shipped_index, driver):  # noqa: F811
  loop = LoopThread()
  r = RetrievalServer(shipped_index, RetrievalServerConfig())
  o = OpenAIServer(driver, OpenAIServerConfig(max_body_bytes=64 << 10))
  ports = {"retrieval": loop.run(r.start()), "openai": loop.run(o.start())}
  yield ports
  loop.run(r.stop())
  loop.run(o.stop())
  loop.close()


def sync_post(port: int, path: str, body: bytes) -> int:
  req = urllib.request.Request(
    f"http://127.0.0.1:{port}{path}", data=body, headers={"Content-Type": "application/json"}
  )
  try:
    with urllib.request.urlopen(req, timeout=T) as r:
      return r.status
  except urllib.error.HTTPError as e:
    return e.code


@pytest.mark.parametrize(
  "server,ep", [("retrieval", RETRIEVE), ("retrieval", ACCESS), ("openai", COMPLETIONS),
                ("openai", CHAT)],
)  # fmt: skip
def test_generated_requests_get_4xx_never_5xx(live_servers, server, ep):
  @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
  @given(body=field_bodies(ep))
  def check(body):
    status = sync_post(live_servers[server], ep.path, json.dumps(body, allow_nan=True).encode())
    assert status < 500, (status, body)

  check()


async def test_bearer_token_when_set(monkeypatch, shipped_index, caplog):  # noqa: F811
  token = "planted-token-7f3a9c"
  monkeypatch.setenv(http_guard.TOKEN_ENV, token)
  server = RetrievalServer(shipped_index, RetrievalServerConfig())
  port = await asyncio.wait_for(server.start(), T)
  base = f"http://127.0.0.1:{port}"
  try:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=T)) as s:
      for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
        async with s.post(base + "/retrieve", json=RETRIEVE.valid, headers=headers) as r:
          assert r.status == 401 and token not in await r.text()
      async with s.get(base + "/health") as r:
        assert r.status == 200  # probes need no token
      ok = {"Authorization": f"Bearer {token}"}
      async with s.post(base + "/retrieve", json=RETRIEVE.valid, headers=ok) as r:
        assert r.status == 200
    # The project's own client sends it.
    client = LocalRetrievalClient(LocalRetrievalConfig(addresses=(f"127.0.0.1:{port}",)))
    try:
      docs = await asyncio.wait_for(client.search("Lothair II", 3, CallStats()), T)
    finally:
      await client.close()
    assert len(docs) == 3
  finally:
    await asyncio.wait_for(server.stop(), T)
  assert token not in caplog.text


def test_binding_beyond_loopback_without_a_token_warns(monkeypatch, caplog):
  monkeypatch.delenv(http_guard.TOKEN_ENV, raising=False)
  assert http_guard.middlewares("127.0.0.1") == [] and not caplog.records
  assert http_guard.middlewares("0.0.0.0") == []
  assert http_guard.TOKEN_ENV in caplog.text and "0.0.0.0" in caplog.text
