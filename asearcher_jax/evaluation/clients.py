"""A `GenerationClient` over any OpenAI-compatible `/v1/completions` endpoint (vLLM, SGLang, ...).

Our own `serve-model` returns exact token ids, logprobs and versions (use `RemoteGenerationClient`
for it); other servers return text only. For evaluation that is enough: the prompt is decoded to
text, the completion is re-tokenized (as ASearcher's eval harness does), logprobs are 0 and
versions -1. OpenAI servers drop the matched stop string from the text, so the closing tag the
agent stopped on is put back: the closing tag of the last unclosed action tag (a registered tool's
or `<answer>`) among the stop strings, or `</think>` for a read turn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import aiohttp

from asearcher_jax.serving.driver import EngineError
from asearcher_jax.serving.types import GenerationResult, SamplingParams
from asearcher_jax.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class OpenAICompletionsConfig:
  """Where the endpoint is and how long to wait for it."""

  # API root including /v1, e.g. "http://127.0.0.1:8000/v1".
  base_url: str
  # Model name the server serves.
  model: str
  # Environment variable holding the API key; unset or empty: no Authorization header.
  api_key_env: str = "OPENAI_API_KEY"
  # Seconds one completion may take.
  timeout_s: float = 600.0


def restore_stop(text: str, stop: Sequence[str]) -> str:
  """The stop string an OpenAI server matched and removed, put back (empty if none applies)."""
  if not stop:
    return ""
  best, best_pos = "", -1
  for close in stop:  # an act turn stops on each action tag's closing tag
    if not (close.startswith("</") and close.endswith(">")) or close == "</think>":
      continue
    pos = text.rfind(f"<{close[2:]}")
    if pos > best_pos and close not in text[pos:]:
      best, best_pos = close, pos
  if best:
    return best
  return "</think>" if list(stop) == ["</think>"] else ""


class OpenAICompletionsClient:
  """Text in, text out, adapted to the token contract of `GenerationClient`."""

  def __init__(self, config: OpenAICompletionsConfig, tokenizer: Tokenizer) -> None:
    self.config = config
    self.tokenizer = tokenizer
    self._session: aiohttp.ClientSession | None = None

  @property
  def base_url(self) -> str:
    """For the runner's reachability check (`{base_url}/health` answers or 404s)."""
    return self.config.base_url.rstrip("/")

  async def close(self) -> None:
    if self._session is not None:
      await self._session.close()
      self._session = None

  async def generate(
    self,
    token_ids: Sequence[int],
    sampling: SamplingParams,
    max_new_tokens: int,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] | None = None,
  ) -> GenerationResult:
    body: dict[str, Any] = {
      "model": self.config.model,
      "prompt": self.tokenizer.decode(token_ids),
      "max_tokens": int(max_new_tokens),
      "temperature": sampling.temperature,
      "top_p": sampling.top_p,
      "seed": sampling.seed,
    }
    if stop:
      body["stop"] = list(stop)[:4]  # the OpenAI API takes at most 4
    choice = await self._post(body)
    text = str(choice.get("text") or "")
    finish = "length" if choice.get("finish_reason") == "length" else "stop"
    if finish == "stop":
      text += restore_stop(text, stop)
    tokens = self.tokenizer.encode(text)
    return GenerationResult(
      tokens=tokens, logprobs=[0.0] * len(tokens), versions=[-1] * len(tokens), stop_reason=finish
    )

  async def _post(self, body: dict[str, Any]) -> dict[str, Any]:
    if self._session is None or self._session.closed:
      self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
    key = os.environ.get(self.config.api_key_env, "")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = self.base_url + "/completions"
    try:
      async with (
        asyncio.timeout(self.config.timeout_s),
        self._session.post(url, json=body, headers=headers) as resp,
      ):
        text = await resp.text()
        status = resp.status
    except aiohttp.ClientError as e:
      raise EngineError(f"cannot reach {url}: {type(e).__name__}: {e}") from e
    if status >= 400:
      raise EngineError(f"{url}: HTTP {status}: {text[:300]}")
    try:
      return json.loads(text)["choices"][0]
    except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
      raise EngineError(f"{url}: malformed completion: {e!r}") from e


class PinnedVersionClient:
  """Refuses any generation not produced wholly by one weight version.

  An evaluation pinned to a policy version must not score tokens of another: a server that
  loaded a newer version mid-evaluation would silently mix two policies into one number. Engines
  stamp the version of the weights that produced each token (`GenerationResult.versions`), so a
  result with any other version is an `EngineError` (the question is then redone, not scored).
  """

  def __init__(self, inner: Any, version: int) -> None:
    self.inner = inner
    self.version = version
    self.checked_tokens = 0  # generated tokens whose version was checked

  @property
  def base_url(self) -> Any:
    """The wrapped client's, for the runner's reachability check (None when in process)."""
    return getattr(self.inner, "base_url", None)

  def __getattr__(self, name: str) -> Any:
    return getattr(self.inner, name)  # what else callers ask of the client (close, stats, ...)

  async def generate(
    self,
    token_ids: Sequence[int],
    sampling: SamplingParams,
    max_new_tokens: int,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] | None = None,
  ) -> GenerationResult:
    result = await self.inner.generate(
      token_ids, sampling, max_new_tokens, stop=stop, stop_token_ids=stop_token_ids
    )
    other = sorted({v for v in result.versions if v != self.version})
    if other:
      raise EngineError(
        f"the evaluation is pinned to weights version {self.version}, but the server generated "
        f"with version(s) {other}"
      )
    self.checked_tokens += len(result.versions)
    return result
