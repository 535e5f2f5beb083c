"""The driver's bookkeeping for generate calls in flight: what to dispatch next, and reading back.

The driver runs one call ahead (driver.py): call t+1 is dispatched before call t's tokens are read
back, so the lengths and token budgets of call t+1 count the tokens call t produces for each slot.
A call is one decode step (`Engine.generate`) or, with `EngineConfig.decode_steps_per_call` > 1,
several (`Engine.generate_chunk`), whose stops and budgets apply on the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from asearcher_jax.serving import engine_steps as steps
from asearcher_jax.serving.jetstream import engine_api
from asearcher_jax.serving.request import Request


@dataclasses.dataclass
class InFlight:
  """A dispatched generate call whose tokens have not been read back yet."""

  # Device arrays; reading them waits for the call: a one-step ResultTokens, or the multi-step
  # [steps, rows, columns] array (`Engine.generate_chunk`) whose row i is slot rows[i].
  result: engine_api.ResultTokens | jax.Array
  owners: list[Request | None]  # the request in each slot when the call was dispatched
  emits: dict[int, int]  # slot -> most tokens the call produces for its owner
  rows: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class CallPlan:
  """The next call: its live slots, their lengths after their first step, budgets, steps."""

  live: list[tuple[int, Request]]
  length: dict[int, int]  # slot -> its length after the call's first step
  budget: dict[int, int]  # slot -> most tokens it may still emit (its request's max_new_tokens)
  steps: int  # steps the call runs (at most decode_steps_per_call)

  @property
  def max_length(self) -> int:
    """An upper bound on every live slot's length after its last step in the call (a slot
    steps at least once: with one step per call, a slot whose budget the call in flight
    exhausts still steps, and its write must stay inside the window)."""
    return max(self.length[s] + min(self.steps, max(self.budget[s], 1)) - 1 for s, _ in self.live)

  def emits(self, multi: bool) -> dict[int, int]:
    return {s: min(self.steps, self.budget[s]) if multi else 1 for s, _ in self.live}


def plan_call(
  slots: Sequence[Request | None], previous: InFlight | None, k: int, *, waiting: bool = False
) -> CallPlan:
  """What to dispatch for the requests in `slots` while `previous` is still in flight. With k > 1
  slots whose budget the call in flight exhausts sit out (that call ends their requests), and the
  call runs min(k, largest budget) steps; when requests are `waiting` for a slot, min(k, smallest
  budget), or one step while some slot does not decode (free, parked, or ended by the call in
  flight), so that admissions are not held back by a long call; with k == 1 every request's slot
  steps, as it always has (its extra token is dropped)."""

  def ahead(slot: int, r: Request) -> int:  # its tokens the call in flight produces
    mine = previous is not None and previous.owners[slot] is r
    return previous.emits.get(slot, 0) if mine else 0

  live = [(slot, r) for slot, r in enumerate(slots) if r is not None]
  budget = {s: r.max_new_tokens - len(r.tokens) - ahead(s, r) for s, r in live}
  if k > 1:
    live = [(s, r) for s, r in live if budget[s] > 0]
  # Each live slot feeds its pending token at position len(prompt) + len(tokens) - 1, where tokens
  # include those the call in flight (not yet read back) produces for it.
  length = {s: len(r.prompt) + len(r.tokens) + ahead(s, r) for s, r in live}
  budgets = [budget[s] for s, _ in live] or [0]
  n = min(k, min(budgets) if waiting else max(budgets)) if k > 1 else 1
  if waiting and len(live) < len(slots):  # a slot is free or about to be: refill it next call
    n = min(n, 1)
  return CallPlan(live=live, length=length, budget=budget, steps=n)


def read_back(call: InFlight) -> tuple[np.ndarray, Sequence[int], np.ndarray, list]:
  """Waits for a call and copies its tokens to the host: (data [steps, rows, columns], the slot
  of each row, logprobs [steps, rows], per step its top alternatives or None)."""
  multi = call.rows is not None
  data = np.asarray(call.result if multi else call.result.data)
  rows = call.rows if multi else range(data.shape[0])
  data = data if multi else data[None]
  logprobs = data[..., steps.LOGPROB].astype(np.int32).view(np.float32)
  return data, rows, logprobs, [steps.result_top(d) for d in data]
