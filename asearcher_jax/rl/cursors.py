"""Which dataset item the rollout controller runs next: a plain epoch-wise walk (`DataCursor`) or
a learnability curriculum (`CurriculumCursor`) that spends rollouts where GRPO groups have mixed
outcomes.

A group whose n episodes all fail (or all succeed) has zero advantage everywhere and is dropped by
the zero-variance filter: every token generated for it is wasted. On a small policy most of the
hard questions (long chains) are all-fail and most of the easy ones all-pass, so a uniform walk
over the dataset spends most of its generation on groups that never train (measured in the
quickstart: ~75 %). `CurriculumCursor` keeps the dataset's mix but thins out the kinds of
questions that recently gave no signal:

  P(bucket b) ~ size_b * max(floor, mixed_rate_b)

where items are grouped into buckets by a label from the data file (SynthWiki: question kind and
hop count) and mixed_rate_b is a decayed, Laplace-smoothed estimate of the fraction of b's groups
that survived the zero-variance filter. Within a bucket items are visited in a seeded shuffled
walk, like `DataCursor`. The floor keeps every bucket sampled, so a bucket that becomes learnable
later (the policy improved) is noticed again. This is the "frontier of learnability" idea
(sample where p (1 - p) is large) at the granularity the data provides.

The state (per-bucket walks, counts, the RNG) is JSON and goes into the trainer's checkpoint, so
a resumed run makes the same choices as an uninterrupted one.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


class DataCursor:
  """Position in an endless, epoch-wise (optionally shuffled) walk over `num_items` items.

  The state is JSON-able (epoch, offset, seed) and goes into the trainer's checkpoint. Items are
  named by `key(epoch, index)`, which makes group ids unique across epochs and restarts.
  """

  def __init__(self, num_items: int, *, shuffle: bool, seed: int) -> None:
    if num_items < 1:
      raise ValueError("the dataset is empty")
    self.num_items, self.shuffle, self.seed = num_items, shuffle, seed
    self.epoch, self.offset = 0, 0
    self._order = self._permutation(0)

  def _permutation(self, epoch: int) -> np.ndarray:
    if not self.shuffle:
      return np.arange(self.num_items)
    return np.random.default_rng([self.seed, epoch]).permutation(self.num_items)

  @staticmethod
  def key(epoch: int, index: int) -> str:
    return f"e{epoch}/i{index}"

  def next(self) -> tuple[str, int]:
    """(item key, item index) and advance."""
    index = int(self._order[self.offset])
    key = self.key(self.epoch, index)
    self.offset += 1
    if self.offset == self.num_items:
      self.epoch, self.offset = self.epoch + 1, 0
      self._order = self._permutation(self.epoch)
    return key, index

  def state_dict(self) -> dict[str, Any]:
    return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "n": self.num_items}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    if int(state["n"]) != self.num_items or int(state["seed"]) != self.seed:
      raise ValueError(f"cursor state {dict(state)} does not match this dataset/seed")
    self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
    self._order = self._permutation(self.epoch)


class CurriculumCursor:
  """Same interface as `DataCursor` (next / key / state_dict / load_state_dict) plus `observe`.

  Item keys are `DataCursor.key(epoch, index)` with the bucket's epoch and the dataset index, so
  keys stay unique across buckets, epochs and restarts.
  """

  def __init__(
    self,
    buckets: Sequence[str],
    *,
    seed: int,
    floor: float = 0.05,
    decay: float = 0.95,
  ) -> None:
    if not buckets:
      raise ValueError("the dataset is empty")
    if not 0 < floor <= 1:
      raise ValueError(f"floor must be in (0, 1], got {floor}")
    if not 0 < decay <= 1:
      raise ValueError(f"decay must be in (0, 1], got {decay}")
    self.num_items, self.seed, self.floor, self.decay = len(buckets), seed, floor, decay
    members: dict[str, list[int]] = collections.defaultdict(list)
    for i, b in enumerate(buckets):
      members[str(b)].append(i)
    self.names = sorted(members)
    self._members = {b: np.asarray(members[b]) for b in self.names}
    self._bucket_of = {i: b for b, idx in members.items() for i in idx}
    self._walks = {
      b: DataCursor(len(self._members[b]), shuffle=True, seed=seed * 1_000_003 + k)
      for k, b in enumerate(self.names)
    }
    self._mixed = {b: 0.0 for b in self.names}  # decayed count of mixed groups
    self._seen = {b: 0.0 for b in self.names}  # decayed count of observed groups
    self._rng = np.random.default_rng(seed)

  key = staticmethod(DataCursor.key)

  def mixed_rate(self, bucket: str) -> float:
    """Laplace-smoothed fraction of the bucket's recent groups that had mixed outcomes."""
    return (self._mixed[bucket] + 1.0) / (self._seen[bucket] + 2.0)

  def weights(self) -> dict[str, float]:
    """Sampling probability of each bucket now."""
    raw = np.asarray(
      [len(self._members[b]) * max(self.floor, self.mixed_rate(b)) for b in self.names]
    )
    return dict(zip(self.names, (raw / raw.sum()).tolist(), strict=True))

  def next(self) -> tuple[str, int]:
    """(item key, dataset index) of the next item, from a bucket drawn by `weights`."""
    p = np.asarray(list(self.weights().values()))
    bucket = self.names[int(self._rng.choice(len(self.names), p=p))]
    walk = self._walks[bucket]
    epoch = walk.epoch
    _, local = walk.next()
    index = int(self._members[bucket][local])
    return self.key(epoch, index), index

  def observe(self, index: int, mixed: bool) -> None:
    """Records whether the group of dataset item `index` survived the zero-variance filter."""
    b = self._bucket_of[index]
    self._mixed[b] = self._mixed[b] * self.decay + float(mixed)
    self._seen[b] = self._seen[b] * self.decay + 1.0

  def metrics(self) -> dict[str, float]:
    """`curriculum/<bucket>/{mixed_rate,weight}` for the metric writer."""
    out = {}
    for b, w in self.weights().items():
      out[f"curriculum/{b}/mixed_rate"] = self.mixed_rate(b)
      out[f"curriculum/{b}/weight"] = w
    return out

  def state_dict(self) -> dict[str, Any]:
    return {
      "kind": "curriculum",
      "n": self.num_items,
      "seed": self.seed,
      "walks": {b: w.state_dict() for b, w in self._walks.items()},
      "mixed": dict(self._mixed),
      "seen": dict(self._seen),
      "rng": self._rng.bit_generator.state,
    }

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    if (
      state.get("kind") != "curriculum"
      or int(state["n"]) != self.num_items
      or int(state["seed"]) != self.seed
      or set(state["walks"]) != set(self.names)
    ):
      raise ValueError("curriculum cursor state does not match this dataset/seed")
    for b, w in state["walks"].items():
      self._walks[b].load_state_dict(w)
    self._mixed = {b: float(state["mixed"][b]) for b in self.names}
    self._seen = {b: float(state["seen"][b]) for b in self.names}
    self._rng.bit_generator.state = state["rng"]
