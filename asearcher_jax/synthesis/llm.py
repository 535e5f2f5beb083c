"""The three LLM roles of QA synthesis (generator, solver, judge) over OpenAI-compatible servers.

Each role is its own endpoint, model name, sampling and concurrency, because in practice they are
different models (ASearcher used QwQ-32B to write and solve, Qwen2.5-72B to judge) and a slow judge
must not starve the generator. Every call is bounded: a per-request timeout, a fixed number of
attempts (endpoint errors, empty text and output the caller cannot parse all count as attempts),
then a `CallFailed` whose `reason` the loop counts. Every attempt is logged (prompt, output,
latency, error) so a rejected candidate can always be explained, and all roles share one budget
of calls and tokens so a run cannot spend without bound.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import aiohttp

from asearcher_jax.errors import AsearcherError

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoleConfig:
  """Where one role's model is served and how it is sampled."""

  # OpenAI-style API root including /v1, e.g. "http://127.0.0.1:8000/v1"; "local": the in-process
  # tiny serve-model that `synth` starts when any role asks for it.
  base_url: str = "local"
  # Model name sent in requests (serve-model accepts any).
  model: str = "asearcher-policy"
  # "chat" (/chat/completions with the server's chat template) or "completions" (raw prompt).
  api: Literal["chat", "completions"] = "chat"
  # Sampling (ASearcher: generator 0.8/0.95, solver 0.6/0.95, judge 0.6/0.95).
  temperature: float = 0.8
  top_p: float = 0.95
  # Completion tokens per call.
  max_tokens: int = 1024
  # Requests in flight to this endpoint.
  concurrency: int = 16
  # Seconds one request may take, and the first backoff after an endpoint error (doubled).
  timeout_s: float = 120.0
  backoff_s: float = 0.5
  # Attempts per call in all: endpoint errors, empty text and unparseable output each use one.
  max_attempts: int = 3
  # Environment variable holding the API key; unset or empty: no Authorization header.
  api_key_env: str = "OPENAI_API_KEY"

  def __post_init__(self) -> None:
    if self.max_attempts < 1 or self.concurrency < 1:
      raise ValueError("max_attempts and concurrency must be >= 1")
    if self.base_url != "local" and not self.base_url.startswith(("http://", "https://")):
      raise AsearcherError(f"role base_url must be an http(s) URL or 'local': {self.base_url!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Roles:
  """The three roles of a synthesis run (ASearcher's sampling: generator 0.8, solver and judge 0.6)."""

  # Writes the base QA, picks and makes each edit (injection / fuzzing), and runs the quality,
  # duplicate and alternative-answer checks.
  generator: RoleConfig = dataclasses.field(default_factory=RoleConfig)
  # Answers each candidate without its statements (the difficulty test).
  solver: RoleConfig = dataclasses.field(default_factory=lambda: RoleConfig(temperature=0.6))
  # Grades the solver's answers that are not exact matches (grader "judge").
  judge: RoleConfig = dataclasses.field(default_factory=lambda: RoleConfig(temperature=0.6))

  def items(self) -> tuple[tuple[str, RoleConfig], ...]:
    """(name, config) of each role, generator first."""
    return (("generator", self.generator), ("solver", self.solver), ("judge", self.judge))


class CallFailed(Exception):
  """A call gave no usable output after all attempts; `reason` is a short counted tag
  ("timeout", "http_500", "bad_response", "empty", "malformed", "refused", "budget")."""

  def __init__(self, reason: str, detail: str = "") -> None:
    super().__init__(f"{reason}: {detail}" if detail else reason)
    self.reason = reason


class BudgetExceeded(CallFailed):
  def __init__(self, detail: str) -> None:
    super().__init__("budget", detail)


@dataclasses.dataclass(kw_only=True)
class Budget:
  """Calls and tokens (prompt + completion, as the server reports them, else chars / 4) that all
  roles may spend in one run; 0 means unlimited."""

  max_calls: int = 0
  max_tokens: int = 0
  calls: int = 0
  tokens: int = 0

  def check(self) -> None:
    if self.max_calls and self.calls >= self.max_calls:
      raise BudgetExceeded(f"{self.calls} calls spent (max_calls={self.max_calls})")
    if self.max_tokens and self.tokens >= self.max_tokens:
      raise BudgetExceeded(f"{self.tokens} tokens spent (max_tokens={self.max_tokens})")

  @property
  def exhausted(self) -> bool:
    try:
      self.check()
    except BudgetExceeded:
      return True
    return False


class CallLog:
  """Every request, one JSON line: role, step, seed, attempt, prompt, output, latency, error."""

  def __init__(self, path: str | Path | None) -> None:
    self.path = Path(path) if path else None
    self._lock = threading.Lock()
    self.rows = 0
    if self.path is not None:
      self.path.parent.mkdir(parents=True, exist_ok=True)

  def write(self, row: dict[str, Any]) -> None:
    self.rows += 1
    if self.path is None:
      return
    line = json.dumps(row, ensure_ascii=False) + "\n"
    with self._lock, self.path.open("a", encoding="utf-8") as f:
      f.write(line)


class _Retryable(Exception):
  def __init__(self, reason: str, detail: str = "") -> None:
    super().__init__(detail)
    self.reason = reason


class LLMRole:
  """One role's endpoint: `ask(prompt, parse)` returns the parsed output or raises `CallFailed`."""

  def __init__(self, name: str, config: RoleConfig, *, log: CallLog, budget: Budget) -> None:
    self.name = name
    self.config = config
    self.log = log
    self.budget = budget
    self._semaphore = asyncio.Semaphore(config.concurrency)
    self._session: aiohttp.ClientSession | None = None

  async def close(self) -> None:
    if self._session is not None:
      await self._session.close()
      self._session = None

  def _url(self) -> str:
    path = "/chat/completions" if self.config.api == "chat" else "/completions"
    return self.config.base_url.rstrip("/") + path

  async def ask(
    self,
    prompt: str,
    parse: Callable[[str], T],
    *,
    step: str,
    seed_id: str = "",
    sample: int = 0,
    temperature: float | None = None,
  ) -> T:
    """`parse` raises ValueError for output not in the prompt's format (that costs an attempt).

    `sample` varies the sampling seed across the n samples of one prompt; attempts vary it too,
    so a retry never replays the same unparseable text."""
    cfg = self.config
    last = _Retryable("empty")
    for attempt in range(cfg.max_attempts):
      if attempt and last.reason not in ("malformed", "empty"):
        await asyncio.sleep(cfg.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random() / 2))
      self.budget.check()
      self.budget.calls += 1
      t0 = time.perf_counter()
      # "interrupted" stays only if the call is cancelled (seed or run timeout) mid-flight.
      output, usage, error = "", None, "interrupted"
      try:
        output, usage = await self._post(prompt, sample * 1000 + attempt, temperature)
        if not output.strip():
          raise _Retryable("empty", "the endpoint returned empty text")
        result = parse(output)
        error = None
      except _Retryable as e:
        last, error = e, f"{e.reason}: {e}"
      except ValueError as e:  # the caller's parser: not in the prompt's output format
        last, error = _Retryable("malformed", str(e)), f"malformed: {e}"
      else:
        return result
      finally:
        tokens = (usage or {}).get("total_tokens") or (len(prompt) + len(output)) // 4
        self.budget.tokens += int(tokens)
        self.log.write({
          "time": time.time(), "role": self.name, "model": cfg.model, "step": step,
          "seed": seed_id, "sample": sample, "attempt": attempt, "prompt": prompt,
          "output": output, "latency_s": round(time.perf_counter() - t0, 4), "usage": usage,
          "error": error,
        })  # fmt: skip
      if last.reason == "refused":
        break
    raise CallFailed(last.reason, str(last))

  async def _post(
    self, prompt: str, seed: int, temperature: float | None
  ) -> tuple[str, dict[str, Any] | None]:
    cfg = self.config
    body: dict[str, Any] = {
      "model": cfg.model,
      "temperature": cfg.temperature if temperature is None else temperature,
      "top_p": cfg.top_p,
      "max_tokens": cfg.max_tokens,
      "seed": seed,
    }
    if cfg.api == "chat":
      body["messages"] = [{"role": "user", "content": prompt}]
    else:
      body["prompt"] = prompt
    key = os.environ.get(cfg.api_key_env, "")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if self._session is None or self._session.closed:
      self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
    try:
      # The timeout starts once the semaphore is held (contexts are entered in order).
      async with (
        self._semaphore,
        asyncio.timeout(cfg.timeout_s),
        self._session.post(self._url(), json=body, headers=headers) as resp,
      ):
        text = await resp.text()
        status = resp.status
    except TimeoutError:
      raise _Retryable("timeout", f"no answer within {cfg.timeout_s} s") from None
    except (aiohttp.ClientError, OSError) as e:
      raise _Retryable("unreachable", f"{type(e).__name__}: {e}") from None
    if 400 <= status < 500 and status not in (408, 429):
      raise _Retryable("refused", f"HTTP {status}: {text[:300]}")
    if status >= 400:
      raise _Retryable(f"http_{status}", text[:300])
    try:
      data = json.loads(text)
      choice = data["choices"][0]
      out = choice["message"]["content"] if cfg.api == "chat" else choice["text"]
    except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
      raise _Retryable("bad_response", f"not an OpenAI completion: {e!r}") from None
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
    return str(out or ""), usage
