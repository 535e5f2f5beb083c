"""Our Engine under JetStream 0.2.2's orchestrator + gRPC server: its own stub gets the text our
Driver produces (greedy), for text and token content; bad requests are INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from asearcher_jax.serving.jetstream import import_core
from asearcher_jax.serving.jetstream_server import GrpcServerConfig, JetStreamGrpcServer
from asearcher_jax.serving.types import SamplingParams
from tests.serving.conftest import VOCAB, tiny_model

T = 60
core = import_core()
pb2 = core.jetstream_pb2


def by_tokens(ids, n: int):
  return pb2.DecodeRequest(
    max_tokens=n, token_content=pb2.DecodeRequest.TokenContent(token_ids=ids)
  )


def by_text(text: str, n: int):
  return pb2.DecodeRequest(max_tokens=n, text_content=pb2.DecodeRequest.TextContent(text=text))


async def _decode(stub, request) -> tuple[str, list[int]]:
  text, ids = [], []
  async for response in stub.Decode(request, timeout=T):
    (sample,) = response.stream_content.samples
    text.append(sample.text)
    ids.extend(sample.token_ids)
  return "".join(text), ids


async def test_grpc_decode_equals_driver_greedy(make_driver, tokenizer):
  driver = make_driver(tiny_model(seed=6), slots=2, max_seq_len=64, buckets=(8, 16, 32))
  server = JetStreamGrpcServer(driver.engine, GrpcServerConfig(port=0))
  port = await asyncio.wait_for(server.start(), T)
  try:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
      stub = core.jetstream_pb2_grpc.OrchestratorStub(channel)
      health = await stub.HealthCheck(pb2.HealthCheckRequest(), timeout=T)
      assert health.is_live
      # Digits tokenize one id each, all inside the tiny model's vocabulary.
      for text, n in (("31415926535", 12), ("2718", 5), ("7", 3)):
        prompt = tokenizer.encode(text)
        assert max(prompt) < VOCAB
        ref = await asyncio.wait_for(
          driver.generate(prompt, SamplingParams(temperature=0.0), n, stop_token_ids=()), T
        )
        want = tokenizer.decode(ref.tokens)
        got_text, got_ids = await _decode(stub, by_text(text, n))
        assert (got_text, got_ids) == (want, ref.tokens)
        _, tok_ids = await _decode(stub, by_tokens(prompt, n))
        assert tok_ids == ref.tokens
      # Concurrent requests share the slots (more requests than slots) and stay exact.
      prompts = [[5, 17, 42], [9, 3, 88], [1, 2, 3, 4], [60, 61]]
      refs = await asyncio.wait_for(
        asyncio.gather(
          *[
            driver.generate(p, SamplingParams(temperature=0.0), 6, stop_token_ids=())
            for p in prompts
          ]
        ),
        T,
      )
      got = await asyncio.wait_for(
        asyncio.gather(*[_decode(stub, by_tokens(p, 6)) for p in prompts]), T
      )
      assert [ids for _, ids in got] == [r.tokens for r in refs]
      # Requests that cannot be served are rejected before they reach JetStream's threads.
      for bad, fragment in (
        (by_tokens([5] * 80, 4), "does not fit"),
        (by_tokens([5, 10**9], 4), "token ids must be in [0, "),  # as the OpenAI facade says
        (by_tokens([5, -1], 4), "token ids must be in [0, "),
        (by_text("", 4), "empty prompt"),
        (by_tokens([5], 0), "max_tokens"),
        (pb2.DecodeRequest(max_tokens=4), "set text_content or token_content"),
      ):  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as info:
          await _decode(stub, bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert fragment in info.value.details()
      # The server keeps serving after the rejections.
      _, ids = await _decode(
        stub,
        pb2.DecodeRequest(
          max_tokens=3, token_content=pb2.DecodeRequest.TokenContent(token_ids=[8, 9])
        ),
      )
      assert len(ids) == 3
  finally:
    await asyncio.wait_for(server.stop(), T)


async def test_prefill_never_raises_into_jetstream_threads(make_driver):
  """A prompt that slips past validation (direct Driver use) completes empty instead of
  SIGKILLing the process, and a full cache marks the slot invalid."""
  from asearcher_jax.serving.jetstream_server import JetStreamEngine

  driver = make_driver(tiny_model(seed=6), slots=2, max_seq_len=16, buckets=(8,))
  engine = JetStreamEngine(driver.engine)
  params = engine.load_params()
  state = engine.init_decode_state()
  padded, n = [5] * 20, 20
  state = engine.insert(
    engine.prefill(params=params, padded_tokens=padded, true_length=n), state, 0
  )
  state = engine.insert(
    engine.prefill(params=params, padded_tokens=[1] * 14, true_length=14), state, 1
  )
  valid, lengths = [], []
  for _ in range(3):
    state, result = engine.generate(params, state)
    data = result.convert_to_numpy()
    valid.append([int(data.get_result_at_slot(s).valid[0, 0]) for s in (0, 1)])
    lengths.append(int(data.get_result_at_slot(1).lengths[0]))
  assert [v[0] for v in valid] == [0, 0, 0]  # rejected: never valid
  assert [v[1] for v in valid] == [1, 1, 1] and lengths == [1, 2, 3]  # 13 + 3 = 16 fits
  state, result = engine.generate(params, state)
  assert int(result.convert_to_numpy().get_result_at_slot(1).valid[0, 0]) == 0  # cache full


async def test_grpc_requires_the_bearer_token_when_one_is_set(make_driver, monkeypatch, caplog):
  """$ASEARCHER_SERVER_TOKEN guards the gRPC service as it guards HTTP: Decode without the token
  (or with a wrong one) is UNAUTHENTICATED, HealthCheck stays open, the token is never echoed."""
  from asearcher_jax import http_guard

  token = "planted-grpc-token-7c2d"
  monkeypatch.setenv(http_guard.TOKEN_ENV, token)
  driver = make_driver(tiny_model(seed=6), slots=2, max_seq_len=64, buckets=(8, 16))
  server = JetStreamGrpcServer(driver.engine, GrpcServerConfig(port=0))
  port = await asyncio.wait_for(server.start(), T)
  try:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
      stub = core.jetstream_pb2_grpc.OrchestratorStub(channel)
      assert (await stub.HealthCheck(pb2.HealthCheckRequest(), timeout=T)).is_live
      for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", token),)):
        with pytest.raises(grpc.aio.AioRpcError) as e:
          async for _ in stub.Decode(by_tokens([5, 17], 3), timeout=T, metadata=metadata):
            pass
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert token not in (e.value.details() or "")
      ok = (("authorization", f"Bearer {token}"),)
      ids = []
      async for response in stub.Decode(by_tokens([5, 17], 3), timeout=T, metadata=ok):
        ids.extend(response.stream_content.samples[0].token_ids)
      assert len(ids) == 3
  finally:
    await asyncio.wait_for(server.stop(), T)
  assert token not in caplog.text
