"""Our Engine under JetStream 0.2.2's own orchestrator and gRPC service, so JetStream clients work.

JetStream's `Decode` RPC (text or token content, streamed text + token ids) is served by its
`orchestrator.Driver` and `LLMOrchestrator` over our `Engine`, with three thin adapters for what
0.2.2 gets wrong for us:

  * `JetStreamEngine` wraps the Engine. 0.2.2 emits only tokens from `generate` steps, so the token
    `prefill` samples would be lost: the wrapper prefills prompt[:-1] and feeds the last prompt
    token at the first step, so step 1 emits the first real token. It also rewrites the length
    column to *generated* tokens (the orchestrator compares it with `max_tokens`; our engine
    writes cache length) and marks a slot invalid once its cache is full (the orchestrator then
    completes it). Prefill never raises: a JetStream thread error SIGKILLs the process.
  * `JetStreamTokenizer` puts our HF tokenizer behind `tokenizer_api.Tokenizer`. Qwen has no BOS
    token, so `is_bos` is ignored; `_Driver` likewise pads token content without prepending one.
  * `_Orchestrator` rejects requests that cannot be served (empty, a token id outside the
    vocabulary, too long: `request.prompt_problem`, as the OpenAI facade; max_tokens < 1) with
    INVALID_ARGUMENT before they reach the threads.

Sampling is greedy (the 0.2.2 proto has no sampling fields), logprobs and policy versions do not
cross the wire (the proto has no field for them) and weights are those loaded at start (0.2.2
reads params once per thread): RL uses the in-process `Driver` or the OpenAI facade instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import logging
import threading
from typing import Any

import grpc
import jax
import jax.numpy as jnp
import numpy as np

from asearcher_jax import http_guard
from asearcher_jax.serving.engine import Engine
from asearcher_jax.serving.engine_steps import LENGTH, VALID, Prefix, VersionedParams
from asearcher_jax.serving.jetstream import EngineContract, import_core, pad_ids
from asearcher_jax.serving.request import prompt_problem

log = logging.getLogger(__name__)
_core = import_core()


@functools.partial(jax.jit, static_argnums=3)
def _fix_result(data: jax.Array, start: jax.Array, ok: jax.Array, max_seq_len: int) -> jax.Array:
  cache_len = data[:, LENGTH]
  valid = ok & (cache_len <= max_seq_len)  # beyond it the slot would overwrite its last position
  data = data.at[:, LENGTH].set(cache_len - start)
  return data.at[:, VALID].set(valid.astype(data.dtype))


class JetStreamEngine(EngineContract):
  """Adapts an `Engine` to the 0.2.2 orchestrator (see the module docstring); shares its compiled
  functions and weights, so serving both paths from one process compiles nothing twice."""

  def __init__(self, engine: Engine):
    self.engine = engine
    self.tokenizer, self.cfg, self._mesh = engine.tokenizer, engine.cfg, engine.mesh
    slots = engine.max_concurrent_decodes
    # Per slot, set by insert and read by generate (both on the orchestrator's generate thread).
    self._start = np.zeros((slots,), np.int32)  # cache length when the slot was inserted
    self._ok = np.zeros((slots,), bool)  # False: a rejected request; its first step is invalid
    self._rejected: set[int] = set()  # id() of prefixes made for rejected requests
    self._lock = threading.Lock()

  def load_params(self, *args, **kwargs) -> VersionedParams:
    return self.engine.load_params()

  def prefill(
    self,
    *,
    params: VersionedParams,
    existing_prefix: Prefix | None = None,
    padded_tokens: jax.Array,
    true_length: int,
  ) -> Prefix:
    ids = [int(t) for t in np.asarray(padded_tokens).reshape(-1)[:true_length]]
    limit = self.engine.cfg.max_seq_len
    if not ids or len(ids) >= limit:
      log.warning("rejecting a prompt of %d tokens (max_seq_len=%d)", len(ids), limit)
      return self._reject(params)
    try:
      head, last = ids[:-1], ids[-1]
      padded = np.zeros((1, self.engine.bucket_for(max(len(head), 1))), np.int32)
      padded[0, : len(head)] = head
      prefix = self.engine.prefill(params=params, padded_tokens=padded, true_length=len(head))
      # Fresh arrays: the orchestrator deletes every prefix leaf after insert, and jit may
      # forward `params.version` as the very same buffer.
      last = jnp.asarray(last, jnp.int32)
      return prefix.replace(next_token=last, version=jnp.array(prefix.version))
    except Exception:  # an exception here would SIGKILL the process (JetThread)
      log.exception("prefill failed; the request completes empty")
      return self._reject(params)

  def _reject(self, params: VersionedParams) -> Prefix:
    padded = np.zeros((1, self.engine.cfg.buckets[0]), np.int32)
    prefix = self.engine.prefill(params=params, padded_tokens=padded, true_length=0)
    prefix = prefix.replace(version=jnp.array(prefix.version))
    with self._lock:
      self._rejected.add(id(prefix))
    return prefix

  def insert(self, prefix: Prefix, decode_state: Any, slot: int) -> Any:
    with self._lock:
      rejected = id(prefix) in self._rejected
      self._rejected.discard(id(prefix))
    self._start[slot] = int(prefix.true_length)
    self._ok[slot] = not rejected
    return self.engine.insert(prefix, decode_state, slot)

  def generate(self, params: VersionedParams, decode_state: Any) -> tuple[Any, Any]:
    state, result = self.engine.generate(params, decode_state)
    data = _fix_result(
      result.data, jnp.asarray(self._start), jnp.asarray(self._ok), self.engine.cfg.max_seq_len
    )
    return state, result.replace(data=data)

  def init_decode_state(self, *args, **kwargs) -> Any:
    return self.engine.init_decode_state()


class _Driver(_core.orchestrator.Driver):
  """0.2.2's Driver, except token content is padded without a BOS (0.2.2 prepends `bos_id`)."""

  def _process_prefill_content(self, request, tokenizer, is_bos, max_prefill_length):
    content = request.prefill_content
    if isinstance(content, str):
      return tokenizer.encode(content, jax_padding=self._jax_padding)
    return pad_ids(list(content), tokenizer.pad_id, jax_padding=self._jax_padding)


class _Orchestrator(_core.orchestrator.LLMOrchestrator):
  """Rejects unservable requests with INVALID_ARGUMENT instead of feeding them to the threads."""

  def __init__(self, driver: _Driver, engine: JetStreamEngine):
    super().__init__(driver=driver)
    self._engine = engine

  def _problem(self, request) -> str | None:
    which = request.WhichOneof("content")
    if which is None:
      return "set text_content or token_content"
    engine = self._engine.engine
    if which == "text_content":
      ids = engine.tokenizer.encode(request.text_content.text)
    else:
      ids = list(request.token_content.token_ids)
    problem = prompt_problem(ids, vocab_size=engine.model_cfg.vocab_size,
                             max_seq_len=engine.cfg.max_seq_len)  # fmt: skip
    if problem is not None:  # the same check and words as the OpenAI facade
      return problem
    if request.max_tokens < 1:
      return f"max_tokens must be >= 1, got {request.max_tokens}"
    return None

  async def Decode(self, request, context=None):
    problem = self._problem(request)
    if problem is not None:
      if context is None:
        raise ValueError(problem)
      await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
    async for response in super().Decode(request, context):
      yield response


class BearerInterceptor(grpc.aio.ServerInterceptor):
  """UNAUTHENTICATED for every RPC but `HealthCheck` without `authorization: Bearer <token>`
  metadata: the gRPC side of `http_guard`'s bearer token (same variable, same constant-time
  comparison; the token never appears in a status message or a log line)."""

  OPEN_METHODS = ("/HealthCheck",)  # liveness probes need no token, as /health over HTTP

  def __init__(self, token: str):
    self._expected = f"Bearer {token}".encode()

  async def intercept_service(self, continuation, details):
    handler = await continuation(details)
    if handler is None or details.method.endswith(self.OPEN_METHODS):
      return handler
    got = dict(details.invocation_metadata or ()).get("authorization", "")
    if hmac.compare_digest(str(got).encode(), self._expected):
      return handler

    async def deny(request, context):
      await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    make = (
      grpc.unary_stream_rpc_method_handler
      if handler.response_streaming
      else grpc.unary_unary_rpc_method_handler
    )
    return make(
      deny,
      request_deserializer=handler.request_deserializer,
      response_serializer=handler.response_serializer,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class GrpcServerConfig:
  """Attributes:
  host: interface to bind; loopback by default so nothing is exposed by accident.
  port: TCP port; 0 picks a free one (`JetStreamGrpcServer.port` after start).
  stop_grace_s: how long in-flight RPCs may finish at shutdown before they are cancelled.
  """

  host: str = "127.0.0.1"
  port: int = 0
  stop_grace_s: float = 2.0


class JetStreamGrpcServer:
  """JetStream's `Orchestrator` gRPC service (grpc.aio, in the caller's event loop) over an Engine.

  `await start()` returns the bound port; `await stop()` stops the RPCs, then the orchestrator's
  threads (0.2.2's detokenize threads are non-daemon: a server left running blocks exit).
  """

  def __init__(self, engine: Engine, config: GrpcServerConfig = GrpcServerConfig()):
    self.config = config
    self.engine = JetStreamEngine(engine)
    self._driver: _Driver | None = None
    self._server: grpc.aio.Server | None = None
    self.port: int | None = None

  async def start(self) -> int:
    params = self.engine.load_params()
    self._driver = _Driver(
      prefill_engines=[self.engine],
      generate_engines=[self.engine],
      prefill_params=[params],
      generate_params=[params],
      interleaved_mode=True,
    )
    token = http_guard.server_token(self.config.host)
    self._server = grpc.aio.server(interceptors=[BearerInterceptor(token)] if token else [])
    _core.jetstream_pb2_grpc.add_OrchestratorServicer_to_server(
      _Orchestrator(self._driver, self.engine), self._server
    )
    address = f"{self.config.host}:{self.config.port}"
    try:
      self.port = self._server.add_insecure_port(address)  # grpc raises or returns 0 on failure
    except RuntimeError:
      self.port = 0
    if not self.port:
      await self.stop()
      raise OSError(f"cannot bind gRPC to {address}")
    await self._server.start()
    log.info("JetStream gRPC on %s:%d", self.config.host, self.port)
    return self.port

  async def stop(self) -> None:
    if self._server is not None:
      await asyncio.wait_for(
        self._server.stop(self.config.stop_grace_s), self.config.stop_grace_s + 10
      )
      self._server = None
    if self._driver is not None:
      driver, self._driver = self._driver, None
      # Driver.stop() joins threads; the generate thread may sit up to 1 s in a queue timeout.
      await asyncio.wait_for(asyncio.to_thread(driver.stop), 30)
