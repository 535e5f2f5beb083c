"""Staleness-bounded admission of rollout groups (AReaL's StalenessManager).

Unit: one admission is one GRPO *group* (one dataset item run as n agent episodes), and B is the
number of groups per training batch, so every counter here counts groups, never episodes or
sequences. A new group may start only if

  capacity = min(max_concurrent - running, (eta + v + 1) * B - (accepted + running)) > 0

with v the current policy version and `accepted` cumulative (never decremented when the learner
consumes a batch). Rejected groups (zero-variance filtered, environment failures) release their
slot without counting, so filtering never eats the staleness budget. Batches are formed
oldest-first, so the group admitted as the N-th is trained at step ~(N-1)//B, and at admission
v >= that step - eta: the head token of every trained group is at most eta versions old. The
bound is exact when groups finish in admission order; a slow group that later ones overtake can
lag more (AReaL's "approximately"), which the replay queue's `max_head_staleness` turns into a
hard limit by discarding such groups (`on_discard` returns their budget).
eta = 0 is synchronous RL: exactly B groups are admitted per version.

Thread- and asyncio-safe: every method holds a threading.Lock only for O(1) counter work and never
across an await; asyncio waiters are woken with `call_soon_threadsafe`, so the rollout loop never
blocks on a lock held by the learner thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class StalenessConfig:
  """Attributes:
  batch_groups: B, groups per training batch (the learner's `take(B)`); >= 1.
  max_staleness: eta, max head off-policyness in policy versions; 0 = synchronous RL.
  max_concurrent: groups allowed in flight at once; None falls back to B (AReaL's default).
  """

  batch_groups: int
  max_staleness: int = 4
  max_concurrent: int | None = None

  def __post_init__(self):
    if self.batch_groups < 1:
      raise ValueError(f"batch_groups must be >= 1, got {self.batch_groups}")
    if self.max_staleness < 0:
      raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
    if self.max_concurrent is not None and self.max_concurrent < 1:
      raise ValueError(f"max_concurrent must be >= 1 or None, got {self.max_concurrent}")

  @property
  def concurrency(self) -> int:
    return self.batch_groups if self.max_concurrent is None else self.max_concurrent


class StalenessManager:
  """Counters (running, accepted, rejected) and the policy version, behind one small lock.

  Lifecycle of one group: `try_start()` (or `await astart()`) -> `on_accept()` | `on_reject()`.
  The version is not this manager's own: the trainer owns it (its learner's step advances it)
  and tells it here, with `set_version(v)` once the weight sync has published v and with
  `restore(version=v)` after a checkpoint; every change goes through `_move_version_locked`.
  """

  def __init__(self, config: StalenessConfig, *, version: int = 0) -> None:
    self.config = config
    self._lock = threading.Lock()
    self._cond = threading.Condition(self._lock)
    self._version = version
    self._running = 0
    self._accepted = 0
    self._rejected = 0
    # asyncio waiters: (loop, event), woken on every counter change.
    self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

  # --- the rule -----------------------------------------------------------------------------

  def _capacity_locked(self) -> int:
    c = self.config
    by_concurrency = c.concurrency - self._running
    by_staleness = (c.max_staleness + self._version + 1) * c.batch_groups - (
      self._accepted + self._running
    )
    return min(by_concurrency, by_staleness)

  def capacity(self) -> int:
    """How many more groups may start now (may be negative)."""
    with self._lock:
      return self._capacity_locked()

  # --- lifecycle ----------------------------------------------------------------------------

  def try_start(self) -> bool:
    """Atomically: if capacity > 0, count one running group and return True."""
    with self._lock:
      if self._capacity_locked() <= 0:
        return False
      self._running += 1
      return True

  def on_start(self) -> None:
    """Counts a started group unconditionally (the caller already checked `capacity()`);
    prefer `try_start`, which checks and counts under one lock."""
    with self._lock:
      self._running += 1

  def on_accept(self) -> None:
    """A running group finished and went to the replay queue."""
    self._finish(accepted=True)

  def on_reject(self) -> None:
    """A running group was filtered out or failed: its slot is freed, nothing is counted."""
    self._finish(accepted=False)

  def _finish(self, *, accepted: bool) -> None:
    with self._lock:
      if self._running <= 0:
        raise RuntimeError("on_accept/on_reject without a running group")
      self._running -= 1
      if accepted:
        self._accepted += 1
      else:
        self._rejected += 1
      self._notify_locked()

  def on_discard(self) -> None:
    """An accepted group was dropped unused (e.g. the replay queue's staleness limit): it no
    longer counts as accepted, so its budget is given back like a rejection."""
    with self._lock:
      if self._accepted <= 0:
        raise RuntimeError("on_discard without an accepted group")
      self._accepted -= 1
      self._rejected += 1
      self._notify_locked()

  def set_version(self, version: int) -> None:
    """The new policy version (that of the weights the engine now samples with)."""
    with self._lock:
      if version < self._version:
        raise ValueError(f"version went backwards: {self._version} -> {version}")
      self._move_version_locked(version)
      self._notify_locked()

  def _move_version_locked(self, version: int) -> None:
    """The one place the version changes (lock held): a published update, or a restore (which
    may move it back)."""
    self._version = int(version)

  def restore(self, *, version: int, queued: int = 0) -> None:
    """After restoring a checkpoint at `version`: accepted = version * B (+ `queued`), nothing
    running, so the budget is (eta + 1) * B again instead of bursting (AReaL's
    on_version_recovered). AReaL regenerates buffered groups; we keep them, so pass the replay
    queue's surviving groups (pending + leased) as `queued` -- they are accepted and not yet
    trained -- and re-count resumed in-flight groups with `on_start`."""
    if queued < 0:
      raise ValueError(f"queued must be >= 0, got {queued}")
    with self._lock:
      self._move_version_locked(version)
      self._accepted = version * self.config.batch_groups + queued
      self._running = 0
      self._notify_locked()

  # --- waiting (always with a timeout) -------------------------------------------------------

  def wait_start(self, timeout: float) -> bool:
    """Blocks (thread) until a group may start and counts it; False after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    with self._cond:
      while self._capacity_locked() <= 0:
        left = deadline - time.monotonic()
        if left <= 0:
          return False
        self._cond.wait(left)
      self._running += 1
      return True

  async def astart(self, timeout: float) -> bool:
    """Awaits (without blocking the loop) until a group may start and counts it; False after
    `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
      event = asyncio.Event()
      with self._lock:
        if self._capacity_locked() > 0:
          self._running += 1
          return True
        self._async_waiters.append((loop, event))
      left = deadline - loop.time()
      try:
        if left <= 0:
          return False
        await asyncio.wait_for(event.wait(), left)
      except TimeoutError:
        return False
      finally:
        with self._lock:
          self._async_waiters = [(lp, ev) for lp, ev in self._async_waiters if ev is not event]

  def _notify_locked(self) -> None:
    self._cond.notify_all()
    for loop, event in self._async_waiters:
      if not loop.is_closed():
        loop.call_soon_threadsafe(event.set)

  # --- introspection and checkpoints ---------------------------------------------------------

  @property
  def version(self) -> int:
    with self._lock:
      return self._version

  def stats(self) -> dict[str, int]:
    with self._lock:
      return {
        "version": self._version,
        "running": self._running,
        "accepted": self._accepted,
        "rejected": self._rejected,
        "capacity": self._capacity_locked(),
      }

  def state_dict(self) -> dict[str, Any]:
    """JSON-able counters for a checkpoint item. `running` is saved for inspection only: the
    episodes it counts are either resumed by the controller (which re-counts them with
    `on_start`) or lost, so `load_state_dict` starts with nothing running."""
    with self._lock:
      return {
        "version": self._version,
        "accepted": self._accepted,
        "rejected": self._rejected,
        "running": self._running,
        "batch_groups": self.config.batch_groups,
        "max_staleness": self.config.max_staleness,
      }

  def load_state_dict(self, state: dict[str, Any]) -> None:
    if int(state["batch_groups"]) != self.config.batch_groups:
      raise ValueError(
        f"checkpoint has batch_groups={state['batch_groups']}, config has "
        f"{self.config.batch_groups}: the accepted counter would mean something else"
      )
    with self._lock:
      self._move_version_locked(int(state["version"]))
      self._accepted = int(state["accepted"])
      self._rejected = int(state["rejected"])
      self._running = 0
      self._notify_locked()
