"""The generation interface every agent and the rollout code program against.

One `generate` signature for the in-process RL driver, a remote `serve-model` server, or a
scripted stand-in in tests: callers never know which engine answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable


class EngineError(RuntimeError):
  """The engine failed while serving this request (the driver itself keeps running), or a
  remote engine could not be reached after the client's retries."""


StopReason = Literal["stop", "length", "abort"]

# Most top alternatives a request may ask for per token (OpenAI's chat limit; the engine computes
# this many, `engine_steps.TOP_N`, when any request asks).
MAX_TOP_LOGPROBS = 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
  """How one request samples.

  Attributes:
    temperature: logits are divided by it; 0 means greedy (argmax). The reported logprob of a
      token is always log softmax(logits / temperature) (temperature 1 when greedy): top-p and
      top-k change which token is drawn, never the reported logprob, so the learner recomputes it
      exactly with `transformer.token_logprobs`.
    top_p: nucleus sampling mass in (0, 1]; 1 disables it.
    top_k: keep the k most likely tokens; 0 disables it.
    seed: per-request seed; None draws one from the engine's generator.
    logprobs: compute each token's logprob (RL always needs them). False lets a step in which
      every slot is greedy and none wants logprobs skip the exp-sum over the vocabulary (~1.3 ms
      of a ~10 ms step at batch 32 and a 150k vocabulary on CPU); such tokens report NaN.
    top_logprobs: also report this many most likely alternatives per token, with their logprobs
      under the same distribution (OpenAI's `top_logprobs`; at most `MAX_TOP_LOGPROBS`). A step in
      which some slot asks computes them for every slot (one more compiled step); RL never asks,
      so its steps compute nothing more.
  """

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int | None = None
  logprobs: bool = True
  top_logprobs: int = 0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
      raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationResult:
  """The engine's answer to one request; tokens are the truth (never re-tokenize them).

  Attributes:
    tokens: generated ids, verbatim, including the stop token or the tokens of a matched stop
      string.
    logprobs: per generated token, its logprob under the sampling distribution (temperature-scaled
      softmax, before top-p/top-k), computed by the same function the learner uses; NaN where the
      request set `SamplingParams.logprobs=False` and the engine skipped it.
    versions: per generated token, the policy version of the weights that produced it, stamped by
      the engine (a weight update mid-request shows up as a change in this list).
    stop_reason: "stop" (stop token or stop string), "length" (max_new_tokens or context full) or
      "abort" (aborted or cancelled; tokens so far are kept).
    top_logprobs: per generated token, the `SamplingParams.top_logprobs` most likely (token id,
      logprob) pairs, most likely first; None when not asked.
  """

  tokens: list[int]
  logprobs: list[float]
  versions: list[int]
  stop_reason: StopReason
  top_logprobs: list[list[tuple[int, float]]] | None = None


@runtime_checkable
class GenerationClient(Protocol):
  async def generate(
    self,
    token_ids: Sequence[int],
    sampling: SamplingParams,
    max_new_tokens: int,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] | None = None,
  ) -> GenerationResult:
    """Continues `token_ids`. stop: strings that end generation (kept in the output);
    stop_token_ids: None means the tokenizer's stop tokens (<|im_end|>, <|endoftext|>)."""
    ...


@dataclasses.dataclass(frozen=True)
class RecordedCall:
  """One generation call as a client saw it (scripted clients and the SynthWiki expert log these)."""

  input_ids: list[int]
  result: GenerationResult
  stop: tuple[str, ...]
  max_new_tokens: int
