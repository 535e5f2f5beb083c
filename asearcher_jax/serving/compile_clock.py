"""Seconds JAX spent compiling, per thread.

The engine thread's busy time (prefill, update and decode seconds) includes the compiles that a
new shape triggers inside those calls. Warming every shape up front keeps them out, but on an
accelerator an 80-slot engine's full warm-up takes longer than a short device lease; counting
the compile time instead lets a benchmark compile lazily and still report the busy time of the
work itself (busy minus compile). JAX reports each tracing, lowering and backend compile as a
time span (`jax.monitoring`); spans nest (a jit traced inside another's trace), so a thread's
total is the length of the union of its spans, not their sum.
"""

import threading

import jax

# The phases of a jit's first call for a new shape (jax._src.dispatch's event names).
COMPILE_EVENTS = frozenset(
  {
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
  }
)

_lock = threading.Lock()
_spans: dict[int, list[tuple[float, float]]] = {}
_installed = False


def _on_span(event: str, start: float, end: float, **_: object) -> None:
  if event in COMPILE_EVENTS:
    ident = threading.get_ident()
    with _lock:
      spans = _spans.setdefault(ident, [])
      spans.append((start, end))
      if len(spans) > 512:  # a long run's recompiles: keep the union, not every span
        _spans[ident] = _union(spans)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
  merged: list[tuple[float, float]] = []
  for start, end in sorted(spans):
    if merged and start <= merged[-1][1]:
      merged[-1] = (merged[-1][0], max(merged[-1][1], end))
    else:
      merged.append((start, end))
  return merged


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
    spans = list(_spans.get(ident, ()))
  return sum(end - start for start, end in _union(spans))
