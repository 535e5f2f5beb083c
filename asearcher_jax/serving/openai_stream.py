"""Server-sent-event streaming for the OpenAI facade (`"stream": true`), as OpenAI and vLLM do it.

The driver hands back whole results, so a streaming response polls each generation's progress
(`Driver.progress`, every `stream_poll_s`) and sends the text decoded so far as deltas: `data:
{chunk}` events, then `data: [DONE]`. Text is held back while it may still change: a trailing
partial UTF-8 character, and the last characters that could begin a stop string (the final text
is cut before a matched stop). The last chunk of each choice carries its `finish_reason`, the
rest of its text, its logprobs when asked (all tokens at once, so concatenated chunks carry the
whole list) and the `asearcher` extension; with `stream_options.include_usage` a last chunk with
no choices carries the usage. Concatenated deltas equal the non-streaming text for the same seed.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Protocol

from aiohttp import web

from asearcher_jax.serving.driver import Driver
from asearcher_jax.serving.openai_protocol import Batch, Choice, RequestError, extension, usage
from asearcher_jax.serving.types import EngineError
from asearcher_jax.tokenizer import Tokenizer


class OpenAIServer(Protocol):
  """What streaming needs of `openai_api.OpenAIServer` (which imports this module)."""

  driver: Driver
  tokenizer: Tokenizer
  config: Any

  def choice(self, batch: Batch, i: int) -> Choice: ...
  def chat_logprobs(self, ch: Choice, k: int) -> dict[str, Any]: ...
  def completion_logprobs(self, ch: Choice, k: int) -> dict[str, Any]: ...


def _partial_text(server: OpenAIServer, batch: Batch, i: int) -> str:
  """The text of choice i so far that cannot change any more."""
  progress = server.driver.progress(batch.request_ids[i])
  if progress is None:
    return ""
  tokens = progress[0]
  while tokens and tokens[-1] in batch.stop_ids:
    tokens = tokens[:-1]
  text = server.tokenizer.decode(tokens).rstrip("\ufffd")  # a partial UTF-8 character
  stop = batch.common.stop
  if stop:
    cuts = [k for k in (text.find(s) for s in stop) if k >= 0]
    text = text[: min(cuts)] if cuts else text[: max(0, len(text) - max(map(len, stop)) + 1)]
  return text


async def respond(server: OpenAIServer, request: web.Request, batch: Batch, *, chat: bool
                  ) -> web.StreamResponse:  # fmt: skip
  """Streams the batch's choices; a failure after the first byte becomes an `error` event."""
  resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                     "Cache-Control": "no-cache"})  # fmt: skip
  await resp.prepare(request)
  head = {
    "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
    "object": "chat.completion.chunk" if chat else "text_completion",
    "created": int(time.time()), "model": server.config.model_name,
  }  # fmt: skip

  async def send(payload: Any) -> None:
    await resp.write(f"data: {json.dumps(payload)}\n\n".encode())

  async def chunk(i: int, text: str, **extra: Any) -> None:
    part = {"content": text} if chat else {"text": text}
    if chat:
      part = {"delta": part}
    choice = {"index": i, **part, "logprobs": None, "finish_reason": None, **extra}
    await send({**head, "choices": [choice]})

  n = len(batch.tasks)
  sent = [""] * n
  done = [False] * n
  try:
    if chat:
      for i in range(n):
        await send({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]})  # fmt: skip
    while not all(done):
      for i, task in enumerate(batch.tasks):
        if done[i]:
          continue
        if task.done():
          try:
            ch = server.choice(batch, i)
          except ValueError as e:
            raise RequestError(str(e)) from None
          done[i] = True
          delta = ch.text[len(sent[i]) :] if ch.text.startswith(sent[i]) else ""
          k = batch.common.sampling.top_logprobs
          lp = None
          if batch.common.logprobs:
            lp = server.chat_logprobs(ch, k) if chat else server.completion_logprobs(ch, k)
          await chunk(i, delta, logprobs=lp, finish_reason=ch.finish_reason,
                      asearcher=extension(ch))  # fmt: skip
          continue
        text = _partial_text(server, batch, i)
        if len(text) > len(sent[i]) and text.startswith(sent[i]):
          await chunk(i, text[len(sent[i]) :])
          sent[i] = text
      pending = [t for t, d in zip(batch.tasks, done, strict=True) if not d]
      if pending:
        await asyncio.wait(pending, timeout=server.config.stream_poll_s)
    if batch.common.include_usage:
      choices = [server.choice(batch, i) for i in range(n)]
      prompts = batch.prompts[:: batch.common.n]
      await send({**head, "choices": [], "usage": usage(prompts, choices)})
  except (RequestError, EngineError, TimeoutError) as e:
    status = getattr(e, "status", 500)
    await send({"error": {"message": str(e) or type(e).__name__, "type": type(e).__name__,
                          "param": None, "code": status}})  # fmt: skip
  finally:
    batch.cancel()
  await resp.write(b"data: [DONE]\n\n")
  await resp.write_eof()
  return resp
