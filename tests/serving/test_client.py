"""RemoteGenerationClient: the same `generate` as the in-process driver, over the HTTP facade."""

from __future__ import annotations

import asyncio
import json
import time

import portpicker
import pytest
from aiohttp import web

from asearcher_jax.serving.client import (
  RemoteClientConfig,
  RemoteGenerationClient,
  RemoteRequestError,
  read_address,
)
from asearcher_jax.serving.driver import EngineError
from asearcher_jax.serving.openai_api import OpenAIServer, OpenAIServerConfig
from asearcher_jax.serving.types import GenerationClient, SamplingParams
from tests.serving.conftest import tiny_model

T = 60
FAST = RemoteClientConfig(timeout_s=T, retries=2, backoff_s=0.01, max_backoff_s=0.02)


@pytest.fixture
async def served(make_driver):
  driver = make_driver(tiny_model(seed=5), slots=4, max_seq_len=64, buckets=(8, 16, 32))
  server = OpenAIServer(driver, OpenAIServerConfig(port=0))
  port = await asyncio.wait_for(server.start(), T)
  yield driver, f"http://127.0.0.1:{port}"
  await asyncio.wait_for(server.stop(), T)


@pytest.mark.slow
async def test_remote_generate_equals_in_process_generate(served, tmp_path):
  driver, url = served
  prompts = [[5, 17, 42], [9, 3, 88, 31, 2, 40, 76, 61, 14, 3, 90, 11]]
  greedy = SamplingParams(temperature=0.0)
  sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=11)
  addr = tmp_path / "model.addr"
  addr.write_text(json.dumps({"http": url.removeprefix("http://"), "pid": 1}))
  async with RemoteGenerationClient(address_file=addr, config=FAST) as client:
    assert isinstance(client, GenerationClient)
    for sp in (greedy, sampled):
      for p in prompts:
        remote, local = await asyncio.wait_for(
          asyncio.gather(
            client.generate(p, sp, 10, stop_token_ids=()),
            driver.generate(p, sp, 10, stop_token_ids=()),
          ),
          T,
        )
        assert remote.tokens == local.tokens and remote.versions == local.versions
        assert remote.logprobs == pytest.approx(local.logprobs, abs=1e-6)
        assert remote.stop_reason == local.stop_reason == "length"
    # Stop token ids and stop strings mean the same remotely.
    first = (
      await asyncio.wait_for(client.generate(prompts[0], greedy, 10, stop_token_ids=()), T)
    ).tokens
    res = await asyncio.wait_for(
      client.generate(prompts[0], greedy, 10, stop_token_ids=[first[2]]), T
    )
    assert res.tokens == first[:3] and res.stop_reason == "stop"
    # A request the server refuses is a ValueError, as in process, and is not retried.
    with pytest.raises(ValueError, match="does not fit the context") as info:
      await asyncio.wait_for(client.generate(list(range(1, 70)), greedy, 4), T)
    assert isinstance(info.value, RemoteRequestError) and info.value.status == 400
    assert client.retried == 0
    assert (await asyncio.wait_for(client.health(), T))["status"] == "ok"


async def test_connection_errors_are_retried_then_raised():
  port = portpicker.pick_unused_port()  # nothing listens there
  client = RemoteGenerationClient(f"http://127.0.0.1:{port}", config=FAST)
  try:
    with pytest.raises(EngineError, match="cannot reach"):
      await asyncio.wait_for(client.generate([1, 2], SamplingParams(), 4), T)
    assert client.retried == 2
  finally:
    await client.close()


async def test_5xx_is_retried_and_a_result_comes_back():
  calls = []

  async def flaky(request: web.Request) -> web.Response:
    calls.append(await request.json())
    if len(calls) == 1:
      return web.json_response({"error": {"message": "busy", "type": "server_busy"}}, status=503)
    ext = {"token_ids": [7, 8], "logprobs": [-0.5, -1.5], "versions": [3, 4], "stop_reason": "stop"}
    return web.json_response({"choices": [{"index": 0, "text": "", "asearcher": ext}]})

  app = web.Application()
  app.router.add_post("/v1/completions", flaky)
  runner = web.AppRunner(app)
  await runner.setup()
  site = web.TCPSite(runner, "127.0.0.1", 0)
  await site.start()
  port = runner.addresses[0][1]
  try:
    async with RemoteGenerationClient(f"http://127.0.0.1:{port}/", config=FAST) as client:
      sp = SamplingParams(temperature=0.5, top_p=0.8, top_k=4, seed=9)
      res = await asyncio.wait_for(client.generate([1, 2, 3], sp, 5, stop=["</a>"]), T)
    assert res.tokens == [7, 8] and res.logprobs == [-0.5, -1.5] and res.versions == [3, 4]
    assert res.stop_reason == "stop" and client.retried == 1
    assert calls[-1] == {
      "prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0.5, "top_p": 0.8, "top_k": 4,
      "seed": 9, "stop": ["</a>"], "stop_token_ids": None,
    }  # fmt: skip
  finally:
    await asyncio.wait_for(runner.cleanup(), T)


def test_address_file_formats(tmp_path):
  f = tmp_path / "a"
  f.write_text("127.0.0.1:8010\n")  # ASearcher's discovery convention
  assert read_address(f) == "http://127.0.0.1:8010"
  f.write_text('{"http": "127.0.0.1:9", "grpc": "127.0.0.1:10"}')
  assert read_address(f) == "http://127.0.0.1:9"
  with pytest.raises(ValueError, match="exactly one"):
    RemoteGenerationClient()
  missing = RemoteGenerationClient(address_file=tmp_path / "missing")
  with pytest.raises(EngineError, match="cannot read server address"):
    _ = missing.base_url


async def test_a_client_timeout_aborts_the_generation_on_the_server(served):
  """The dropped connection cancels the handler, which aborts the request and frees its slot."""
  driver, url = served
  real = driver.engine.generate

  def slow(*args, **kwargs):
    time.sleep(0.05)
    return real(*args, **kwargs)

  driver.engine.generate = slow
  config = RemoteClientConfig(timeout_s=0.5, retries=0)
  try:
    async with RemoteGenerationClient(url, config=config) as client:
      with pytest.raises(TimeoutError):
        await asyncio.wait_for(
          client.generate([5, 6, 7], SamplingParams(), 50, stop_token_ids=()), T
        )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and driver.stats()["requests_aborted"] < 1:
      await asyncio.sleep(0.05)
    stats = driver.stats()
    assert stats["requests_aborted"] == 1 and stats["slots_active"] == 0
    assert stats["tokens_generated"] < 50
  finally:
    driver.engine.generate = real


async def test_a_server_whose_address_file_appears_late_is_found_by_a_retry(served, tmp_path):
  """serve-model removes its address file when it stops; a client calling between a stop and
  the restart retries (re-reading the file) instead of failing at once."""
  _, url = served
  addr = tmp_path / "late.addr"
  cfg = RemoteClientConfig(timeout_s=T, retries=6, backoff_s=0.05, max_backoff_s=0.1)
  async with RemoteGenerationClient(address_file=addr, config=cfg) as client:
    asyncio.get_running_loop().call_later(
      0.08, addr.write_text, json.dumps({"http": url.removeprefix("http://")})
    )
    out = await asyncio.wait_for(client.generate([5, 17, 42], SamplingParams(), 4), T)
    assert len(out.tokens) == 4 and client.retried >= 1
  never = RemoteGenerationClient(address_file=tmp_path / "never", config=FAST)
  with pytest.raises(EngineError, match="cannot read server address"):
    await asyncio.wait_for(never.generate([5], SamplingParams(), 2), T)
  assert never.retried == FAST.retries
