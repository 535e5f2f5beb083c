"""One generate call inside the driver: validated on the caller's loop, decoded on the engine thread.

A `Request` is made by `Request.create` in the caller's event loop (which checks that the prompt
fits), queued, then owned by the driver's engine thread: it appends every generated token with its
logprob and version (`append`, which also applies the stop rules), and resolves the caller's future
on the caller's own loop when it finishes or fails (`resolve`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from asearcher_jax.serving.types import GenerationResult, SamplingParams, StopReason


def prompt_problem(ids: Sequence[int], *, vocab_size: int, max_seq_len: int) -> str | None:
  """Why a prompt cannot be served (empty, an id outside the vocabulary, too long), or None: the
  one check every front door (OpenAI HTTP, JetStream gRPC) applies, with the same words."""
  if not ids:
    return "empty prompt"
  if min(ids) < 0 or max(ids) >= vocab_size:
    return f"token ids must be in [0, {vocab_size})"
  if len(ids) >= max_seq_len:
    return f"prompt of {len(ids)} tokens does not fit the context (max_seq_len={max_seq_len})"
  return None


@dataclasses.dataclass(eq=False)
class Request:
  """Attributes:
  id: unique among the requests in flight.
  prompt: the context token ids, fed verbatim.
  max_new_tokens: capped so that prompt + tokens fit the context.
  stop: stop strings (non-empty); stop_ids: stop token ids.
  seed: the request's sampling key (drawn at random when SamplingParams.seed is None).
  loop, future: the caller's event loop and the future it awaits.
  tokens, logprobs, versions: what was generated so far, one entry per token (versions is
    appended last, so the three agree up to len(versions)).
  top: per token, its most likely alternatives (id, logprob), when the sampling asks for them.
  slot: the decode slot it holds, once admitted.
  aborted: set by `Driver.abort` from any thread; the engine thread frees the slot.
  """

  id: str
  prompt: list[int]
  sampling: SamplingParams
  max_new_tokens: int
  stop: tuple[str, ...]
  stop_ids: frozenset[int]
  seed: int
  loop: asyncio.AbstractEventLoop
  future: asyncio.Future
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  top: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
  slot: int | None = None
  aborted: bool = False
  submitted: float = dataclasses.field(default_factory=time.monotonic)

  @classmethod
  def create(
    cls,
    request_id: str,
    token_ids: Sequence[int],
    sampling: SamplingParams,
    max_new_tokens: int,
    stop: Sequence[str],
    stop_token_ids: Sequence[int],
    *,
    max_seq_len: int,
  ) -> Request:
    """A request bound to the running event loop. Raises ValueError for an empty prompt, one
    that does not fit max_seq_len, or max_new_tokens < 1."""
    prompt = [int(t) for t in token_ids]
    if not prompt:
      raise ValueError("empty prompt")
    if len(prompt) >= max_seq_len:
      raise ValueError(
        f"prompt of {len(prompt)} tokens does not fit the context (max_seq_len={max_seq_len})"
      )
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    loop = asyncio.get_running_loop()
    seed = sampling.seed if sampling.seed is not None else int(np.random.randint(0, 2**31 - 1))
    return cls(
      id=request_id,
      prompt=prompt,
      sampling=sampling,
      max_new_tokens=min(max_new_tokens, max_seq_len - len(prompt)),
      stop=tuple(s for s in stop if s),
      stop_ids=frozenset(int(t) for t in stop_token_ids),
      seed=seed,
      loop=loop,
      future=loop.create_future(),
    )

  def append(
    self,
    token: int,
    logprob: float,
    version: int,
    decode: Callable[[list[int]], str],
    top: tuple[np.ndarray, np.ndarray] | None = None,
  ) -> StopReason | None:
    """Records one generated token; returns why the request stops now, or None. decode: the
    tokenizer's, for stop strings (only the last few tokens are decoded). top: the step's
    alternatives for this slot (ids, logprobs), most likely first."""
    k = self.sampling.top_logprobs
    if k:
      ids, lps = top if top is not None else ((), ())
      self.top.append([(int(i), float(lp)) for i, lp in zip(ids[:k], lps[:k], strict=True)])
    self.tokens.append(token)
    self.logprobs.append(logprob)
    self.versions.append(version)
    if token in self.stop_ids or (self.stop and self._hit_stop_string(decode)):
      return "stop"
    if len(self.tokens) >= self.max_new_tokens:
      return "length"
    return None

  def _hit_stop_string(self, decode: Callable[[list[int]], str]) -> bool:
    longest = max(len(s) for s in self.stop)
    window = decode(self.tokens[-(longest + 2) :])
    return any(s in window for s in self.stop)

  def progress(self) -> tuple[list[int], list[float], list[int]]:
    """Copies of (tokens, logprobs, versions) so far; safe to call from any thread."""
    n = len(self.versions)  # appended last: the three lists agree up to n
    return list(self.tokens[:n]), list(self.logprobs[:n]), list(self.versions[:n])

  def result(self, reason: StopReason) -> GenerationResult:
    return GenerationResult(
      tokens=list(self.tokens),
      logprobs=list(self.logprobs),
      versions=list(self.versions),
      stop_reason=reason,
      top_logprobs=[list(t) for t in self.top] if self.sampling.top_logprobs else None,
    )

  def resolve(self, outcome: GenerationResult | Exception) -> None:
    """Hands the outcome to the caller's future, on the caller's loop (from any thread); a no-op
    when the future is done already or the loop is closed (nobody waits)."""

    def resolve() -> None:
      if self.future.done():
        return
      if isinstance(outcome, Exception):
        self.future.set_exception(outcome)
      else:
        self.future.set_result(outcome)

    with contextlib.suppress(RuntimeError):
      self.loop.call_soon_threadsafe(resolve)
