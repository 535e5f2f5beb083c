"""How requests get into the engine's slots: admission from the queue, prefills (whole, in
batches, in pieces) and suffix prefills into parked slots, and the re-prefill of a weight update.

`Admission` is an object the driver (driver.py) owns and calls from its engine thread. What the
two share is written down here rather than borrowed: the `SlotTable` (the decode state and who
holds each slot), the driver's counters, and `AdmissionHooks`, the four driver operations
admission calls back (take queued requests, record a token, finish a request, fail every slot).
It was a mixin of `Driver` reading ten of its private attributes, and the two modules imported
each other.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable

import numpy as np

from asearcher_jax.serving import compile_clock
from asearcher_jax.serving import engine_steps as steps
from asearcher_jax.serving.engine import Engine
from asearcher_jax.serving.pages import SlotPages
from asearcher_jax.serving.prefix_cache import PrefixCache
from asearcher_jax.serving.request import Request
from asearcher_jax.serving.types import EngineError, StopReason

log = logging.getLogger("asearcher_jax.serving.driver")

# Requests per whole-prompt prefill call (admissions and an update's re-prefills), largest first:
# the shapes `Engine.warmup(chunks=...)` compiles.
PREFILL_CHUNKS = (8, 4, 2, 1)


@dataclasses.dataclass(eq=False)
class SlotTable:
  """The engine's slots as the engine thread sees them, shared by the driver (decode calls,
  weight updates, failures) and admission (prefills). A slot is live (a request in `slots`),
  parked (its tokens in `prefixes`, for reuse), being prefilled piece by piece (`prefilling`) or
  free; engine thread only."""

  state: steps.DecodeState  # the engine's decode state: every slot's keys/values and position
  slots: list[Request | None]  # the request decoding in each slot, or None
  prefixes: PrefixCache  # parked slots and the tokens their keys/values hold
  # Paged layout: every slot's pages and the block cache (pages.py); None for a fixed cache,
  # whose slots are parked in `prefixes` instead.
  pages: SlotPages | None = None
  # Slots being prefilled piece by piece (DriverConfig.prefill_chunk): slot -> (request, done).
  prefilling: dict[int, tuple[Request, int]] = dataclasses.field(default_factory=dict)

  def free(self) -> list[int]:
    """Slots that hold neither a request, a parked prefix nor a prompt being prefilled."""
    return [
      i
      for i, r in enumerate(self.slots)
      if r is None and i not in self.prefixes and i not in self.prefilling
    ]

  def start(self, slot: int, req: Request) -> None:
    """Makes `req` the live request of `slot`: the next decode call advances it."""
    req.slot = slot
    self.slots[slot] = req


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdmissionHooks:
  """The driver's operations admission calls (on the engine thread)."""

  # Pops up to n requests off the driver's queue, oldest first.
  take: Callable[[int], list[Request]]
  # Records one sampled token (request, token, logprob, version, top alternatives or None);
  # returns why the request stops now, or None.
  record: Callable[[Request, int, float, int, tuple | None], StopReason | None]
  # Resolves a request, with its stop reason or `error=`; it leaves the driver's bookkeeping.
  finish: Callable[..., None]
  # Fails every request holding a slot with the error (after an engine failure).
  fail_active: Callable[[Exception], None]
  # Puts requests back at the front of the queue, in order (paged: no pages for them yet).
  requeue: Callable[[list[Request]], None]


class Admission:
  """Fills the engine's free and parked slots from the driver's queue; engine thread only."""

  def __init__(
    self,
    engine: Engine,
    table: SlotTable,
    metrics: collections.Counter,
    hooks: AdmissionHooks,
    *,
    max_admit: int,
    prefill_chunk: int,
    continue_in_decode: bool,
  ):
    self.engine = engine
    self.table = table
    self.metrics = metrics  # the driver's counters (`Driver.stats`)
    self.hooks = hooks
    self.max_admit = max_admit  # DriverConfig.max_admit_per_step
    self.prefill_chunk = prefill_chunk  # DriverConfig.prefill_chunk
    self.continue_in_decode = continue_in_decode  # DriverConfig.continue_in_decode

  def admit(self, params: steps.VersionedParams) -> int:
    """Fills free slots from the queue. A request whose prompt extends a parked slot's sequence
    goes into that slot with a suffix prefill; the rest, grouped by prefill bucket, are prefilled
    together in chunks of 8/4/2/1 (a handful of compiled shapes) and inserted into free slots,
    then into reclaimed parked slots (least recently parked first). A prompt longer than
    `prefill_chunk` (when set) only takes its slot here; `prefill_piece` fills it."""
    free = self.table.free()
    taken = self.hooks.take(min(len(free) + len(self.table.prefixes), self.max_admit))
    fresh: list[Request] = []
    reuse: list[tuple[Request, int, list[int]]] = []
    for req in taken:
      hit = self.table.prefixes.take(req.prompt)
      if hit is None:
        fresh.append(req)
      else:
        reuse.append((req, *hit))
    self._admit_reuses(params, reuse)
    free = self.table.free()
    while len(free) < len(fresh):  # reclaim: the parked slot's prefix is forgotten
      free.append(self.table.prefixes.evict())
      self.metrics["prefix_evictions"] += 1
    by_bucket: dict[int, list[Request]] = collections.defaultdict(list)
    for req in fresh:
      if self.prefill_chunk and len(req.prompt) > self.prefill_chunk:
        self.table.prefilling[free.pop(0)] = (req, 0)  # prefilled piece by piece, from the loop
        continue
      by_bucket[self.engine.bucket_for(len(req.prompt))].append(req)
    for bucket, reqs in by_bucket.items():
      while reqs:
        size = next(c for c in self.engine.prefill_chunks(bucket, PREFILL_CHUNKS) if c <= len(reqs))
        chunk, reqs = reqs[:size], reqs[size:]
        self._admit_chunk(params, chunk, [free.pop(0) for _ in chunk])
    return len(taken)

  def prefill_piece(self, params: steps.VersionedParams) -> bool:
    """Prefills the next piece of the oldest prompt being prefilled in pieces (prefill_chunk);
    the last piece samples its first token and the request starts decoding. Returns whether a
    piece ran. Pieces before the last leave the slot inactive, so no decode call advances it."""
    if not self.table.prefilling:
      return False
    slot, (req, done) = next(iter(self.table.prefilling.items()))
    chunk, n = self.prefill_chunk, len(req.prompt)
    last = n - done <= chunk
    if last:  # the remainder, in the smallest bucket that holds it (extend_plan may move back)
      start, bucket, window = self.engine.extend_plan(done, n)
    else:
      start, bucket, window = done, chunk, self.engine.window_for(done + chunk)
    end = n if last else start + chunk
    watch = compile_clock.Stopwatch()
    try:
      self.table.state, tok, lp, version, top = self.engine.extend_slot(
        params, self.table.state, slot, req.prompt[start:end], start, sampling=req.sampling,
        seed=req.seed, bucket=bucket, window=window,
      )  # fmt: skip
      if not last:
        self.table.state = self.engine.release(self.table.state, slot)
      else:
        first, logprob, version = int(tok), float(lp), int(version)
        top = tuple(map(np.asarray, top))
    except Exception as e:
      log.exception("prefill piece failed for %s", req.id)
      self.metrics["engine_errors"] += 1
      self.table.state = self.engine.init_decode_state()  # the old one may have been donated
      del self.table.prefilling[slot]
      self.hooks.fail_active(EngineError(f"prefill failed: {type(e).__name__}: {e}"))
      self.hooks.finish(req, error=EngineError(f"prefill failed: {type(e).__name__}: {e}"))
      return True
    watch.stop(self.metrics, "prefill_s")
    self.metrics["prefill_pieces"] += 1
    self.metrics["prefill_tokens"] += end - start
    if not last:
      self.table.prefilling[slot] = (req, end)
      return True
    del self.table.prefilling[slot]
    reason = self.hooks.record(req, first, logprob, version, top)
    if reason is not None:
      self.park(slot, req)
      self.hooks.finish(req, reason)
      return True
    self.table.start(slot, req)
    return True

  def park(self, slot: int, req: Request) -> None:
    """Keeps a slot whose request just left it (finished or aborted) for prefix reuse. Its cache
    holds prompt + tokens[:-1]: the last token was sampled but never fed (a step dispatched
    ahead may have fed it, but that is not relied upon). A continuation that leaves before its
    first token (`_admit_continuation`) holds prompt[:-1]: its last prompt token was not fed."""
    if not self.table.prefixes.enabled:
      return
    self.table.state = self.engine.release(self.table.state, slot)
    self.table.prefixes.park(slot, req.prompt + req.tokens[:-1] if req.tokens else req.prompt[:-1])

  def _admit_reuses(
    self, params: steps.VersionedParams, hits: list[tuple[Request, int, list[int]]]
  ) -> None:
    """Admits requests into the parked slots that hold their prefixes: suffix prefills grouped
    by suffix bucket, in chunks of `EngineConfig.suffix_chunks` (one call per chunk, attending
    over the chunk's largest window)."""
    by_bucket: dict[int, list[tuple[Request, int, int, int]]] = collections.defaultdict(list)
    for req, slot, cached in hits:
      if self.continue_in_decode and len(req.prompt) == len(cached) + 1:
        self._admit_continuation(req, slot)
        continue
      start, bucket, window = self.engine.extend_plan(len(cached), len(req.prompt))
      by_bucket[bucket].append((req, slot, start, window))
    for bucket, group in by_bucket.items():
      while group:
        size = next(c for c in self.engine.cfg.suffix_chunks if c <= len(group))
        chunk, group = group[:size], group[size:]
        self._admit_reuse_chunk(params, chunk, bucket)

  def _admit_continuation(self, req: Request, slot: int) -> None:
    """Admits a turn whose one new token is the one its slot's last call sampled: the slot goes
    live with that token to feed, and the next decode step samples the turn's first token."""
    watch = compile_clock.Stopwatch()
    try:
      self.table.state = self.engine.activate_slot(
        self.table.state, slot, req.prompt[-1], len(req.prompt) - 1, sampling=req.sampling,
        seed=req.seed,
      )  # fmt: skip
    except Exception as e:
      log.exception("activation failed for %s", req.id)
      self.metrics["engine_errors"] += 1
      self.table.state = self.engine.init_decode_state()  # the old one may have been donated
      self.hooks.fail_active(EngineError(f"activation failed: {type(e).__name__}: {e}"))
      self.hooks.finish(req, error=EngineError(f"activation failed: {type(e).__name__}: {e}"))
      return
    watch.stop(self.metrics, "prefill_s")
    self.metrics["prefix_hits"] += 1
    self.metrics["prefix_tokens_reused"] += len(req.prompt) - 1
    self.metrics["decode_continuations"] += 1
    self.table.start(slot, req)

  def _admit_reuse_chunk(
    self, params: steps.VersionedParams, chunk: list[tuple[Request, int, int, int]], bucket: int
  ) -> None:
    watch = compile_clock.Stopwatch()
    reqs = [c[0] for c in chunk]
    window = max(c[3] for c in chunk)
    try:
      if len(chunk) == 1:
        req, slot, start, _ = chunk[0]
        self.table.state, *out = self.engine.extend_slot(
          params, self.table.state, slot, req.prompt[start:], start, sampling=req.sampling,
          seed=req.seed, bucket=bucket, window=window,
        )  # fmt: skip
      else:
        self.table.state, *out = self.engine.extend_slots(
          params, self.table.state, [c[1] for c in chunk],
          [r.prompt[c[2] :] for r, c in zip(reqs, chunk, strict=True)], [c[2] for c in chunk],
          samplings=[r.sampling for r in reqs], seeds=[r.seed for r in reqs], bucket=bucket,
          window=window,
        )  # fmt: skip
      tok, lp, version, top = out
      first, logprobs = np.atleast_1d(np.asarray(tok)), np.atleast_1d(np.asarray(lp))
      version, top = int(version), tuple(np.asarray(x).reshape(len(chunk), -1) for x in top)
    except Exception as e:
      log.exception("suffix prefill failed for %s", [r.id for r in reqs])
      self.metrics["engine_errors"] += 1
      self.table.state = self.engine.init_decode_state()  # the old one may have been donated
      self.hooks.fail_active(
        EngineError(f"prefill failed: {type(e).__name__}: {e}")
      )  # clears parked
      for req in reqs:
        self.hooks.finish(req, error=EngineError(f"prefill failed: {type(e).__name__}: {e}"))
      return
    watch.stop(self.metrics, "prefill_s", "suffix_prefill_s")
    self.metrics["prefill_calls"] += 1
    self.metrics["suffix_prefill_calls"] += 1
    for i, (req, slot, start, _) in enumerate(chunk):
      self.metrics["prefix_hits"] += 1
      self.metrics["prefix_tokens_reused"] += start
      self.metrics["prefill_tokens"] += len(req.prompt) - start
      reason = self.hooks.record(
        req, int(first[i]), float(logprobs[i]), version, (top[0][i], top[1][i])
      )
      if reason is not None:
        self.park(slot, req)
        self.hooks.finish(req, reason)
        continue
      self.table.start(slot, req)

  def _admit_chunk(
    self, params: steps.VersionedParams, chunk: list[Request], slots: list[int]
  ) -> None:
    watch = compile_clock.Stopwatch()
    try:
      prefixes = self.engine.prefill_many(
        params=params,
        prompts=[r.prompt for r in chunk],
        samplings=[r.sampling for r in chunk],
        seeds=[r.seed for r in chunk],
      )
      first = np.asarray(prefixes.next_token)
      logprobs = np.asarray(prefixes.next_logprob)
      versions = np.asarray(prefixes.version)
      tops = np.asarray(prefixes.top_ids), np.asarray(prefixes.top_logprobs)
      self.table.state = self.engine.insert_many(prefixes, self.table.state, slots)
    except Exception as e:
      log.exception("prefill failed for %s", [r.id for r in chunk])
      self.metrics["engine_errors"] += 1
      for req in chunk:
        self.hooks.finish(req, error=EngineError(f"prefill failed: {type(e).__name__}: {e}"))
      return
    watch.stop(self.metrics, "prefill_s")
    self.metrics["prefill_calls"] += 1
    self.metrics["prefill_tokens"] += sum(len(r.prompt) for r in chunk)
    for i, (req, slot) in enumerate(zip(chunk, slots, strict=True)):
      top = tops[0][i], tops[1][i]
      reason = self.hooks.record(req, int(first[i]), float(logprobs[i]), int(versions[i]), top)
      if reason is not None:
        self.park(slot, req)
        self.hooks.finish(req, reason)  # finished on its first token: its slot stays free
        continue
      self.table.start(slot, req)

  def reprefill(self, params: steps.VersionedParams, slot: int, req: Request) -> None:
    """Rebuilds a slot's cache under the current weights: prompt + all generated tokens but the
    last, which was sampled already and is fed by the next step."""
    ctx = req.prompt + req.tokens[:-1]
    padded, n = self.engine.pad(ctx)
    prefix = self.engine.prefill(
      params=params, padded_tokens=padded, true_length=n, sampling=req.sampling, seed=req.seed
    )
    prefix = prefix.replace(next_token=np.int32(req.tokens[-1]))
    self.table.state = self.engine.insert(prefix, self.table.state, slot)
    self.metrics["reprefill_tokens"] += n

  def reprefill_many(self, params: steps.VersionedParams, live: list[tuple[int, Request]]) -> None:
    """`reprefill` for every in-flight slot, grouped by prefill bucket, 8/4/2/1 per call."""
    by_bucket: dict[int, list[tuple[int, Request]]] = collections.defaultdict(list)
    for slot, req in live:
      by_bucket[self.engine.bucket_for(len(req.prompt) + len(req.tokens) - 1)].append((slot, req))
    for bucket, group in by_bucket.items():
      while group:
        size = next(
          c for c in self.engine.prefill_chunks(bucket, PREFILL_CHUNKS) if c <= len(group)
        )
        chunk, group = group[:size], group[size:]
        reqs = [r for _, r in chunk]
        prefixes = self.engine.prefill_many(
          params=params, prompts=[r.prompt + r.tokens[:-1] for r in reqs],
          samplings=[r.sampling for r in reqs], seeds=[r.seed for r in reqs],
        )  # fmt: skip
        prefixes = prefixes.replace(next_token=np.asarray([r.tokens[-1] for r in reqs], np.int32))
        self.table.state = self.engine.insert_many(
          prefixes, self.table.state, [s for s, _ in chunk]
        )
        self.metrics["reprefill_tokens"] += sum(len(r.prompt) + len(r.tokens) - 1 for r in reqs)
