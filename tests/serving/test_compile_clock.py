"""The engine thread's compile seconds (`serving/compile_clock.py`): a benchmark that compiles
lazily subtracts them from the engine's busy time, so they must count that thread's compiles,
once each, and nothing else."""

from __future__ import annotations

import collections
import threading

import jax
import jax.numpy as jnp
import pytest

from asearcher_jax.serving import compile_clock
from tests.serving.conftest import tiny_model
from tests.serving.test_prefix_cache import PROMPT, gen


def _call_twice_in_a_thread(fn, *args) -> tuple[int, float, float]:
  """Calls fn(*args) twice on a new thread; returns the thread's ident and its compile seconds
  after each call."""
  out: list[float] = []

  def body():
    compile_clock.begin_thread()  # a reused ident must not inherit a dead thread's spans
    for _ in range(2):
      jax.block_until_ready(fn(*args))
      out.append(compile_clock.compile_seconds())
    out.append(threading.get_ident())

  t = threading.Thread(target=body)
  t.start()
  t.join(60)
  return int(out[2]), out[0], out[1]


def test_a_threads_compiles_count_for_it_alone_and_a_cached_call_adds_nothing():
  compile_clock.install()
  compile_clock.install()  # idempotent: a second listener would count every span twice

  @jax.jit
  def f(x):  # a new function: its first call traces, lowers and compiles
    return jnp.sin(x) @ jnp.cos(x).T + jax.jit(jnp.tanh)(x)  # a jit nested in the trace

  x = jax.block_until_ready(jnp.ones((16, 16)))  # may compile here, on this thread
  mine = compile_clock.compile_seconds()
  ident, first, second = _call_twice_in_a_thread(f, x)
  assert first > 0
  assert second == first  # the second call hit the cache
  assert compile_clock.compile_seconds(ident) == first
  assert compile_clock.compile_seconds() == mine  # this thread compiled nothing meanwhile


def test_begin_thread_drops_what_an_ended_thread_with_the_same_ident_left():
  # Idents of ended threads are reused: the driver's thread must not inherit a dead one's count
  # (a CI run of 2026-11-26 read 10.8 s of compiles against 1.3 s of busy engine time).
  seen: list[float] = []

  def body():
    compile_clock.begin_thread()
    compile_clock._on_span("/jax/core/compile/backend_compile_duration", 10.0, 12.5)
    seen.append(compile_clock.compile_seconds())  # as this ident's thread leaves it
    compile_clock.begin_thread()
    seen.append(compile_clock.compile_seconds())

  t = threading.Thread(target=body)
  t.start()
  t.join(60)
  assert seen == [2.5, 0.0]


def test_nested_spans_count_once():
  # Spans arrive as they end: the nested ones first, then the span around them.
  spans = compile_clock._ThreadSpans()
  for start, end in [(1.0, 1.5), (1.2, 2.0), (0.0, 3.0), (3.5, 4.0), (5.0, 6.0), (4.8, 6.5)]:
    spans.add(start, end)
  assert spans.merged == [(0.0, 3.0), (3.5, 4.0), (4.8, 6.5)]
  assert spans.total == 3.0 + 0.5 + 1.7


def test_a_stopwatch_counts_only_the_compiles_inside_its_block():
  # Busy seconds net of compiles subtract what fell inside the timed blocks, never a compile
  # between them (a CI run of 2026-12-03 read busy net of compiles as -0.066 s).
  def body():
    compile_clock.begin_thread()
    compile_clock._on_span("/jax/core/compile/backend_compile_duration", 1.0, 3.0)  # outside
    metrics = collections.Counter()
    watch = compile_clock.Stopwatch()
    compile_clock._on_span("/jax/core/compile/backend_compile_duration", 4.0, 4.001)  # inside
    wall = watch.stop(metrics, "prefill_s", "suffix_prefill_s")
    seen.append((metrics, wall))

  seen: list = []
  t = threading.Thread(target=body)
  t.start()
  t.join(60)
  metrics, wall = seen[0]
  assert metrics["prefill_s"] == metrics["suffix_prefill_s"] == wall > 0
  # the inside span, capped at the block's wall time (a fake span may be longer than the block)
  assert metrics["compile_s"] == pytest.approx(min(0.001, wall))


async def test_the_drivers_compile_seconds_are_part_of_its_busy_seconds(make_driver):
  # A context length no other test uses: its decode state's shapes are new, so the engine compiles.
  driver = make_driver(tiny_model(seed=11), slots=2, max_seq_len=88, prefix_reuse=False)
  await gen(driver, PROMPT, 6)
  s = driver.stats()
  busy = s["prefill_s"] + s["decode_s"] + s["update_s"]
  assert 0 < s["compile_s"] <= busy
  await gen(driver, PROMPT, 6)  # the same shapes again: no new compile
  assert driver.stats()["compile_s"] == s["compile_s"]
  assert driver.stats()["decode_s"] > s["decode_s"]
