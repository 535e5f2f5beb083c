"""LLM-as-judge through any OpenAI-compatible chat endpoint, with ASearcher's prompt shape.

The judge sees the question, the labeled answer and at most 500 characters of the prediction, and
must answer with a ```json block {"rationale": ..., "judgement": "Correct" | "Incorrect"}. Parsing
follows the original (json, then a Python literal, then substring checks), but retries are bounded:
the released local judge never increments its retry counter, so one unparseable verdict loops
forever. Here an endpoint error or an invalid verdict is retried `max_attempts` times in all, then
the verdict is `failed` (MBE 0) and the run goes on. Successful verdicts are cached on disk, keyed
by judge settings + question + gold + prediction, so re-running a report never pays twice.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import aiohttp

from asearcher_jax import storage
from asearcher_jax.errors import AsearcherError

log = logging.getLogger(__name__)

Judgement = Literal["correct", "incorrect"]

JUDGE_PROMPT = """You are an evaluation assistant. Please determine if the predicted answer is \
equivalent to the labeled answer.

Question: {question}

Labeled Answer: {labeled}

Predicted Answer: {predicted}

Are these two answers equivalent? Judge "Correct" if the predicted answer means the same as the \
labeled answer, otherwise "Incorrect".
The output should be in the following json format:
```json
{{
  "rationale": "your rationale for the judgement, as a text",
  "judgement": "your judgement result, can only be 'Correct' or 'Incorrect'"
}}
```
"""


class EndpointUnreachable(AsearcherError):
  """A server the run needs (engine, retrieval, judge) does not answer; checked before any work."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class JudgeConfig:
  """Where the judge is and how it is asked (defaults: ASearcher's judge sampling)."""

  # OpenAI-style API root including /v1, e.g. "http://127.0.0.1:8010/v1" or the OpenAI API.
  base_url: str
  # Model name sent in the request (a serve-model answers 404 unless it is its served name).
  model: str = "gpt-4o-mini-2024-07-18"
  # Environment variable holding the API key; unset or empty: no Authorization header.
  api_key_env: str = "OPENAI_API_KEY"
  # Sampling of the judge (ASearcher: 0.6 / 0.95 / 1024).
  temperature: float = 0.6
  top_p: float = 0.95
  max_tokens: int = 1024
  # Attempts per verdict in all (endpoint errors and invalid verdicts); then status "failed".
  max_attempts: int = 3
  # Seconds one request may take, and the first backoff after an endpoint error (doubled).
  timeout_s: float = 120.0
  backoff_s: float = 1.0
  # Requests in flight to the judge (ASearcher: 10 for OpenAI).
  concurrency: int = 10
  # Characters of the prediction shown (ASearcher: 500, after a cut at the first "</").
  pred_chars: int = 500
  # Characters of the question shown (keeps the prompt bounded for very long questions).
  question_chars: int = 20_000

  def __post_init__(self) -> None:
    if self.max_attempts < 1:
      raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
    if not self.base_url.startswith(("http://", "https://")):
      raise AsearcherError(f"judge base_url must be an http(s) URL, got {self.base_url!r}")

  @property
  def key(self) -> str:
    """Identifies the verdicts this judge gives (its model, sampling and prompt)."""
    blob = json.dumps(
      [self.base_url, self.model, self.temperature, self.top_p, self.max_tokens, JUDGE_PROMPT],
      sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verdict:
  """A judge's answer for one prediction.

  Attributes:
    judgement: "correct" / "incorrect", or None when no valid verdict came back.
    status: "success" or "failed" (endpoint errors or invalid verdicts on every attempt).
    attempts: requests made (0 for a cache hit or an empty prediction).
    raw: the last raw response (cut to 2,000 characters; empty for sensitive examples).
    error: why it failed, if it did.
  """

  judgement: Judgement | None
  status: Literal["success", "failed"]
  attempts: int = 0
  raw: str = ""
  error: str | None = None

  @property
  def mbe(self) -> float:
    """Model-based evaluation score: 1 if judged correct."""
    return float(self.judgement == "correct")

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: dict[str, Any]) -> Verdict:
    return cls(**d)


def prepare_prediction(pred: str, max_chars: int = 500) -> str:
  """ASearcher's cut: at the first "</" (within 1,000 chars), then to `max_chars`."""
  if "</" in pred:
    pred = pred.split("</", 1)[0][:1000]
  return pred[:max_chars]


def judge_prompt(question: str, answers: Sequence[str], pred: str, config: JudgeConfig) -> str:
  labeled = answers[0] if len(answers) == 1 else " OR ".join(answers)
  return JUDGE_PROMPT.format(
    question=question[: config.question_chars],
    labeled=labeled,
    predicted=prepare_prediction(pred, config.pred_chars),
  )


def parse_verdict(text: str) -> Judgement | None:
  """The text after the last ```json up to the next ```: JSON, then a Python literal; failing
  both, the original's substring checks. None means invalid (retry)."""
  if "```json" in text:
    block = text.rsplit("```json", 1)[1].split("```", 1)[0].strip()
    for loader in (json.loads, ast.literal_eval):
      try:
        obj = loader(block)
      except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        continue
      if isinstance(obj, dict):
        value = str(obj.get("judgement", obj.get("judgment", ""))).strip().lower()
        if value in ("correct", "incorrect"):
          return value  # type: ignore[return-value]
  low = text.lower()
  if '"judgement": "incorrect"' in low:
    return "incorrect"
  if '"judgement": "correct"' in low or '"judgement": correct' in low:
    return "correct"
  return None


class VerdictCache:
  """Successful verdicts, one JSON line each, keyed by judge + question + gold + prediction.

  Failed verdicts are not cached: a later run tries them again (as the original does).
  """

  def __init__(self, path: str | Path | None) -> None:
    self.path = Path(path) if path else None
    self._rows: dict[str, dict[str, Any]] = {}
    if self.path is not None and self.path.exists():
      for line in storage.jsonl_lines(self.path.read_text(encoding="utf-8")):
        try:
          row = json.loads(line)
          self._rows[row["key"]] = row["verdict"]
        except (json.JSONDecodeError, KeyError, TypeError):
          continue  # a line cut by a crash; the verdict is simply asked again

  @staticmethod
  def key(judge_key: str, question: str, answers: Sequence[str], pred: str) -> str:
    blob = json.dumps([judge_key, question, list(answers), pred], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()

  def get(self, key: str) -> Verdict | None:
    row = self._rows.get(key)
    return None if row is None else dataclasses.replace(Verdict.from_json(row), attempts=0)

  def put(self, key: str, verdict: Verdict) -> None:
    if verdict.status != "success":
      return
    self._rows[key] = verdict.to_json()
    if self.path is not None:
      self.path.parent.mkdir(parents=True, exist_ok=True)
      with self.path.open("a", encoding="utf-8") as f:
        f.write(json.dumps({"key": key, "verdict": verdict.to_json()}, ensure_ascii=False) + "\n")

  def __len__(self) -> int:
    return len(self._rows)


class LLMJudge:
  """Asks an OpenAI-compatible chat endpoint whether a prediction matches the gold answers."""

  def __init__(self, config: JudgeConfig, *, cache: VerdictCache | None = None) -> None:
    self.config = config
    self.cache = cache if cache is not None else VerdictCache(None)
    self._semaphore = asyncio.Semaphore(config.concurrency)
    self._session: aiohttp.ClientSession | None = None
    self.requests = 0  # HTTP requests sent (cache hits send none)

  @property
  def key(self) -> str:
    return self.config.key

  def _headers(self) -> dict[str, str]:
    key = os.environ.get(self.config.api_key_env, "")
    return {"Authorization": f"Bearer {key}"} if key else {}

  def _get_session(self) -> aiohttp.ClientSession:
    if self._session is None or self._session.closed:
      self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
    return self._session

  async def close(self) -> None:
    if self._session is not None:
      await self._session.close()
      self._session = None

  async def preflight(self, timeout_s: float = 10.0) -> None:
    """Fails fast with a message if the endpoint does not answer at all."""
    await probe_http(self.config.base_url.rstrip("/") + "/models", "judge", timeout_s)

  async def judge(
    self, question: str, answers: Sequence[str], pred: str | None, *, sensitive: bool = False
  ) -> Verdict:
    """Never raises for endpoint or model trouble: that is a `failed` verdict."""
    if pred is None or not pred.strip():
      return Verdict(judgement="incorrect", status="success", error="no prediction")
    key = VerdictCache.key(self.key, question, answers, prepare_prediction(pred))
    cached = self.cache.get(key)
    if cached is not None:
      return cached
    verdict = await self._ask(judge_prompt(question, answers, pred, self.config))
    if sensitive:
      verdict = dataclasses.replace(verdict, raw="")
    self.cache.put(key, verdict)
    return verdict

  async def _ask(self, prompt: str) -> Verdict:
    cfg = self.config
    raw, error = "", None
    for attempt in range(cfg.max_attempts):
      if attempt and error is not None and not error.startswith("invalid"):
        await asyncio.sleep(cfg.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random() / 2))
      body = {
        "model": cfg.model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_tokens": cfg.max_tokens,
        "seed": attempt,  # a retry must not replay the same sampled answer
      }
      try:
        raw = await self._post(body)
      except _Refused as e:  # a 4xx will not get better by asking again
        return Verdict(judgement=None, status="failed", attempts=attempt + 1, error=str(e))
      except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
        error = f"endpoint: {type(e).__name__}: {e}"
        log.warning("judge attempt %d/%d: %s", attempt + 1, cfg.max_attempts, error)
        continue
      judgement = parse_verdict(raw)
      if judgement is not None:
        return Verdict(judgement=judgement, status="success", attempts=attempt + 1, raw=raw[:2000])
      error = "invalid verdict (no parseable judgement)"
    return Verdict(
      judgement=None, status="failed", attempts=cfg.max_attempts, raw=raw[:2000], error=error
    )

  async def _post(self, body: dict[str, Any]) -> str:
    url = self.config.base_url.rstrip("/") + "/chat/completions"
    async with self._semaphore, asyncio.timeout(self.config.timeout_s):
      self.requests += 1
      async with self._get_session().post(url, json=body, headers=self._headers()) as resp:
        text = await resp.text()
        if 400 <= resp.status < 500 and resp.status not in (408, 429):
          raise _Refused(f"endpoint refused the request: HTTP {resp.status}: {text[:300]}")
        if resp.status >= 400:
          raise aiohttp.ClientResponseError(
            resp.request_info, (), status=resp.status, message=text[:300]
          )
    answer = json.loads(text)
    try:
      return str(answer["choices"][0]["message"]["content"] or "")
    except (KeyError, IndexError, TypeError) as e:
      raise ValueError(f"malformed chat completion: {e!r}") from None


class _Refused(Exception):
  pass


async def probe_http(url: str, what: str, timeout_s: float = 10.0) -> None:
  """Any HTTP answer counts as reachable; a refused connection or a timeout raises
  `EndpointUnreachable` naming `what` and the URL, within `timeout_s`."""
  try:
    async with (
      asyncio.timeout(timeout_s),
      aiohttp.ClientSession() as session,
      session.get(url) as resp,
    ):
      await resp.read()
  except (aiohttp.ClientError, OSError, TimeoutError) as e:
    reason = "timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
    raise EndpointUnreachable(f"{what} endpoint {url} is unreachable ({reason})") from None
