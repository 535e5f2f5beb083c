"""A `GenerationClient` that replays scripted outputs with an engine's token semantics.

The script is a list of outputs or a policy function of the decoded context. A text output is
tokenized with the real tokenizer and followed by EOS (the model ending its turn); a token-id
output is used verbatim (for invalid UTF-8 byte tokens and other adversarial ids); a
`GenerationResult` is returned as is (for aborts). Then the engine rules apply: the output ends
right after the token that completes the first stop string or is a stop token, and is cut at
`max_new_tokens` with stop reason "length". Every call is recorded, so tests can compare a
trajectory with what the "engine" really received and produced.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from asearcher_jax.serving.types import GenerationResult, RecordedCall, SamplingParams
from asearcher_jax.tokenizer import Tokenizer

Output = str | Sequence[int] | GenerationResult
# (decoded context, call index) -> the model's next output.
Policy = Callable[[str, int], Output]


def fake_logprob(token: int, position: int) -> float:
  """Deterministic, distinct-looking logprobs so tests can check they are carried verbatim."""
  return -((token * 7919 + position * 31) % 1000) / 250.0 - 1e-3


class ScriptedClient:
  """Replays outputs; raises IndexError when a list script runs out (a test bug, loudly)."""

  def __init__(
    self,
    tokenizer: Tokenizer,
    script: Sequence[Output] | Policy,
    *,
    version: int = 0,
    delay_s: float = 0.0,
  ) -> None:
    self.tokenizer = tokenizer
    self.script = script
    # The policy version stamped on generated tokens; tests may change it between calls.
    self.version = version
    self.delay_s = delay_s
    self.calls: list[RecordedCall] = []

  def _next(self, token_ids: Sequence[int]) -> Output:
    i = len(self.calls)
    if callable(self.script):
      return self.script(self.tokenizer.decode(token_ids), i)
    return self.script[i]

  async def generate(
    self,
    token_ids: Sequence[int],
    sampling: SamplingParams,
    max_new_tokens: int,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] | None = None,
  ) -> GenerationResult:
    if self.delay_s:
      await asyncio.sleep(self.delay_s)
    else:
      await asyncio.sleep(0)
    out = self._next(token_ids)
    if isinstance(out, GenerationResult):
      result = out
    else:
      if isinstance(out, str):
        tokens = [*self.tokenizer.encode(out), self.tokenizer.eos_id]
      else:
        tokens = [int(t) for t in out]
      stops = self.tokenizer.stop_token_ids if stop_token_ids is None else tuple(stop_token_ids)
      tokens, reason = self.apply_stops(tokens, tuple(stop), stops, max_new_tokens)
      result = GenerationResult(
        tokens=tokens,
        logprobs=[fake_logprob(t, j) for j, t in enumerate(tokens)],
        versions=[self.version] * len(tokens),
        stop_reason=reason,
      )
    self.calls.append(RecordedCall(list(token_ids), result, tuple(stop), max_new_tokens))
    return result

  def apply_stops(
    self, tokens: list[int], stop: tuple[str, ...], stop_ids: tuple[int, ...], max_new: int
  ) -> tuple[list[int], str]:
    """Where an engine decoding these tokens one by one would have stopped, and why.

    An output that ends without a stop token or stop string is treated as cut off ("length").
    """
    end = None
    for j, t in enumerate(tokens):
      if t in stop_ids:
        end = j + 1
        break
    if stop:
      limit = len(tokens) if end is None else end
      if any(s in self.tokenizer.decode(tokens[:limit]) for s in stop):
        # The first k whose decoded prefix contains a stop string (monotone in k).
        lo, hi = 1, limit
        while lo < hi:
          mid = (lo + hi) // 2
          if any(s in self.tokenizer.decode(tokens[:mid]) for s in stop):
            hi = mid
          else:
            lo = mid + 1
        end = lo
    if end is not None and end <= max_new:
      return tokens[:end], "stop"
    return tokens[:max_new], "length"
