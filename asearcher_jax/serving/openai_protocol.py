"""The OpenAI wire format our facade speaks: request parsing and validation, and the pieces of
a response (choice text cut at stops, per-token text and bytes, usage, the `asearcher` extension).

Kept apart from the server (openai_api.py) and its streaming (openai_stream.py) so that each
piece is read on its own; nothing here touches the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

from asearcher_jax.serving.types import MAX_TOP_LOGPROBS, GenerationResult, SamplingParams
from asearcher_jax.tokenizer import Tokenizer


class RequestError(ValueError):
  """A request we will not serve: HTTP `status` with an OpenAI-style error body."""

  def __init__(self, message: str, *, status: int = 400, kind: str = "invalid_request_error",
               param: str | None = None, code: str | None = None):  # fmt: skip
    super().__init__(message)
    self.status, self.kind, self.param, self.code = status, kind, param, code


# --- request parsing -----------------------------------------------------------------------------

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop",
           "stop_token_ids", "stream", "stream_options", "user", "presence_penalty", "frequency_penalty",
           "logit_bias", "best_of"}  # fmt: skip
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "suffix"}
CHAT_FIELDS = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}


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
class Common:
  """What completions and chat requests share, validated."""

  sampling: SamplingParams
  n: int
  max_tokens: int | None  # None: the endpoint's default
  stop: tuple[str, ...]
  stop_token_ids: tuple[int, ...] | None
  model: str | None
  stream: bool
  include_usage: bool  # stream_options.include_usage: a last chunk with the usage
  logprobs: bool  # report each token's logprob


@dataclasses.dataclass
class Batch:
  """The generations of one request, started: one task per choice, prompt-major."""

  common: Common
  prompts: list[list[int]]  # per choice
  caps: list[int]  # per choice: max new tokens
  stop_ids: tuple[int, ...]
  request_ids: list[str]
  tasks: list[asyncio.Future]

  def cancel(self) -> None:
    for t in self.tasks:  # cancelling aborts the generation and frees its slot
      t.cancel()


def parse_logprobs(body: dict, chat: bool) -> tuple[bool, int]:
  """(report logprobs, top alternatives per token). Completions: `logprobs` is the number of
  alternatives (0..5, OpenAI's limit; 0 reports the chosen token's only). Chat: `logprobs` is a
  boolean and `top_logprobs` (0..20) needs it."""
  if not chat:
    k = _int(body, "logprobs", None, 0)
    if k is not None and k > 5:
      raise RequestError("'logprobs' must be an integer in [0, 5]", param="logprobs")
    return k is not None, k or 0
  want = body.get("logprobs") or False
  if not isinstance(want, bool):
    raise RequestError("'logprobs' must be a boolean", param="logprobs")
  k = _int(body, "top_logprobs", None, 0)
  if k is not None and k > MAX_TOP_LOGPROBS:
    raise RequestError(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}]",
                       param="top_logprobs")  # fmt: skip
  if k and not want:
    raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
  return want, k or 0


def parse_common(body: Any, allowed: set[str], *, chat: bool) -> Common:
  if not isinstance(body, dict):
    raise RequestError("the request body must be a JSON object")
  unknown = sorted(set(body) - allowed)
  if unknown:
    raise RequestError(f"unsupported fields: {', '.join(unknown)}", param=unknown[0])
  stream = body.get("stream") or False
  if not isinstance(stream, bool):
    raise RequestError("'stream' must be a boolean", param="stream")
  options = body.get("stream_options")
  if options is not None and (not stream or not isinstance(options, dict)
                              or set(options) - {"include_usage", "continuous_usage_stats"}):  # fmt: skip
    raise RequestError("'stream_options' is an object ({\"include_usage\": bool}) and needs "
                       "stream=true", param="stream_options")  # fmt: skip
  if body.get("model") is not None and not isinstance(body["model"], str):
    raise RequestError("'model' must be a string", param="model")
  want_logprobs, top = parse_logprobs(body, chat)
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
      top_logprobs=top,
    )
  except RequestError:
    raise
  except ValueError as e:  # SamplingParams' own checks
    raise RequestError(str(e)) from None
  return Common(
    sampling=sampling,
    n=n,
    max_tokens=_int(body, "max_completion_tokens", None, 1) or _int(body, "max_tokens", None, 1),
    stop=tuple(stop),
    stop_token_ids=None if stop_ids is None else tuple(stop_ids),
    model=body.get("model"),
    stream=stream,
    include_usage=bool((options or {}).get("include_usage")),
    logprobs=want_logprobs,
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


class TokenText:
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
class Choice:
  text: str
  finish_reason: str
  kept: int  # tokens whose text `text` is made of (the stop token excluded)
  result: GenerationResult
  prompt: list[int]
  max_new_tokens: int  # the cap it was generated under (max_tokens, clipped to the context)


def finish_choice(tokenizer: Tokenizer, prompt: list[int], res: GenerationResult,
                  stop: Sequence[str], stop_ids: Sequence[int], cap: int) -> Choice:  # fmt: skip
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
  return Choice(text=text, finish_reason=res.stop_reason, kept=kept, result=res, prompt=prompt,
                max_new_tokens=cap)  # fmt: skip


def extension(c: Choice) -> dict[str, Any]:
  """The `asearcher` field of a choice: the verbatim tokens and what RL needs of them."""
  r = c.result
  return {"token_ids": r.tokens, "logprobs": r.logprobs, "versions": r.versions,
          "prompt_token_ids": c.prompt, "stop_reason": r.stop_reason,
          "max_new_tokens": c.max_new_tokens}  # fmt: skip


def usage(prompts: list[list[int]], choices: list[Choice]) -> dict[str, int]:
  p = sum(len(x) for x in prompts)
  g = sum(len(c.result.tokens) for c in choices)
  return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}
