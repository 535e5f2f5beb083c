"""A discrete-event model of asynchronous vs synchronous agent RL: how fast the trainer is fed.

The system it models is the one `rl/trainer.py` runs and benchmarks/async_vs_sync.py measures:
  episodes  K searches (log-normal, clipped) then an answer: 2K + 1 LLM calls, each
            `call_overhead_s` + output tokens (log-normal) x `decode_token_s`, and K tool calls
            of log-normal latency. A group of n episodes finishes with its slowest episode.
  staleness AReaL's admission rule: at version v at most (v + eta + 1) x B groups admitted in
            total, and at most `max_concurrent` in flight; a group admitted at version v and
            taken after version v + eta is discarded and its admission given back (the replay
            queue's hard bound).
  trainer   takes B finished groups in completion order and trains `train_step_s`; the version
            then advances (synchronous RL: eta = 0 and max_concurrent = B, so generation and
            training alternate).
Within one run the rates are fixed: apps/plan.py sets them for the number of episodes each mode
keeps in flight (rl/plan_memory.serving_rates: the live capacity of the page budget, decode
steps bound by weights plus KV reads), so what the simulation adds is the pipeline: the long-tail barrier that sync mode waits on every step
and the Little's-law bound on async mode -- at most (eta + 1) x B groups in flight, each taking
the mean group latency L, feed B groups per (eta + 1) x T only while L < (eta + 1) x T.
"""

from __future__ import annotations

import dataclasses
import heapq
import statistics

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogNormal:
  """A log-normal draw rounded (integers) or not, clipped to [low, high]."""

  # The median (exp of the underlying normal's mean) and that normal's standard deviation.
  median: float
  sigma: float
  # Draws are clipped to [low, high].
  low: float
  high: float

  def mean(self) -> float:
    """The clipped draw's mean, over evenly spaced quantiles (deterministic: the planner's rates
    depend on it)."""
    q = (np.arange(4096) + 0.5) / 4096
    z = np.vectorize(statistics.NormalDist().inv_cdf)(q)
    return float(np.mean(np.clip(self.median * np.exp(self.sigma * z), self.low, self.high)))

  def draw(self, rng: np.random.Generator, n: int | None = None) -> np.ndarray:
    x = self.median * np.exp(self.sigma * rng.standard_normal(n))
    return np.clip(x, self.low, self.high)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
  """The agent workload and the two rates; defaults: benchmarks/async_vs_sync.py's workload."""

  # Searches per episode (rounded), output tokens per LLM call (rounded), tool latency (s).
  searches: LogNormal = LogNormal(median=3.0, sigma=0.9, low=1, high=12)
  output_tokens: LogNormal = LogNormal(median=12.0, sigma=0.6, low=4, high=32)
  tool_s: LogNormal = LogNormal(median=1.0, sigma=0.7, low=0.05, high=8.0)
  # Seconds per generated token of one episode's call (decode step time), and per call (prefill,
  # scheduling, the HTTP hop).
  decode_token_s: float = 0.01
  call_overhead_s: float = 0.0
  # Seconds per training step (B groups x n episodes).
  train_step_s: float = 2.5


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
  """B, n, eta and the in-flight cap of one mode."""

  # B (groups per training step), n (episodes per group) and eta (the staleness bound).
  batch_groups: int = 4
  group_size: int = 4
  eta: int = 4
  # Groups in flight at most; None: (eta + 1) x B, the most the staleness rule admits.
  max_concurrent: int | None = None


def group_s(w: Workload, rng: np.random.Generator, n: int) -> float:
  """Seconds until the slowest of a group's n episodes ends. All draws of the group are made at
  once (the planner simulates millions of episodes for a pod-sized batch)."""
  k = np.rint(w.searches.draw(rng, n)).astype(np.int64)
  calls = 2 * k + 1
  tokens = np.rint(w.output_tokens.draw(rng, int(calls.sum())))
  tool = w.tool_s.draw(rng, int(k.sum()))
  episode = np.arange(n)
  tokens_per = np.bincount(np.repeat(episode, calls), weights=tokens, minlength=n)
  tool_per = np.bincount(np.repeat(episode, k), weights=tool, minlength=n)
  return float(np.max(calls * w.call_overhead_s + tokens_per * w.decode_token_s + tool_per))


def simulate(w: Workload, s: Schedule, *, steps: int = 10, seed: int = 0) -> dict[str, float]:
  """Runs `steps` training steps from an empty pipeline; wall time, trainer idle fraction and
  mean group latency (admission to completion)."""
  rng = np.random.default_rng(seed)
  cap = s.max_concurrent or (s.eta + 1) * s.batch_groups
  t, version, admitted, in_flight = 0.0, 0, 0, 0
  done: list[tuple[float, int, int]] = []  # (finish time, admit version, id) heap
  events: list[tuple[float, int, int]] = []
  latencies, idle, uid = [], 0.0, 0

  def admit(now: float) -> None:
    nonlocal admitted, in_flight, uid
    while in_flight < cap and admitted < (version + s.eta + 1) * s.batch_groups:
      dur = group_s(w, rng, s.group_size)
      heapq.heappush(events, (now + dur, version, uid))
      latencies.append(dur)
      admitted, in_flight, uid = admitted + 1, in_flight + 1, uid + 1

  admit(t)
  for _ in range(steps):
    batch: list[tuple[float, int, int]] = []
    wait_from = t
    while len(batch) < s.batch_groups:
      while done and len(batch) < s.batch_groups:
        g = heapq.heappop(done)
        if g[1] < version - s.eta:  # too stale: discarded, its admission given back
          admitted -= 1
          admit(t)
          continue
        batch.append(g)
      if len(batch) < s.batch_groups:
        finish, v, i = heapq.heappop(events)
        t = max(t, finish)
        in_flight -= 1
        heapq.heappush(done, (finish, v, i))
        admit(t)
    idle += t - wait_from
    # Training: groups keep finishing (and admissions follow) while the step runs.
    end = t + w.train_step_s
    while events and events[0][0] <= end:
      finish, v, i = heapq.heappop(events)
      in_flight -= 1
      heapq.heappush(done, (finish, v, i))
      admit(finish)
    t, version = end, version + 1
    admit(t)
  return {
    "wall_s": t,
    "trainer_idle_frac": idle / t,
    "group_s_mean": float(np.mean(latencies)),
    "capacity_ratio": (s.eta + 1) * w.train_step_s / float(np.mean(latencies)),
  }


def async_vs_sync(
  w: Workload,
  s: Schedule,
  *,
  steps: int = 10,
  seeds: int = 20,
  sync_workload: Workload | None = None,
) -> dict:
  """Both modes on the same workload (sync: eta = 0, max_concurrent = B), averaged over
  `seeds` runs; speedup = sync wall / async wall (same steps, same batch). sync_workload: the
  sync run's own rates (fewer episodes in flight decode faster); None: `w`'s."""
  sync_s = dataclasses.replace(s, eta=0, max_concurrent=s.batch_groups)
  modes = (("sync", sync_workload or w, sync_s), ("async", w, s))
  runs = {
    name: [simulate(wl, sched, steps=steps, seed=i) for i in range(seeds)]
    for name, wl, sched in modes
  }
  mean = {n: {k: float(np.mean([r[k] for r in rs])) for k in rs[0]} for n, rs in runs.items()}
  return {
    "speedup": mean["sync"]["wall_s"] / mean["async"]["wall_s"],
    "sync": mean["sync"],
    "async": mean["async"],
  }
