"""The RL driver: continuous batching over the Engine, with weight swaps, aborts and versions.

JetStream's orchestrator cannot swap weights, abort, or report logprobs and versions, and kills
the process on any thread error; RL needs all of that. One engine thread owns the decode state
and runs short phases in a loop:

  apply a pending weight update (swap, then re-prefill every in-flight slot with prompt + tokens
  so far, so decoding continues under the new weights) -> free aborted/cancelled slots -> admit
  queued requests into free slots (bucketed prefill + insert) -> dispatch generate step t+1 ->
  read back step t's tokens and hand finished requests back to their asyncio loops.

The loop runs one step ahead: step t+1 is dispatched (JAX dispatch is asynchronous) before step
t's tokens are read back, so the device computes t+1 while this thread does t's bookkeeping, the
next admissions and the next dispatch. A request that stops at step t has one more token computed
for it at t+1; that token is never recorded (each step remembers which request owned each slot
when it was dispatched, and a slot's token counts only if the same request still owns it), so
results are exactly those of a lock-step loop. A weight update first drains the step in flight,
so re-prefill sees every token produced under the old weights. With
`EngineConfig.decode_steps_per_call` = k > 1 a "step" is one call of up to k decode steps, with
stop ids and budgets applied on the device (decode_calls.py); updates, aborts and admissions
land between calls, up to k tokens later.

Admission and every kind of prefill (whole, batched, in pieces, suffix) live in admission.py, an
`Admission` the driver owns and calls between decode calls; the two share one `SlotTable` (the
decode state and who holds each slot). Prefix reuse (an agent's next turn prefills only its new
suffix: prefix_cache.py), what a weight update does to keys/values ("recompute" as AReaL, or
"keep" as PipelineRL, exact logprobs either way) and the prefill knobs are described with their
settings in `DriverConfig`.

Callers use `await driver.generate(...)` from any event loop; thousands of requests queue for the
slots. An exception fails the requests it touched, with the reason, and the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future

import jax
from flax import nnx

from asearcher_jax.serving import compile_clock
from asearcher_jax.serving import engine_steps as steps
from asearcher_jax.serving.admission import Admission, AdmissionHooks, SlotTable
from asearcher_jax.serving.decode_calls import InFlight, plan_call, read_back
from asearcher_jax.serving.engine import Engine
from asearcher_jax.serving.paged_admission import PagedAdmission
from asearcher_jax.serving.pages import SlotPages
from asearcher_jax.serving.prefix_cache import PrefixCache
from asearcher_jax.serving.request import Request
from asearcher_jax.serving.sampling import mode_for
from asearcher_jax.serving.types import EngineError, GenerationResult, SamplingParams, StopReason
from asearcher_jax.serving.weight_update import PendingUpdate

log = logging.getLogger(__name__)


KV_ON_UPDATE = ("recompute", "keep")
# The `Driver.stats()` keys that count up over a run (seconds, calls, tokens), which a trainer
# logs every step: engine-thread time of admissions' prefills, weight updates (with their
# re-prefills under kv_on_update="recompute") and decode steps; the part of prefill that went into
# parked slots (suffix prefills); the prefix tokens reuse saved, and turns admitted with none;
# the part of those seconds spent compiling new shapes.
CUMULATIVE_STATS = (
  "compile_s", "prefill_s", "update_s", "decode_s", "reprefill_tokens", "prefill_tokens",
  "suffix_prefill_s", "suffix_prefill_calls", "prefill_calls", "prefix_hits",
  "prefix_tokens_reused", "prefix_evictions", "decode_continuations", "preemptions",
)  # fmt: skip


YIELD_TO_LEARNER = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DriverConfig:
  """Attributes:
  request_timeout_s: longest a generate call may wait in total (queue + decoding); the request
    is aborted and TimeoutError raised after it.
  idle_wait_s: how long the engine thread sleeps when there is nothing to do (it is woken
    early by new requests, aborts and weight updates).
  max_admit_per_step: prefills between two decode steps, so a burst of new requests cannot
    stall in-flight decoding for long.
  prefix_reuse: keep a finished request's slot "parked" with its keys/values (prompt + tokens
    but the last) and admit a later request whose prompt starts with exactly that sequence (an
    agent's next turn) into it by prefilling only the new suffix. Parked slots are reclaimed
    least recently used first when no free slot is left, and dropped on a weight update
    (unless kv_on_update="keep"). With a paged engine the slot is freed and its full pages are
    cached instead, mapped by any later request that starts with them (paged_admission.py).
  kv_on_update: what a weight update does to keys/values computed by the old weights.
    "recompute" (AReaL): re-prefill every in-flight slot under the new weights and forget the
    parked prefixes, so every later token is sampled from exactly the new policy. "keep"
    (PipelineRL, prime-rl): leave them; later tokens come from the new weights over the older
    cache, with exact logprobs of that (the decoupled loss corrects for it), and no prefill.
  batch_reprefill: under "recompute", re-prefill the in-flight slots grouped by prefill bucket in
    chunks of 8/4/2/1 (the admission shapes, compiled by warm-up) instead of one call per slot
    (False, as before 2026-11-26). The same keys/values either way.
  prefill_chunk: a fresh prompt longer than this is prefilled in pieces of this many tokens (an
    engine extend bucket), one piece per loop iteration with a decode call of the live slots
    between pieces, so decoding never waits behind more than one piece (chunked prefill); the
    first token is sampled from the last piece exactly as from a whole prefill. 0: every prompt
    in one call (as before 2026-11-26).
  continue_in_decode: a turn that continues its parked slot's last call with nothing new (its
    prompt is the cached tokens plus the one token that call sampled) is admitted with no
    prefill: the slot goes live and the next decode step feeds that token and samples the first
    new one, with the same key and position a 1-token suffix prefill would use. False: a suffix
    prefill of that one token (as before 2026-11-26).
  thread_nice: the engine thread's niceness on Linux (0-19; a thread's own, not the process's).
    Above 0 a learner colocated in the same process gets the cores first whenever both compute,
    so its step is not stretched by decoding beside it (CPU, `asearcher train` in one process);
    0 leaves the thread as it is (accelerators: the thread only dispatches). Ignored elsewhere.
  yield_to_learner: whether the engine thread pauses between its calls while a learner in the
    same process steps (`Driver.learner_step()`, which the trainer holds around each step).
    "auto": when the engine computes on CPU devices, where it and the learner share the host's
    cores and each would stretch the other's steps (measured: the async learner step at 1.5x
    its time alone); "on", "off" force it. On accelerators the two run on separate devices and
    the thread only dispatches, so "auto" is off there. Default "off": on 2 CPU cores a full
    pause kept the learner at its own speed (0.93x) but cut the async speedup from 3.49x to
    2.50x, generation falling behind (docs/measurements.md, 2026-12-02).
  yield_max_s: longest one pause lasts (a learner step that hangs cannot stall serving).
  yield_share: while the learner steps, the share of the time the engine thread may still
    compute: after a loop iteration of d seconds it waits d * (1 - share) / share (or until the
    step ends). 0 pauses it for the whole step; a share lets generation keep up where both
    programs share a CPU's cores (XLA scales poorly from one core to two, so running both side
    by side does more work per second than taking turns).
  """

  request_timeout_s: float = 3600.0
  idle_wait_s: float = 0.05
  max_admit_per_step: int = 8
  prefix_reuse: bool = True
  kv_on_update: str = "recompute"
  batch_reprefill: bool = True
  prefill_chunk: int = 0
  continue_in_decode: bool = True
  thread_nice: int = 0
  yield_to_learner: str = "off"
  yield_max_s: float = 60.0
  yield_share: float = 0.0

  def __post_init__(self):
    if not 0.0 <= self.yield_share < 1.0:
      raise ValueError(f"DriverConfig.yield_share must be in [0, 1), got {self.yield_share}")
    if self.yield_to_learner not in YIELD_TO_LEARNER:
      raise ValueError(
        f"DriverConfig.yield_to_learner must be one of {YIELD_TO_LEARNER}, "
        f"got {self.yield_to_learner!r}"
      )
    if not 0 <= self.thread_nice <= 19:
      raise ValueError(f"DriverConfig.thread_nice must be in [0, 19], got {self.thread_nice}")
    if self.kv_on_update not in KV_ON_UPDATE:
      raise ValueError(f"kv_on_update must be one of {KV_ON_UPDATE}, got {self.kv_on_update!r}")


class Driver:
  """Serves `generate` requests through the engine's slots on a dedicated thread."""

  def __init__(self, engine: Engine, cfg: DriverConfig = DriverConfig()):
    self.engine = engine
    self.cfg = cfg
    self._params = engine.load_params()
    self._version = int(self._params.version)
    state = engine.init_decode_state()
    slots: list[Request | None] = [None] * engine.max_concurrent_decodes
    if cfg.prefill_chunk and cfg.prefill_chunk not in engine.cfg.extend_buckets:
      raise ValueError(
        f"DriverConfig.prefill_chunk={cfg.prefill_chunk} must be one of the engine's extend "
        f"buckets {engine.cfg.extend_buckets} (EngineConfig.suffix_buckets / prefill_buckets)"
      )
    # Decode state, live, parked and half-prefilled slots: engine thread only.
    paged = engine.paged
    self._table = SlotTable(
      state=state, slots=slots, prefixes=PrefixCache(enabled=cfg.prefix_reuse and not paged),
      pages=self._new_pages() if paged else None,
    )  # fmt: skip
    self._in_flight: InFlight | None = None  # engine thread only
    self._lock = threading.Lock()  # guards _queue, _by_id
    self._queue: collections.deque[Request] = collections.deque()
    self._by_id: dict[str, Request] = {}
    self._update = PendingUpdate()  # the next weight update (any thread -> engine thread)
    self._wake = threading.Event()
    self._learner_idle = threading.Event()  # cleared while a colocated learner steps
    self._learner_idle.set()
    self._last_iteration_s = 0.0  # engine thread only: the last loop iteration's busy seconds
    self.yields = self._resolve_yield(cfg.yield_to_learner)
    self._stopping = False
    self._ids = itertools.count()
    self.metrics = collections.Counter()
    hooks = AdmissionHooks(
      take=self._take, record=self._append, finish=self._finish, fail_active=self._fail_active,
      requeue=self._requeue,
    )  # fmt: skip
    self._admission = (PagedAdmission if paged else Admission)(
      engine, self._table, self.metrics, hooks, max_admit=cfg.max_admit_per_step,
      prefill_chunk=cfg.prefill_chunk, continue_in_decode=cfg.continue_in_decode,
    )  # fmt: skip
    compile_clock.install()
    self._thread_began = threading.Event()
    self._thread = threading.Thread(target=self._run, name="engine-driver", daemon=True)
    self._thread.start()
    self._thread_began.wait(10.0)  # its compile count starts at zero before stats() can read it

  def _new_pages(self) -> SlotPages:
    ec = self.engine.cfg
    return SlotPages(
      slots=ec.max_slots, num_pages=ec.pool_pages, page_size=ec.page_size,
      pages_per_seq=ec.pages_per_seq, reuse=self.cfg.prefix_reuse,
    )  # fmt: skip

  # --- public API (any thread / any event loop) -----------------------------------------------

  @contextlib.contextmanager
  def learner_step(self) -> Iterator[None]:
    """Held by the trainer around each learner step: the engine thread pauses between its
    calls meanwhile when `self.yields` (DriverConfig.yield_to_learner); a no-op otherwise."""
    if not self.yields:
      yield
      return
    self._learner_idle.clear()
    try:
      yield
    finally:
      self._learner_idle.set()

  def _resolve_yield(self, setting: str) -> bool:
    if setting != "auto":
      return setting == "on"
    leaf = jax.tree.leaves(self._params)[0]
    return all(d.platform == "cpu" for d in leaf.devices())

  @property
  def version(self) -> int:
    return self._version

  @property
  def _slots(self) -> list[Request | None]:
    # The request decoding in each slot (tests and benchmarks/prefill.py read it).
    return self._table.slots

  async def generate(
    self,
    token_ids: Sequence[int],
    sampling: SamplingParams = SamplingParams(),
    max_new_tokens: int = 256,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] | None = None,
    *,
    request_id: str | None = None,
    timeout: float | None = None,
  ) -> GenerationResult:
    """Continues `token_ids`; see GenerationClient. Raises ValueError for a prompt that does not
    fit, EngineError if the engine failed on it, TimeoutError after `timeout` seconds."""
    stop_ids = self.engine.tokenizer.stop_token_ids if stop_token_ids is None else stop_token_ids
    req = Request.create(
      request_id or f"req-{next(self._ids)}",
      token_ids,
      sampling,
      max_new_tokens,
      stop,
      stop_ids,
      max_seq_len=self.engine.cfg.max_seq_len,
    )
    with self._lock:
      if req.id in self._by_id:
        raise ValueError(f"request id {req.id!r} is already in flight")
      self._queue.append(req)
      self._by_id[req.id] = req
    self._wake.set()
    try:
      return await asyncio.wait_for(
        asyncio.shield(req.future), timeout or self.cfg.request_timeout_s
      )
    except (asyncio.CancelledError, TimeoutError):
      self.abort(req.id)  # frees the slot at the next step boundary
      raise

  def progress(self, request_id: str) -> tuple[list[int], list[float], list[int]] | None:
    """(tokens, logprobs, versions) a request in flight has generated so far, or None if it is
    unknown or finished. Read by checkpoints of in-flight episodes (`rl.inflight`), so the
    tokens already paid for survive a crash."""
    with self._lock:
      req = self._by_id.get(request_id)
    return None if req is None else req.progress()

  def abort(self, request_id: str) -> bool:
    """Aborts a request; it returns what it generated so far with stop_reason "abort"."""
    with self._lock:
      req = self._by_id.get(request_id)
      if req is None:
        return False
      req.aborted = True
    self._wake.set()
    return True

  def update_params(
    self, params: nnx.State, version: int, timeout: float = 600.0, *, recompute: bool | None = None
  ) -> float:
    """Swaps weights between two decode steps and (kv_on_update="recompute") re-prefills every
    in-flight slot; blocks until done and returns the time it took in ms (swap + re-prefill).
    recompute=True forces the recompute behaviour for this update whatever kv_on_update says
    (a reset to unrelated weights must not continue over the old keys/values)."""
    return self.submit_update(params, version, recompute=recompute).result(timeout)

  def submit_update(
    self, params: nnx.State, version: int, *, recompute: bool | None = None
  ) -> Future:
    """Non-blocking form of update_params (a later update replaces a pending one)."""
    if recompute is None:
      recompute = self.cfg.kv_on_update == "recompute"
    done = self._update.submit(params, version, recompute)
    self._wake.set()
    return done

  def stats(self) -> dict[str, float]:
    active = sum(r is not None for r in self._slots)
    with self._lock:
      queued = len(self._queue)
    decode_s = self.metrics["decode_s"] or 1e-9
    return {
      "slots": len(self._slots),
      "slots_active": active,
      "slot_occupancy": active / len(self._slots),
      "queue_depth": queued,
      "version": self._version,
      "tokens_generated": self.metrics["tokens"],
      "decode_tokens_per_s": self.metrics["decode_tokens"] / decode_s,
      # Engine-thread seconds spent tracing and compiling new shapes inside prefill_s,
      # update_s and decode_s (none once the engine is warmed up).
      "compile_s": self.metrics["compile_s"],
      "prefill_s": self.metrics["prefill_s"],
      # Prefill calls for admissions (fresh chunks and suffix chunks), not counting updates.
      "prefill_calls": self.metrics["prefill_calls"],
      # Pieces of long prompts prefilled in chunks (DriverConfig.prefill_chunk), and prompts in
      # the middle of theirs now.
      "prefill_pieces": self.metrics["prefill_pieces"],
      "slots_prefilling": len(self._table.prefilling),
      # The part of prefill_s / prefill_calls that were suffix prefills into parked slots.
      "suffix_prefill_s": self.metrics["suffix_prefill_s"],
      "suffix_prefill_calls": self.metrics["suffix_prefill_calls"],
      # Turns admitted with no prefill (DriverConfig.continue_in_decode), part of prefix_hits.
      "decode_continuations": self.metrics["decode_continuations"],
      "decode_s": self.metrics["decode_s"],
      "decode_steps": self.metrics["decode_steps"],
      # Slots computed per decode step (decode_rows: only enough for the live ones).
      "decode_rows_per_step": self.metrics["decode_rows"] / max(self.metrics["decode_steps"], 1),
      "last_update_ms": self.metrics["last_update_ms"],
      # Weight updates: their total engine-thread time (swap + re-prefills) and the tokens
      # re-prefilled ("recompute" only); not part of prefill_s / prefill_tokens.
      "updates": self.metrics["updates"],
      "update_s": self.metrics["update_s"],
      "reprefill_tokens": self.metrics["reprefill_tokens"],
      "requests_done": self.metrics["done"],
      "requests_failed": self.metrics["failed"],
      "requests_aborted": self.metrics["aborted"],
      "engine_errors": self.metrics["engine_errors"],
      "slots_parked": len(self._table.prefixes),
      "prefix_hits": self.metrics["prefix_hits"],
      "prefix_tokens_reused": self.metrics["prefix_tokens_reused"],
      "prefill_tokens": self.metrics["prefill_tokens"],
      "prefix_evictions": self.metrics["prefix_evictions"],
      "learner_yield_s": self.metrics["yield_s"],
      # Paged layout: sequences preempted when the page pool ran out (re-prefilled later), and
      # the pool's pages in use (mapped or cached), free, and cached by the block cache.
      "preemptions": self.metrics["preemptions"],
      **self._page_stats(),
    }

  def _page_stats(self) -> dict[str, int]:
    pages = self._table.pages
    if pages is None:
      return {}
    return {
      "pages_used": pages.allocator.used,
      "pages_free": pages.allocator.free_count,
      "pages_cached": len(pages.blocks),
    }

  def close(self, timeout: float = 30.0) -> None:
    self._stopping = True
    self._wake.set()
    self._thread.join(timeout)

  # --- engine thread ---------------------------------------------------------------------------

  def _run(self) -> None:
    compile_clock.begin_thread()
    if self.cfg.thread_nice and hasattr(os, "setpriority"):
      # PRIO_PROCESS with a thread id sets that thread's niceness alone (Linux).
      os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.cfg.thread_nice)
    self._thread_began.set()
    while not self._stopping:
      try:
        self._yield_to_learner()
        began = time.perf_counter()
        self._apply_update()
        self._reap_aborted()
        admitted = self._admission.admit(self._params)
        pieces = self._admission.prefill_piece(self._params)
        if self._in_flight is not None or any(r is not None for r in self._slots):
          self._step()
        elif not admitted and not pieces:
          self._wake.wait(self.cfg.idle_wait_s)
          self._wake.clear()
          continue
        self._last_iteration_s = time.perf_counter() - began  # what yield_share pays for
      except Exception as e:  # never let the thread die: fail what is in flight and go on
        log.exception("engine driver loop error")
        self.metrics["engine_errors"] += 1
        self._fail_active(EngineError(f"engine failure: {type(e).__name__}: {e}"))
    self._in_flight = None
    self._fail_active(EngineError("driver closed"))
    with self._lock:
      pending = list(self._queue)
      self._queue.clear()
    for req in pending:
      self._finish(req, error=EngineError("driver closed"))

  def _yield_to_learner(self) -> None:
    """Waits while a colocated learner steps (at most yield_max_s, and with a yield_share
    only an idle stretch matching the last iteration). The call in flight, if any, finishes
    meanwhile; nothing new is dispatched during the wait."""
    if self._learner_idle.is_set():
      return
    t0 = time.perf_counter()
    share = self.cfg.yield_share
    wait = self.cfg.yield_max_s
    if share > 0:  # a duty cycle: pay for the last iteration's compute with an idle stretch
      wait = min(wait, self._last_iteration_s * (1.0 - share) / share)
    self._learner_idle.wait(wait)
    self.metrics["yield_s"] += time.perf_counter() - t0
    self.metrics["yields"] += 1

  def _apply_update(self) -> None:
    update = self._update.take()
    if update is None:
      return
    keep = not update.recompute
    try:
      if not keep:
        self._drain()  # re-prefill must see the tokens of the step in flight (old weights)
      watch = compile_clock.Stopwatch()
      self._params = self.engine.versioned(update.params, update.version)
      self._version = update.version
      if not keep:
        table = self._table
        table.prefixes.clear()  # their keys/values come from the old weights
        # Pieces prefilled under the old weights are done again under the new ones.
        table.prefilling = {slot: (req, 0) for slot, (req, _) in table.prefilling.items()}
        live = [(slot, req) for slot, req in enumerate(table.slots) if req is not None]
        if table.pages is not None:
          table.pages.blocks.clear()
          self._admission.reprefill_live(self._params, live)
        elif self.cfg.batch_reprefill:
          self._admission.reprefill_many(self._params, live)
        else:
          for slot, req in live:
            self._admission.reprefill(self._params, slot, req)
      # The update's time is its work, not its dispatch: the next decode call would wait for it.
      jax.block_until_ready((self._params, self._table.state))
    except Exception as e:
      update.done.set_exception(e)
      raise
    ms = watch.stop(self.metrics, "update_s") * 1e3
    self.metrics["last_update_ms"] = ms
    self.metrics["updates"] += 1
    update.done.set_result(ms)

  def _reap_aborted(self) -> None:
    for slot, req in enumerate(self._slots):
      if req is not None and req.aborted:
        self._slots[slot] = None
        self._admission.park(slot, req)
        self._finish(req, "abort")
    for slot, (req, _) in list(self._table.prefilling.items()):
      if req.aborted:  # its slot holds part of a prompt: freed, not parked
        del self._table.prefilling[slot]
        if self._table.pages is not None:
          self._admission.unmap(slot)
        self._finish(req, "abort")
    with self._lock:
      aborted = [r for r in self._queue if r.aborted]
      if aborted:
        self._queue = collections.deque(r for r in self._queue if not r.aborted)
    for req in aborted:
      self._finish(req, "abort")

  def _step(self) -> None:
    """Dispatches the next call for the live slots, then records the previous call's tokens."""
    previous, self._in_flight = self._in_flight, None
    watch = compile_clock.Stopwatch()
    k = self.engine.cfg.decode_steps_per_call
    with self._lock:
      waiting = bool(self._queue)
    plan = plan_call(self._slots, previous, k, waiting=waiting)
    if self._table.pages is not None:
      plan = self._ensure_pages(plan, previous, k, waiting)
    if plan.live:
      mode = mode_for(r.sampling for _, r in plan.live)
      top_n = steps.TOP_N if any(r.sampling.top_logprobs for _, r in plan.live) else 0  # RL: 0
      slots, rows = [s for s, _ in plan.live], None
      try:
        if k > 1:
          # Budgets clipped to the plan's steps: the call runs no more steps than its window
          # (max_length) and its pages (paged) were sized for.
          self._table.state, result, rows = self.engine.generate_chunk(
            self._params, self._table.state, slots,
            [min(plan.budget[s], plan.steps) for s in slots],
            [r.stop_ids for _, r in plan.live], max_length=plan.max_length, mode=mode,
            top_n=top_n,
          )  # fmt: skip
        else:
          self._table.state, result = self.engine.generate(
            self._params, self._table.state, max_length=plan.max_length, mode=mode, live=slots,
            top_n=top_n,
          )  # fmt: skip
      except Exception as e:
        self._generate_failed(e)
        return
      self._in_flight = InFlight(result, list(self._slots), plan.emits(k > 1), rows)
      self.metrics["decode_steps"] += plan.steps
      self.metrics["decode_rows"] += self.engine.rows_for(len(slots)) * plan.steps
    if previous is not None:
      self._collect(previous)
    watch.stop(self.metrics, "decode_s")

  def _ensure_pages(self, plan, previous: InFlight | None, k: int, waiting: bool):
    """Maps the pages every live slot writes in the next call; when the pool runs out, preempts
    the youngest sequence (latest submitted) and plans again. Returns the plan to dispatch."""
    pages = self._table.pages
    while True:
      short = False
      for s, _ in plan.live:
        end = plan.length[s] + min(plan.steps, max(plan.budget[s], 1)) - 1
        if not pages.grow(s, end):
          short = True
          break
      if not short:
        self._admission.sync_pages()
        return plan
      live = [r for r in self._slots if r is not None]
      if len(live) <= 1:
        raise EngineError("the page pool cannot hold one sequence")  # config prevents it
      victim = max(live, key=lambda r: r.submitted)
      self._preempt(victim.slot, victim)
      plan = plan_call(self._slots, previous, k, waiting=True)

  def _preempt(self, slot: int, req: Request) -> None:
    """Frees a live sequence's pages (its full blocks stay cached while nobody needs the room)
    and queues it first, to be prefilled again from prompt + tokens (paged_admission.py)."""
    self._slots[slot] = None
    self._admission.park(slot, req)
    self._requeue([req])
    self.metrics["preemptions"] += 1

  def _drain(self) -> None:
    """Reads back and records the step in flight, if any (before anything that needs every
    slot's tokens up to date)."""
    previous, self._in_flight = self._in_flight, None
    if previous is not None:
      watch = compile_clock.Stopwatch()
      self._collect(previous)
      watch.stop(self.metrics, "decode_s")

  def _collect(self, call: InFlight) -> None:
    try:
      data, rows, logprobs, tops = read_back(call)
    except Exception as e:  # a failure inside the call surfaces here
      self._generate_failed(e)
      return
    for j, slot in enumerate(rows):
      req = call.owners[slot]
      for i, top in enumerate(tops):
        # A request that finished or was aborted after this call was dispatched no longer owns
        # its slot (it may hold a new request already): the tokens computed for it are dropped.
        if req is None or self._slots[slot] is not req or not data[i, j, steps.VALID]:
          break
        self.metrics["decode_tokens"] += 1
        token, version = int(data[i, j, steps.TOKEN]), int(data[i, j, steps.VERSION])
        alternatives = None if top is None else (top[0][j], top[1][j])
        reason = self._append(req, token, float(logprobs[i, j]), version, alternatives)
        if reason is not None:
          self._slots[slot] = None  # before the caller can see the result: stats never lag it
          self._admission.park(slot, req)
          self._finish(req, reason)

  def _generate_failed(self, e: Exception) -> None:
    log.exception("generate step failed")
    self.metrics["engine_errors"] += 1
    self._in_flight = None  # computed from the failed state, if at all
    self._table.state = self.engine.init_decode_state()  # the old one may have been donated
    self._fail_active(EngineError(f"generate step failed: {type(e).__name__}: {e}"))

  def _append(self, req: Request, token: int, logprob: float, version: int,
              top: tuple | None = None) -> StopReason | None:  # fmt: skip
    """Records one generated token; returns why the request stops now, or None."""
    self.metrics["tokens"] += 1
    return req.append(token, logprob, version, self.engine.tokenizer.decode, top)

  def _fail_active(self, error: Exception) -> None:
    self._in_flight = None  # its tokens belong to the requests failed here
    self._table.prefixes.clear()  # their keys/values may be lost with the decode state
    if self._table.pages is not None:  # the decode state was rebuilt: its table maps nothing
      self._table.pages = self._new_pages()
    prefilling, self._table.prefilling = self._table.prefilling, {}
    for req, _ in prefilling.values():
      self._finish(req, error=error)
    for slot, req in enumerate(self._slots):
      if req is not None:
        self._slots[slot] = None
        self._finish(req, error=error)

  def _requeue(self, reqs: list[Request]) -> None:
    """Puts requests back at the front of the queue, in order (`AdmissionHooks.requeue`)."""
    with self._lock:
      self._queue.extendleft(reversed(reqs))

  def _take(self, n: int) -> list[Request]:
    """Pops up to n queued requests, oldest first (admission's `AdmissionHooks.take`)."""
    with self._lock:
      return [self._queue.popleft() for _ in range(min(n, len(self._queue)))]

  def _finish(
    self, req: Request, reason: StopReason | None = None, error: Exception | None = None
  ) -> None:
    with self._lock:
      self._by_id.pop(req.id, None)
    if error is not None:
      self.metrics["failed"] += 1
      req.resolve(error)
    else:
      self.metrics["aborted" if reason == "abort" else "done"] += 1
      req.resolve(req.result(reason))
