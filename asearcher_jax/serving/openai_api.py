"""OpenAI-compatible HTTP facade over the RL Driver: /v1/completions, /v1/chat/completions.

So that OpenAI clients (evaluation judges, `openai` SDK scripts, other people's agent code) can
talk to our engine, and so that a remote rollout worker gets exactly what the in-process driver
gives: every choice carries an `asearcher` extension with the verbatim token ids (stop token or
stop string included), their behaviour logprobs and policy versions, and the prompt ids.

OpenAI semantics kept: `text`/`content` excludes a matched stop string and the stop token;
`finish_reason` is "stop", "length" or "abort"; `n` choices per prompt, ordered prompt-major;
a `seed` makes choice i use seed + i. Not supported (HTTP 400 rather than silently ignored):
streaming, top-k alternative logprobs (only the sampled token's logprob is computed), penalties,
logit_bias, echo, suffix, best_of > n. Extensions accepted from vLLM: `top_k`, `stop_token_ids`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from asearcher_jax import http_guard
from asearcher_jax.serving.driver import Driver, EngineError
from asearcher_jax.serving.types import GenerationResult, SamplingParams
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
  model_name: the id reported by /v1/models and in responses (requests may name any model).
  max_choices: most generations one request may ask for (prompts x n).
  max_inflight: requests served at once; more get 503 so a flood cannot grow memory unboundedly.
  default_max_tokens: /v1/completions `max_tokens` when omitted (OpenAI's default, 16); chat
    completions default to the rest of the context.
  """

  host: str = "127.0.0.1"
  port: int = 0
  max_body_bytes: int = 8 << 20
  request_timeout_s: float = 600.0
  model_name: str = "asearcher-policy"
  max_choices: int = 256
  max_inflight: int = 1024
  default_max_tokens: int = 16
  # Slow clients: headers must arrive within header_timeout_s (else the connection is closed),
  # the body within body_timeout_s (else 408).
  header_timeout_s: float = 15.0
  body_timeout_s: float = 30.0


class RequestError(ValueError):
  """A request we will not serve: HTTP `status` with an OpenAI-style error body."""

  def __init__(self, message: str, *, status: int = 400, kind: str = "invalid_request_error",
               param: str | None = None):  # fmt: skip
    super().__init__(message)
    self.status, self.kind, self.param = status, kind, param


def error_response(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
  body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
  return web.json_response(body, status=status)


# --- request parsing -----------------------------------------------------------------------------

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
           "stop_token_ids", "stream", "user", "presence_penalty", "frequency_penalty",
           "logit_bias", "best_of"}  # fmt: skip
_COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "suffix"}
_CHAT_FIELDS = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}


def _is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _num(body: dict, key: str, default: float, lo: float, hi: float) -> float:
  x = body.get(key)
  if x is None:
    return default
  if isinstance(x, bool) or not isinstance(x, int | float) or not lo <= x <= hi:
    raise RequestError(f"'{key}' must be a number in [{lo}, {hi}], got {x!r}", param=key)
  return float(x)


def _int(body: dict, key: str, default: int | None, lo: int) -> int | None:
  x = body.get(key)
  if x is None:
    return default
  if not _is_int(x) or x < lo:
    raise RequestError(f"'{key}' must be an integer >= {lo}, got {x!r}", param=key)
  return x


def _bad_top_p() -> float:
  raise RequestError("'top_p' must be in (0, 1]", param="top_p")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Common:
  sampling: SamplingParams
  n: int
  max_tokens: int | None
  stop: tuple[str, ...]
  stop_token_ids: tuple[int, ...] | None


def _parse_common(body: Any, allowed: set[str]) -> _Common:
  if not isinstance(body, dict):
    raise RequestError("the request body must be a JSON object")
  unknown = sorted(set(body) - allowed)
  if unknown:
    raise RequestError(f"unsupported fields: {', '.join(unknown)}", param=unknown[0])
  if body.get("stream"):
    raise RequestError("streaming is not supported; send stream=false", param="stream")
  if body.get("model") is not None and not isinstance(body["model"], str):
    raise RequestError("'model' must be a string", param="model")
  for key in ("presence_penalty", "frequency_penalty"):
    if _num(body, key, 0.0, -2.0, 2.0) != 0.0:
      raise RequestError(f"'{key}' is not supported (must be 0)", param=key)
  if body.get("logit_bias"):
    raise RequestError("'logit_bias' is not supported", param="logit_bias")
  n = _int(body, "n", 1, 1)
  if (_int(body, "best_of", n, 1) or n) != n:
    raise RequestError("'best_of' other than n is not supported", param="best_of")
  stop = body.get("stop")
  if stop is None:
    stop = []
  elif isinstance(stop, str):
    stop = [stop]
  if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
    raise RequestError("'stop' must be a string or a list of at most 16 strings", param="stop")
  stop_ids = body.get("stop_token_ids")
  if stop_ids is not None and (
    not isinstance(stop_ids, list) or not all(_is_int(t) and t >= 0 for t in stop_ids)
  ):
    raise RequestError("'stop_token_ids' must be a list of token ids", param="stop_token_ids")
  try:
    sampling = SamplingParams(
      temperature=_num(body, "temperature", 1.0, 0.0, 100.0),
      top_p=_num(body, "top_p", 1.0, 0.0, 1.0) or _bad_top_p(),
      top_k=_int(body, "top_k", 0, 0),
      seed=_int(body, "seed", None, 0),
    )
  except RequestError:
    raise
  except ValueError as e:  # SamplingParams' own checks
    raise RequestError(str(e)) from None
  return _Common(
    sampling=sampling,
    n=n,
    max_tokens=_int(body, "max_completion_tokens", None, 1) or _int(body, "max_tokens", None, 1),
    stop=tuple(stop),
    stop_token_ids=None if stop_ids is None else tuple(stop_ids),
  )


def parse_prompts(prompt: Any, tokenizer: Tokenizer) -> list[list[int]]:
  """`prompt` as text, token ids, or a list of either -> one id list per prompt."""
  if isinstance(prompt, str):
    return [tokenizer.encode(prompt)]
  if isinstance(prompt, list) and prompt:
    if all(_is_int(t) for t in prompt):
      return [list(prompt)]
    if all(
      isinstance(p, str) or (isinstance(p, list) and p and all(map(_is_int, p))) for p in prompt
    ):
      return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
  raise RequestError(
    "'prompt' must be a string, a list of token ids, or a non-empty list of strings and/or "
    "token id lists",
    param="prompt",
  )


def parse_messages(messages: Any) -> list[dict[str, str]]:
  """Chat messages with string content or a list of text parts (other part types: 400)."""
  if not isinstance(messages, list) or not messages:
    raise RequestError("'messages' must be a non-empty list", param="messages")
  out = []
  for m in messages:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
      raise RequestError("each message must be an object with a 'role'", param="messages")
    content = m.get("content")
    if content is None:
      content = ""
    if isinstance(content, list):
      if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        raise RequestError("only text content parts are supported", param="messages")
      content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
      raise RequestError("message 'content' must be a string or text parts", param="messages")
    out.append({"role": m["role"], "content": content})
  return out


# --- response building ----------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte <-> printable-character table that byte-level BPE vocabularies are written in."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
  bs += list(range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs), strict=True))


_BYTE_OF = {c: b for b, c in _bytes_to_unicode().items()}


class _TokenText:
  """Per-token text and exact bytes (a token may hold part of a UTF-8 character)."""

  def __init__(self, tokenizer: Tokenizer):
    self.tokenizer = tokenizer

  def bytes(self, token_id: int) -> list[int]:
    piece = self.tokenizer.id_to_token(token_id) or ""
    if all(c in _BYTE_OF for c in piece):
      return [_BYTE_OF[c] for c in piece]
    return list(piece.encode("utf-8"))  # special tokens and non-byte-level vocabularies

  def text(self, token_id: int) -> str:
    return self.tokenizer.decode([token_id])


@dataclasses.dataclass(frozen=True)
class _Choice:
  text: str
  finish_reason: str
  kept: int  # tokens whose text `text` is made of (the stop token excluded)
  result: GenerationResult
  prompt: list[int]


def finish_choice(tokenizer: Tokenizer, prompt: list[int], res: GenerationResult,
                  stop: Sequence[str], stop_ids: Sequence[int]) -> _Choice:  # fmt: skip
  """OpenAI text for one generation: without the stop token and cut before a matched stop string."""
  tokens = res.tokens
  kept = len(tokens)
  if res.stop_reason == "stop" and tokens and tokens[-1] in stop_ids:
    kept -= 1
  text = tokenizer.decode(tokens[:kept])
  if res.stop_reason == "stop" and stop:
    cuts = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    if cuts:
      text = text[: min(cuts)]
  return _Choice(text=text, finish_reason=res.stop_reason, kept=kept, result=res, prompt=prompt)


def _extension(c: _Choice) -> dict[str, Any]:
  r = c.result
  return {"token_ids": r.tokens, "logprobs": r.logprobs, "versions": r.versions,
          "prompt_token_ids": c.prompt, "stop_reason": r.stop_reason}  # fmt: skip


def _usage(prompts: list[list[int]], choices: list[_Choice]) -> dict[str, int]:
  p = sum(len(x) for x in prompts)
  g = sum(len(c.result.tokens) for c in choices)
  return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}


# --- the server -----------------------------------------------------------------------------------


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
    self._pieces = _TokenText(self.tokenizer)
    self._inflight = 0
    self._runner: web.AppRunner | None = None
    self.port: int | None = None
    self.created = int(time.time())
    self.requests = {"completions": 0, "chat": 0, "bad_request": 0, "busy": 0, "error": 0}

  def make_app(self) -> web.Application:
    app = web.Application(
      client_max_size=self.config.max_body_bytes,
      middlewares=http_guard.middlewares(self.config.host),  # bearer token when set
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
    site = web.TCPSite(self._runner, self.config.host, self.config.port)
    await site.start()
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
      response = await asyncio.wait_for(handle(body), self.config.request_timeout_s)
      self.requests[kind] += 1
      return response
    except RequestError as e:
      self.requests["bad_request"] += 1
      return error_response(e.status, str(e), e.kind, e.param)
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

  async def _generate_all(self, prompts: list[list[int]], c: _Common) -> list[_Choice]:
    if len(prompts) * c.n > self.config.max_choices:
      raise RequestError(f"too many generations: {len(prompts)} prompts x n={c.n} > "
                         f"{self.config.max_choices}")  # fmt: skip
    limit = self.driver.engine.cfg.max_seq_len
    vocab = self.driver.engine.model_cfg.vocab_size
    for p in prompts:
      if not p:
        raise RequestError("empty prompt", param="prompt")
      if min(p) < 0 or max(p) >= vocab:
        raise RequestError(f"token ids must be in [0, {vocab})", param="prompt")
      if len(p) >= limit:
        raise RequestError(
          f"prompt of {len(p)} tokens does not fit the context (max_seq_len={limit})",
          param="prompt",
        )
    stop_ids = self.tokenizer.stop_token_ids if c.stop_token_ids is None else c.stop_token_ids
    max_tokens = c.max_tokens or limit  # the driver caps it at the rest of the context
    tag = uuid.uuid4().hex[:12]
    jobs = []
    for i, p in enumerate(prompts):
      for j in range(c.n):
        seed = None if c.sampling.seed is None else c.sampling.seed + j
        sampling = dataclasses.replace(c.sampling, seed=seed)
        jobs.append(self.driver.generate(
          p, sampling, max_tokens, c.stop, stop_ids, request_id=f"{tag}-{i}-{j}",
          timeout=self.config.request_timeout_s,
        ))  # fmt: skip
    tasks = [asyncio.ensure_future(j) for j in jobs]
    try:
      results = await asyncio.gather(*tasks)
    except ValueError as e:  # the driver's verdict on a prompt (e.g. it does not fit)
      raise RequestError(str(e)) from None
    finally:  # one failed generation aborts its siblings (cancelling frees their slots)
      for t in tasks:
        t.cancel()
    prompt_of = [p for p in prompts for _ in range(c.n)]
    return [finish_choice(self.tokenizer, p, r, c.stop, stop_ids)
            for p, r in zip(prompt_of, results, strict=True)]  # fmt: skip

  async def _completions(self, request: web.Request) -> web.StreamResponse:
    async def handle(body: Any) -> web.Response:
      c = _parse_common(body, _COMPLETION_FIELDS)
      if c.max_tokens is None:
        c = dataclasses.replace(c, max_tokens=self.config.default_max_tokens)
      logprobs = _int(body, "logprobs", None, 0)
      if logprobs:
        raise RequestError(
          "top-k alternative logprobs are not computed by this engine; use logprobs=0 (the "
          "sampled token's logprob)",
          param="logprobs",
        )
      if body.get("echo") or body.get("suffix"):
        raise RequestError("'echo' and 'suffix' are not supported")
      if "prompt" not in body:
        raise RequestError("'prompt' is required", param="prompt")
      prompts = parse_prompts(body["prompt"], self.tokenizer)
      choices = await self._generate_all(prompts, c)
      out = []
      for i, ch in enumerate(choices):
        item = {"index": i, "text": ch.text, "finish_reason": ch.finish_reason, "logprobs": None}
        if logprobs is not None:
          item["logprobs"] = self._completion_logprobs(ch)
        item["asearcher"] = _extension(ch)
        out.append(item)
      return web.json_response({
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
        "model": self.config.model_name, "choices": out, "usage": _usage(prompts, choices),
      })  # fmt: skip

    return await self._guarded("completions", request, handle)

  def _completion_logprobs(self, ch: _Choice) -> dict[str, Any]:
    ids = ch.result.tokens[: ch.kept]
    texts = [self._pieces.text(t) for t in ids]
    offsets, pos = [], 0
    for t in texts:
      offsets.append(pos)
      pos += len(t)
    return {"tokens": texts, "token_logprobs": ch.result.logprobs[: ch.kept],
            "top_logprobs": None, "text_offset": offsets}  # fmt: skip

  async def _chat(self, request: web.Request) -> web.StreamResponse:
    async def handle(body: Any) -> web.Response:
      c = _parse_common(body, _CHAT_FIELDS)
      want_logprobs = body.get("logprobs") or False
      if not isinstance(want_logprobs, bool):
        raise RequestError("'logprobs' must be a boolean", param="logprobs")
      if _int(body, "top_logprobs", 0, 0):
        raise RequestError("top-k alternative logprobs are not computed by this engine; use "
                           "top_logprobs=0", param="top_logprobs")  # fmt: skip
      messages = parse_messages(body.get("messages"))
      try:
        prompt = self.tokenizer.encode_chat(messages)
      except (ValueError, KeyError) as e:
        raise RequestError(str(e), param="messages") from None
      choices = await self._generate_all([prompt], c)
      out = []
      for i, ch in enumerate(choices):
        item = {
          "index": i, "message": {"role": "assistant", "content": ch.text},
          "finish_reason": ch.finish_reason, "logprobs": None,
        }  # fmt: skip
        if want_logprobs:
          item["logprobs"] = {"content": [
            {"token": self._pieces.text(t), "logprob": lp, "bytes": self._pieces.bytes(t),
             "top_logprobs": []}
            for t, lp in zip(ch.result.tokens[: ch.kept], ch.result.logprobs, strict=False)
          ]}  # fmt: skip
        item["asearcher"] = _extension(ch)
        out.append(item)
      return web.json_response({
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
        "created": int(time.time()), "model": self.config.model_name, "choices": out,
        "usage": _usage([prompt], choices),
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
