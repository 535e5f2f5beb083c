"""A controllable agent workload on the real engine: long-tailed episodes, slow tools.

A random tiny policy never writes `<search>` or `<answer>`, so without help every episode is one
turn long and no tool is ever called, which makes rollout cost (and async RL's reason to exist)
vanish. These pieces give a benchmark or test a realistic workload while the real engine still
generates every sampled token:

  `SteeringClient`   wraps a `GenerationClient` (the in-process Driver); per episode it is told
                     how many tool calls `k` to make. On each act turn it appends
                     ` <search>...</search>` to what the engine generated until `k` searches
                     were made, then ` <answer>...</answer>`. The appended tokens carry logprob 0
                     and the engine's version (they are trained like the rest of the output, as in
                     `tests/evaluation/helpers.ActingClient`). It also draws each call's output
                     length and disables EOS stops, so a random policy's stray EOS does not cut
                     the episode (a read turn ending on EOS has that one token dropped).
  `LatencySearch`    a search provider that sleeps a drawn latency (wall-clock waiting, as a web
                     search does) and returns short documents.
  `lognormal_*`      the distributions, seeded and capped.
  `write_byte_tokenizer` a Qwen-style byte-level tokenizer (259 ids) so a tiny model's softmax
                     and the learner's logprobs are cheap on CPU.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from asearcher_jax.serving.types import GenerationClient, GenerationResult, SamplingParams
from asearcher_jax.tokenizer import Tokenizer
from asearcher_jax.tools.http_retry import CallStats
from asearcher_jax.tools.search import Document

BYTE_VOCAB = 260  # 256 bytes + 3 specials, rounded up


def write_byte_tokenizer(d: Path) -> Path:
  """A Qwen-style byte-level BPE with no merges: every byte is one token."""
  bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
  cs, n = bs[:], 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  byte_to_char = dict(zip(bs, cs))
  d.mkdir(parents=True, exist_ok=True)
  (d / "vocab.json").write_text(json.dumps({chr(byte_to_char[b]): b for b in range(256)}))
  (d / "merges.txt").write_text("#version: 0.2\n")
  specials = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258}
  (d / "added_tokens.json").write_text(json.dumps(specials))
  return d


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogNormal:
  """A log-normal with a median and a log-space sigma, clipped to [low, high]."""

  median: float
  sigma: float
  low: float
  high: float

  def draw(self, rng: np.random.Generator) -> float:
    return float(
      np.clip(self.median * np.exp(self.sigma * rng.standard_normal()), self.low, self.high)
    )

  def draw_int(self, rng: np.random.Generator) -> int:
    return round(self.draw(rng))


class SafeRng:
  """A seeded generator shared by the rollout thread's coroutines and factory calls (locked, so
  a draw sequence is reproducible per seed whatever thread asks)."""

  def __init__(self, seed: int) -> None:
    self._rng = np.random.default_rng(seed)
    self._lock = threading.Lock()

  def draw(self, dist: LogNormal) -> float:
    with self._lock:
      return dist.draw(self._rng)

  def draw_int(self, dist: LogNormal) -> int:
    with self._lock:
      return dist.draw_int(self._rng)


class SteeringClient:
  """One episode's client: `k` searches, then an answer; every sampled token is the engine's."""

  def __init__(
    self,
    inner: GenerationClient,
    tokenizer: Tokenizer,
    *,
    k: int,
    rng: SafeRng,
    output_len: LogNormal,
    tag: str = "",
  ) -> None:
    self.inner = inner
    self.tokenizer = tokenizer
    self.k = k
    self.rng = rng
    self.output_len = output_len
    self.tag = tag
    self.searches = 0

  async def generate(
    self,
    token_ids: Sequence[int],
    sampling: SamplingParams,
    max_new_tokens: int,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] | None = None,
  ) -> GenerationResult:
    act = "</search>" in stop
    extra: list[int] = []
    if act:
      if self.searches < self.k:
        self.searches += 1
        action = f" <search>{self.tag} query {self.searches}</search>"
      else:
        action = f" <answer>{self.tag} answer</answer>"
      extra = self.tokenizer.encode(action)
    # The appended action counts against max_new_tokens like generated tokens, so a call never
    # outgrows the agent's context budget (and no training sequence the engine's context).
    budget = max(1, max_new_tokens - len(extra))
    want = max(1, min(budget, self.rng.draw_int(self.output_len)))
    res = await self.inner.generate(token_ids, sampling, want, stop=stop, stop_token_ids=())
    tokens, logprobs, versions = list(res.tokens), list(res.logprobs), list(res.versions)
    if not act:  # a read turn: the engine's output, minus a final EOS that would end the episode
      if tokens and tokens[-1] in self.tokenizer.stop_token_ids:
        tokens, logprobs, versions = tokens[:-1], logprobs[:-1], versions[:-1]
      return dataclasses.replace(res, tokens=tokens, logprobs=logprobs, versions=versions)
    extra = extra[: max(0, max_new_tokens - len(tokens))]
    version = versions[-1] if versions else 0
    return GenerationResult(
      tokens=[*tokens, *extra],
      logprobs=[*logprobs, *([0.0] * len(extra))],
      versions=[*versions, *([version] * len(extra))],
      stop_reason="stop",
    )


class LatencySearch:
  """A search provider whose every call waits a drawn latency, then returns `topk` short docs."""

  name = "latency"

  def __init__(self, latency: LogNormal, rng: SafeRng, *, doc_chars: int = 100) -> None:
    self.latency = latency
    self.rng = rng
    self.doc_chars = doc_chars
    self.calls = 0
    self.waited_s = 0.0

  async def search(self, query: str, topk: int, stats: CallStats) -> list[Document]:
    delay = self.rng.draw(self.latency)
    self.calls += 1
    self.waited_s += delay
    await asyncio.sleep(delay)
    stats.attempts += 1
    body = (f"Results about {query}. " * 8)[: self.doc_chars]
    return [Document(contents=body, url=f"https://example.org/{i}") for i in range(topk)]

  async def close(self) -> None:
    return None
