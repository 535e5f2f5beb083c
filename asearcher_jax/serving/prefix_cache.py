"""Prefix reuse: the driver's parked slots, and which one a new prompt continues.

A request that leaves its slot (finished or aborted) parks it: the driver marks the slot inactive
in the engine (decode steps then neither advance it nor write inside its cache rows) and this cache
remembers its token sequence -- prompt + tokens but the last, whose keys/values may not exist (it
was sampled, and only a step dispatched ahead may have fed it; reuse never relies on that). A new
request whose prompt starts with a parked sequence (an agent's next turn: previous prompt + output
+ tool result) is admitted into that slot by prefilling only the rest of its prompt at that offset,
which gives the same tokens and logprobs as a full prefill. Parked slots are reclaimed least
recently parked first, and forgotten when their keys/values stop being valid (a weight update that
recomputes, a lost decode state).

Bookkeeping only: no engine, no device arrays. The driver's engine thread owns it (not locked).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence


class PrefixCache:
  """Parked slots, least recently parked first, each with the tokens whose keys/values its cache
  rows hold (positions 0..len-1).

  Attributes:
    enabled: whether finished requests' slots are parked at all (`DriverConfig.prefix_reuse`);
      when off, the cache stays empty.
  """

  def __init__(self, enabled: bool = True):
    self.enabled = enabled
    self._parked: collections.OrderedDict[int, list[int]] = collections.OrderedDict()

  def __len__(self) -> int:
    return len(self._parked)

  def __contains__(self, slot: object) -> bool:
    return slot in self._parked

  def park(self, slot: int, tokens: Sequence[int]) -> None:
    """Remembers that `slot` holds the keys/values of `tokens`; it becomes the most recently
    parked. The caller has released the slot in the engine. A no-op when the cache is disabled."""
    if not self.enabled:
      return
    self._parked[slot] = list(tokens)
    self._parked.move_to_end(slot)

  def take(self, prompt: list[int]) -> tuple[int, list[int]] | None:
    """Removes and returns (slot, its tokens) for the parked sequence that is the longest prefix
    of `prompt` (the least recently parked among equals), or None if no parked sequence is."""
    best, best_len = None, 0
    for slot, seq in self._parked.items():
      if best_len < len(seq) <= len(prompt) and prompt[: len(seq)] == seq:
        best, best_len = slot, len(seq)
    if best is None:
      return None
    return best, self._parked.pop(best)

  def evict(self) -> int:
    """Forgets the least recently parked slot and returns it, free for a fresh prefill. Raises
    KeyError when nothing is parked."""
    if not self._parked:
      raise KeyError("no parked slot to evict")
    return self._parked.popitem(last=False)[0]

  def clear(self) -> None:
    """Forgets every parked slot (their keys/values are no longer valid)."""
    self._parked.clear()
