"""A pass-through `GenerationClient` that records every call, so a trajectory produced with a real
engine can be checked against exactly what that engine received and returned."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from asearcher_jax.serving.types import (
  GenerationClient,
  GenerationResult,
  RecordedCall,
  SamplingParams,
)


class RecordingClient:
  def __init__(
    self,
    inner: GenerationClient,
    *,
    after_call: Callable[[int], Awaitable[None]] | None = None,
  ) -> None:
    self.inner = inner
    # Awaited with the call's index after each call (e.g. to push new weights mid-episode).
    self.after_call = after_call
    self.calls: list[RecordedCall] = []

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
    self.calls.append(RecordedCall(list(token_ids), result, tuple(stop), max_new_tokens))
    if self.after_call is not None:
      await self.after_call(len(self.calls) - 1)
    return result
