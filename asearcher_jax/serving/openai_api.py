"""OpenAI-compatible HTTP facade over the RL Driver: /v1/completions, /v1/chat/completions.

So that OpenAI clients (evaluation judges, `openai` SDK scripts, other people's agent code, code
written for vLLM or SGLang) can talk to our engine, and so that a remote rollout worker gets
exactly what the in-process driver gives: every choice carries an `asearcher` extension with the
verbatim token ids (stop token or stop string included), their behaviour logprobs and policy
versions, the prompt ids and the token cap it ran under.

OpenAI semantics kept: `text`/`content` excludes a matched stop string and the stop token;
`finish_reason` is "stop", "length" or "abort"; `n` choices per prompt, ordered prompt-major;
a `seed` makes choice i use seed + i; `stream` answers server-sent events (openai_stream.py);
`logprobs` (completions: up to 5 alternatives) and `logprobs` + `top_logprobs` (chat: up to 20)
report alternatives computed by the decode step, under the same temperature-scaled distribution
as the chosen token's logprob; a request naming another model than the served one is a 404
`model_not_found` (no model: the served one, as vLLM). Not supported (HTTP 400 rather than
silently ignored): penalties, logit_bias, echo, suffix, best_of > n. Extensions accepted from
vLLM: `top_k`, `stop_token_ids`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from aiohttp import web

from asearcher_jax import http_guard
from asearcher_jax.errors import TokenizerError
from asearcher_jax.serving import openai_stream
from asearcher_jax.serving.driver import Driver, EngineError
from asearcher_jax.serving.openai_protocol import (
  CHAT_FIELDS,
  COMPLETION_FIELDS,
  Batch,
  Choice,
  Common,
  RequestError,
  TokenText,
  extension,
  finish_choice,
  parse_common,
  parse_messages,
  parse_prompts,
  usage,
)
from asearcher_jax.serving.request import prompt_problem
from asearcher_jax.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpenAIServerConfig:
  """Attributes:
  host: interface to bind; loopback by default so nothing is exposed by accident.
  port: TCP port; 0 picks a free one (`OpenAIServer.port` after start, or the address file).
  max_body_bytes: largest request body; aiohttp answers 413 beyond it.
  request_timeout_s: longest one request may take (queueing + decoding); 504 after it, and its
    generations are aborted.
  model_name: the served model id: /v1/models lists it, responses carry it, and a request naming
    another model gets 404 model_not_found (a request naming none is served).
  max_choices: most generations one request may ask for (prompts x n).
  max_inflight: requests served at once; more get 503 so a flood cannot grow memory unboundedly.
  default_max_tokens: /v1/completions `max_tokens` when omitted (OpenAI's default, 16); chat
    completions default to the rest of the context.
  max_tokens_beyond_context: a `max_tokens` larger than the rest of the context is "clip"ped to
    it (the cap used is each choice's `asearcher.max_new_tokens`; agents and the remote rollout
    client rely on this) or "refuse"d with vLLM's 400 message.
  stream_poll_s: how often a streaming response looks for new tokens.
  """

  host: str = "127.0.0.1"
  port: int = 0
  max_body_bytes: int = 8 << 20
  request_timeout_s: float = 600.0
  model_name: str = "asearcher-policy"
  max_choices: int = 256
  max_inflight: int = 1024
  default_max_tokens: int = 16
  max_tokens_beyond_context: Literal["clip", "refuse"] = "clip"
  stream_poll_s: float = 0.02
  # Slow clients: headers must arrive within header_timeout_s (else the connection is closed),
  # the body within body_timeout_s (else 408).
  header_timeout_s: float = 15.0
  body_timeout_s: float = 30.0

  def __post_init__(self):
    if self.max_tokens_beyond_context not in ("clip", "refuse"):
      raise ValueError(
        f"max_tokens_beyond_context must be 'clip' or 'refuse', got {self.max_tokens_beyond_context!r}"
      )


def error_response(status: int, message: str, kind: str, param: str | None = None,
                   code: str | int | None = None) -> web.Response:  # fmt: skip
  body = {"error": {"message": message, "type": kind, "param": param, "code": code or status}}
  return web.json_response(body, status=status)


@web.middleware
async def _json_errors(request: web.Request, handler: Callable) -> web.StreamResponse:
  """aiohttp's own error statuses (404 unknown path, 405 wrong method) in OpenAI's error shape."""
  try:
    return await handler(request)
  except web.HTTPException as e:
    if e.status < 400:
      raise
    return error_response(e.status, f"{e.reason}: {request.method} {request.path}",
                          "invalid_request_error")  # fmt: skip


class OpenAIServer:
  """Serves the facade over one Driver; `start()`/`stop()` for tests and the CLI alike."""

  def __init__(
    self,
    driver: Driver,
    config: OpenAIServerConfig = OpenAIServerConfig(),
    *,
    health_extra: Callable[[], dict[str, Any]] | None = None,
  ):
    """health_extra: more fields for /health (serve-model adds the weights it loaded)."""
    self.driver = driver
    self.health_extra = health_extra
    self.tokenizer: Tokenizer = driver.engine.tokenizer
    self.config = config
    self.pieces = TokenText(self.tokenizer)
    self._inflight = 0
    self._runner: web.AppRunner | None = None
    self.port: int | None = None
    self.created = int(time.time())
    self.requests = {"completions": 0, "chat": 0, "bad_request": 0, "busy": 0, "error": 0}

  def make_app(self) -> web.Application:
    app = web.Application(
      client_max_size=self.config.max_body_bytes,
      # bearer token when set; aiohttp's own errors in OpenAI's JSON shape
      middlewares=[*http_guard.middlewares(self.config.host), _json_errors],
    )
    app.router.add_post("/v1/completions", self._completions)
    app.router.add_post("/v1/chat/completions", self._chat)
    app.router.add_get("/v1/models", self._models)
    app.router.add_get("/health", self._health)
    return app

  async def start(self) -> int:
    """Binds and starts serving; returns the port. Handler cancellation is on, so a client that
    disconnects aborts its generations and frees their slots."""
    self._runner = web.AppRunner(
      self.make_app(), access_log=None, handler_cancellation=True,
      keepalive_timeout=self.config.header_timeout_s,
    )  # fmt: skip
    await self._runner.setup()
    await http_guard.listen(self._runner, self.config.host, self.config.port)
    self.port = int(next(a for a in self._runner.addresses if isinstance(a, tuple))[1])
    log.info("OpenAI API on http://%s:%d", self.config.host, self.port)
    return self.port

  async def stop(self) -> None:
    if self._runner is not None:
      await asyncio.wait_for(self._runner.cleanup(), 30)
      self._runner = None

  # --- handlers ---

  async def _guarded(self, kind: str, request: web.Request, handle: Callable) -> web.StreamResponse:
    if self._inflight >= self.config.max_inflight:
      self.requests["busy"] += 1
      return error_response(503, "server busy, retry later", "server_busy")
    self._inflight += 1
    try:
      try:
        body = json.loads(await http_guard.read_body(request, self.config.body_timeout_s))
      except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:  # too deep: 400
        raise RequestError(f"malformed JSON: {e}") from None
      except http_guard.SlowBody as e:
        raise RequestError(str(e), status=408) from None
      # A stream has begun answering by the time it could time out: its generations carry the
      # timeout instead, and it ends with an error event.
      streaming = isinstance(body, dict) and body.get("stream") is True
      timeout = None if streaming else self.config.request_timeout_s
      response = await asyncio.wait_for(handle(body), timeout)
      self.requests[kind] += 1
      return response
    except RequestError as e:
      self.requests["bad_request"] += 1
      return error_response(e.status, str(e), e.kind, e.param, e.code)
    except web.HTTPRequestEntityTooLarge as e:
      self.requests["bad_request"] += 1
      return error_response(413, e.text or "request body too large", "invalid_request_error")
    except TimeoutError:
      self.requests["error"] += 1
      return error_response(504, "generation timed out", "timeout")
    except EngineError as e:
      self.requests["error"] += 1
      status = 503 if "closed" in str(e) else 500
      return error_response(status, str(e), "engine_error")
    except Exception as e:
      self.requests["error"] += 1
      log.exception("error serving %s", request.path)
      return error_response(500, f"internal error: {type(e).__name__}: {e}", "internal_error")
    finally:
      self._inflight -= 1

  def _check_model(self, c: Common) -> None:
    if c.model is not None and c.model != self.config.model_name:
      raise RequestError(f"The model `{c.model}` does not exist.", status=404, param="model",
                         code="model_not_found")  # fmt: skip

  def start_batch(self, prompts: list[list[int]], c: Common, default_max: int | None) -> Batch:
    """Validates the prompts and the token cap, and starts every generation."""
    if len(prompts) * c.n > self.config.max_choices:
      raise RequestError(f"too many generations: {len(prompts)} prompts x n={c.n} > "
                         f"{self.config.max_choices}")  # fmt: skip
    limit = self.driver.engine.cfg.max_seq_len
    vocab = self.driver.engine.model_cfg.vocab_size
    caps = []
    for p in prompts:
      problem = prompt_problem(p, vocab_size=vocab, max_seq_len=limit)
      if problem is not None:
        raise RequestError(problem, param="prompt")
      asked = c.max_tokens or default_max or limit
      if (
        c.max_tokens
        and asked > limit - len(p)
        and self.config.max_tokens_beyond_context == "refuse"
      ):
        raise RequestError(  # vLLM's words
          f"This model's maximum context length is {limit} tokens. However, you requested "
          f"{len(p) + asked} tokens ({len(p)} in the messages, {asked} in the completion). "
          "Please reduce the length of the messages or completion.",
          param="max_tokens",
        )
      caps.append(min(asked, limit - len(p)))
    stop_ids = tuple(
      self.tokenizer.stop_token_ids if c.stop_token_ids is None else c.stop_token_ids
    )
    tag = uuid.uuid4().hex[:12]
    batch = Batch(common=c, prompts=[], caps=[], stop_ids=stop_ids, request_ids=[], tasks=[])
    for i, (p, cap) in enumerate(zip(prompts, caps, strict=True)):
      for j in range(c.n):
        seed = None if c.sampling.seed is None else c.sampling.seed + j
        rid = f"{tag}-{i}-{j}"
        batch.prompts.append(p)
        batch.caps.append(cap)
        batch.request_ids.append(rid)
        batch.tasks.append(asyncio.ensure_future(self.driver.generate(
          p, dataclasses.replace(c.sampling, seed=seed), cap, c.stop, stop_ids, request_id=rid,
          timeout=self.config.request_timeout_s,
        )))  # fmt: skip
    return batch

  def choice(self, batch: Batch, i: int) -> Choice:
    """Choice i of a batch whose task i is done."""
    return finish_choice(self.tokenizer, batch.prompts[i], batch.tasks[i].result(),
                         batch.common.stop, batch.stop_ids, batch.caps[i])  # fmt: skip

  async def _finish(self, batch: Batch) -> list[Choice]:
    try:
      await asyncio.gather(*batch.tasks)
    except ValueError as e:  # the driver's verdict on a prompt (e.g. it does not fit)
      raise RequestError(str(e)) from None
    finally:  # one failed generation aborts its siblings
      batch.cancel()
    return [self.choice(batch, i) for i in range(len(batch.tasks))]

  async def _completions(self, request: web.Request) -> web.StreamResponse:
    async def handle(body: Any) -> web.StreamResponse:
      c = parse_common(body, COMPLETION_FIELDS, chat=False)
      self._check_model(c)
      if body.get("echo") or body.get("suffix"):
        raise RequestError("'echo' and 'suffix' are not supported")
      if "prompt" not in body:
        raise RequestError("'prompt' is required", param="prompt")
      prompts = parse_prompts(body["prompt"], self.tokenizer)
      batch = self.start_batch(prompts, c, self.config.default_max_tokens)
      if c.stream:
        return await openai_stream.respond(self, request, batch, chat=False)
      choices = await self._finish(batch)
      out = [self.completion_choice(i, ch, c) for i, ch in enumerate(choices)]
      return web.json_response({
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
        "model": self.config.model_name, "choices": out, "usage": usage(prompts, choices),
      })  # fmt: skip

    return await self._guarded("completions", request, handle)

  def completion_choice(self, i: int, ch: Choice, c: Common) -> dict[str, Any]:
    item = {"index": i, "text": ch.text, "finish_reason": ch.finish_reason, "logprobs": None}
    if c.logprobs:
      item["logprobs"] = self.completion_logprobs(ch, c.sampling.top_logprobs)
    item["asearcher"] = extension(ch)
    return item

  def _alternatives(self, ch: Choice, k: int) -> list[list[tuple[int, float]]]:
    """Per kept token, its k alternatives, most likely first; the chosen token's entry carries the
    extension's logprob (the same number up to float rounding, so the order holds)."""
    r = ch.result
    out = []
    for t, lp, top in zip(r.tokens[: ch.kept], r.logprobs, r.top_logprobs or [], strict=False):
      alts = [(i, lp if i == t else v) for i, v in top[:k]]
      out.append(sorted(alts, key=lambda a: -a[1]))
    return out

  def completion_logprobs(self, ch: Choice, k: int) -> dict[str, Any]:
    ids = ch.result.tokens[: ch.kept]
    texts = [self.pieces.text(t) for t in ids]
    offsets, pos = [], 0
    for t in texts:
      offsets.append(pos)
      pos += len(t)
    top = None
    if k:
      top = [{self.pieces.text(i): v for i, v in alts} for alts in self._alternatives(ch, k)]
    return {"tokens": texts, "token_logprobs": ch.result.logprobs[: ch.kept],
            "top_logprobs": top, "text_offset": offsets}  # fmt: skip

  def chat_logprobs(self, ch: Choice, k: int) -> dict[str, Any]:
    alternatives = self._alternatives(ch, k) if k else []

    def entry(t: int, lp: float) -> dict[str, Any]:
      return {"token": self.pieces.text(t), "logprob": lp, "bytes": self.pieces.bytes(t)}

    content = []
    for n, (t, lp) in enumerate(zip(ch.result.tokens[: ch.kept], ch.result.logprobs, strict=False)):
      alts = alternatives[n] if n < len(alternatives) else []
      content.append({**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in alts]})
    return {"content": content}

  async def _chat(self, request: web.Request) -> web.StreamResponse:
    async def handle(body: Any) -> web.StreamResponse:
      c = parse_common(body, CHAT_FIELDS, chat=True)
      self._check_model(c)
      messages = parse_messages(body.get("messages"))
      try:
        prompt = self.tokenizer.encode_chat(messages)
      except (ValueError, KeyError, TokenizerError) as e:  # the model's template may refuse
        raise RequestError(str(e), param="messages") from None
      batch = self.start_batch([prompt], c, None)
      if c.stream:
        return await openai_stream.respond(self, request, batch, chat=True)
      choices = await self._finish(batch)
      out = []
      for i, ch in enumerate(choices):
        item = {
          "index": i, "message": {"role": "assistant", "content": ch.text},
          "finish_reason": ch.finish_reason, "logprobs": None,
        }  # fmt: skip
        if c.logprobs:
          item["logprobs"] = self.chat_logprobs(ch, c.sampling.top_logprobs)
        item["asearcher"] = extension(ch)
        out.append(item)
      return web.json_response({
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
        "created": int(time.time()), "model": self.config.model_name, "choices": out,
        "usage": usage([prompt], choices),
      })  # fmt: skip

    return await self._guarded("chat", request, handle)

  async def _models(self, request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{
      "id": self.config.model_name, "object": "model", "created": self.created,
      "owned_by": "asearcher_jax", "max_model_len": self.driver.engine.cfg.max_seq_len,
    }]})  # fmt: skip

  async def _health(self, request: web.Request) -> web.Response:
    extra = self.health_extra() if self.health_extra is not None else {}
    return web.json_response({
      "status": "ok", "model": self.config.model_name, "version": self.driver.version,
      "inflight": self._inflight, "requests": self.requests, "driver": self.driver.stats(),
      **extra,
    })  # fmt: skip
