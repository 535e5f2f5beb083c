"""Seconds JAX spent compiling, per thread.

The engine thread's busy time (prefill, update and decode seconds) includes the compiles that a
new shape triggers inside those calls. Warming every shape up front keeps them out, but on an
accelerator an 80-slot engine's full warm-up takes longer than a short device lease; counting
the compile time instead lets a benchmark compile lazily and still report the busy time of the
work itself (busy minus compile). JAX reports each tracing, lowering and backend compile as a
time span (`jax.monitoring`); spans nest (a jit traced inside another's trace), so a thread's
total is the length of the union of its spans, not their sum.
"""

import collections
import threading
import time

import jax

# The phases of a jit's first call for a new shape (jax._src.dispatch's event names).
COMPILE_EVENTS = frozenset(
  {
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
  }
)
# Merged spans kept per thread: a span is reported when it ends, so a new one overlaps only the
# latest few (the spans nested in it); older ones are folded into the total.
_KEEP_SPANS = 64


class _ThreadSpans:
  """One thread's compile spans as their union: disjoint spans in order and their total length,
  updated per span in amortized constant time (read on every timed engine call)."""

  def __init__(self) -> None:
    self.merged: list[tuple[float, float]] = []
    self.total = 0.0

  def add(self, start: float, end: float) -> None:
    merged = self.merged
    while merged and merged[-1][1] >= start:  # overlaps the latest spans: merge them in
      s, e = merged.pop()
      self.total -= e - s
      start, end = min(start, s), max(end, e)
    merged.append((start, end))
    self.total += end - start
    if len(merged) > 2 * _KEEP_SPANS:
      del merged[:-_KEEP_SPANS]


_lock = threading.Lock()
_spans: dict[int, _ThreadSpans] = {}
_installed = False


def _on_span(event: str, start: float, end: float, **_: object) -> None:
  if event in COMPILE_EVENTS:
    ident = threading.get_ident()
    with _lock:
      spans = _spans.get(ident)
      if spans is None:
        spans = _spans[ident] = _ThreadSpans()
      spans.add(start, end)


def install() -> None:
  """Starts recording (idempotent; one listener per process)."""
  global _installed
  with _lock:
    if _installed:
      return
    _installed = True
  jax.monitoring.register_event_time_span_listener(_on_span)


def begin_thread() -> None:
  """Starts the calling thread's count at zero. Call it first thing in a thread whose compiles
  are read: thread idents are reused once a thread ends, so a new thread would otherwise inherit
  a dead one's spans."""
  with _lock:
    _spans.pop(threading.get_ident(), None)


def compile_seconds(thread_ident: int | None = None) -> float:
  """Wall seconds the thread (default: the calling one) has spent tracing, lowering and
  compiling since `install()` or its `begin_thread()`, overlapping spans counted once."""
  ident = threading.get_ident() if thread_ident is None else thread_ident
  with _lock:
    spans = _spans.get(ident)
    return 0.0 if spans is None else spans.total


class Stopwatch:
  """Times a block of engine work on the calling thread, and the compiles inside it.

  A thread's compiles outside its timed blocks (a small eager op between calls, a state built
  afresh) are not part of any busy figure, so "busy net of compiles" subtracts only the compile
  seconds that fell inside the blocks: it can never come out below zero."""

  def __init__(self) -> None:
    self._t0 = time.perf_counter()
    self._c0 = compile_seconds()

  def stop(self, metrics: collections.Counter, *keys: str) -> float:
    """Adds the block's wall seconds to each of `keys` and its compile seconds to
    "compile_s" in `metrics`; returns the wall seconds."""
    wall = time.perf_counter() - self._t0
    for key in keys:
      metrics[key] += wall
    metrics["compile_s"] += min(compile_seconds() - self._c0, wall)
    return wall
