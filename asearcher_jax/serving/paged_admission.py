"""Admission over a paged KV cache (EngineConfig.kv_layout="paged"): prefix sharing by page,
preemption under page pressure, and the re-prefill of a weight update as a re-admission.

Where the fixed layout parks a finished request's slot for its next turn (prefix_cache.py), the
paged one frees the slot at once and keeps the request's full pages in the block cache
(pages.py): any later request whose tokens start with them maps them, whichever slot it lands in.
A request is admitted with its longest cached prefix mapped and only the rest prefilled:
  * nothing cached: a whole-prompt prefill (batched by bucket, as the fixed layout does);
  * part of it: a suffix prefill of the rest, onto the mapped pages;
  * all of it (a page-aligned prompt, e.g. the other samples of a group): its last token is fed
    for its logits without writing its keys/values again (they sit in pages others share);
  * all but the last token (an episode's turn that continues its last call): no prefill, the
    next decode step feeds it (`DriverConfig.continue_in_decode`).
Requests admitted together are admitted in waves so that one that maps another's prompt pages
runs after the call that writes them (a group of 16: one prefill, then 15 one-token feeds).

A preempted request (its pages freed when the pool ran out, `Driver._ensure_pages`) or one
re-prefilled after a weight update is admitted again with prompt + every token it generated as
its context: the prefill samples its next token with the key and position its next decode step
would have used, so its tokens are the ones it would have produced anyway.
"""

from __future__ import annotations

import collections

import numpy as np

from asearcher_jax.serving import compile_clock
from asearcher_jax.serving import engine_steps as steps
from asearcher_jax.serving.admission import PREFILL_CHUNKS, Admission, log
from asearcher_jax.serving.pages import SlotPages, block_keys
from asearcher_jax.serving.request import Request
from asearcher_jax.serving.types import EngineError


def context(req: Request) -> list[int]:
  """What a request's keys/values must cover before it samples its next token."""
  return req.prompt + req.tokens


class PagedAdmission(Admission):
  """`Admission` for a paged engine; the slot table's `pages` is its host page tables."""

  @property
  def pages(self) -> SlotPages:
    return self.table.pages

  def sync_pages(self) -> None:
    """Sends the host page table to the device if it changed (before any call that uses it)."""
    table = self.pages.take_table()
    if table is not None:
      self.table.state = self.engine.set_page_table(self.table.state, table)

  def unmap(self, slot: int, cached: list[int] | None = None) -> None:
    """Frees a slot's pages, first caching the full blocks of `cached` (the tokens its
    keys/values hold), and marks it inactive on the device."""
    if cached:
      self.pages.register(slot, cached)
    self.table.state = self.engine.release(self.table.state, slot)
    self.pages.release(slot)

  def park(self, slot: int, req: Request) -> None:
    """A request left its slot: its full pages stay cached for reuse, the slot is free."""
    self.unmap(slot, req.prompt + req.tokens[:-1] if req.tokens else req.prompt[:-1])

  def admit(self, params: steps.VersionedParams) -> int:
    free = self.table.free()
    taken = self.hooks.take(min(len(free), self.max_admit))
    self.admit_requests(params, taken, free)
    return len(taken)

  def admit_requests(
    self,
    params: steps.VersionedParams,
    reqs: list[Request],
    free: list[int],
    *,
    metric: str = "prefill_tokens",
  ) -> None:
    """Admits `reqs` into the `free` slots, in waves (module docstring). A request the pool has
    no pages for goes back to the front of the queue, with every one after it."""
    pending = list(reqs)
    while pending:
      wave, rest, keys_in_wave = [], [], set()
      for i, req in enumerate(pending):
        ctx = context(req)
        keys = block_keys(ctx, self.pages.page_size)
        hit = self.pages.blocks.match(ctx)
        if keys_in_wave.intersection(keys[: len(hit) + 1]):
          rest.append(req)  # it maps (or would) pages this wave writes: the next wave
          continue
        slot = self._place(req, ctx, hit, free)
        if slot is None:
          self.hooks.requeue([r for r in pending[i:] if r not in rest] + rest)
          rest = []
          break
        keys_in_wave.update(keys)
        wave.append((req, slot, len(hit) * self.pages.page_size))
      self._run_wave(params, wave, metric)
      pending = rest
      if wave == []:
        break

  def _place(self, req: Request, ctx: list[int], hit: list[int], free: list[int]) -> int | None:
    """Maps a slot's pages for ctx (the cached ones shared, the rest fresh) and caches the
    full blocks the admission will write; None when the pool cannot hold it now (one page of
    headroom for the first decode step)."""
    need = self.pages.pages_for(len(ctx) + 1) - len(hit)
    if not free or self.pages.available() < need + 1:
      return None
    slot = free.pop(0)
    self.pages.map_shared(slot, hit)
    if not self.pages.grow(slot, len(ctx)):
      self.pages.release(slot)
      free.insert(0, slot)
      return None
    if not self._in_pieces(req, len(hit)):
      self.pages.register(slot, ctx)  # written by this wave's call, before any later one reads
    return slot

  def _in_pieces(self, req: Request, hit_pages: int) -> bool:
    """A fresh prompt longer than prefill_chunk is prefilled piece by piece (`prefill_piece`);
    its blocks are cached only when it finishes (a piece not yet run is not there to map)."""
    return not hit_pages and not req.tokens and 0 < self.prefill_chunk < len(req.prompt)

  def _run_wave(self, params, wave: list[tuple[Request, int, int]], metric: str) -> None:
    self.sync_pages()
    fresh: dict[int, list[tuple[Request, int]]] = collections.defaultdict(list)
    suffix: dict[int, list[tuple[Request, int, int, int, bool]]] = collections.defaultdict(list)
    for req, slot, cached in wave:
      ctx = context(req)
      if self._in_pieces(req, cached):
        self.table.prefilling[slot] = (req, 0)  # in pieces, from the loop (`prefill_piece`)
      elif cached == 0:
        fresh[self.engine.bucket_for(len(ctx))].append((req, slot))
      elif self.continue_in_decode and cached == len(ctx) - 1:
        self._continue(req, slot, ctx)
      else:
        start, bucket, window = self.engine.extend_plan(cached, len(ctx))
        suffix[bucket].append((req, slot, start, window, start >= cached))
    for bucket, group in fresh.items():
      while group:
        size = next(
          c for c in self.engine.prefill_chunks(bucket, PREFILL_CHUNKS) if c <= len(group)
        )
        chunk, group = group[:size], group[size:]
        self._call(params, chunk, metric)
    for bucket, group in suffix.items():
      while group:
        size = next(c for c in self.engine.cfg.suffix_chunks if c <= len(group))
        chunk, group = group[:size], group[size:]
        self._call(params, chunk, metric, bucket=bucket)

  def _continue(self, req: Request, slot: int, ctx: list[int]) -> None:
    self.table.state = self.engine.activate_slot(
      self.table.state, slot, ctx[-1], len(ctx) - 1, sampling=req.sampling, seed=req.seed
    )
    self.metrics["prefix_hits"] += 1
    self.metrics["prefix_tokens_reused"] += len(ctx) - 1
    self.metrics["decode_continuations"] += 1
    self.table.start(slot, req)

  def _call(self, params, chunk: list[tuple], metric: str, *, bucket: int | None = None) -> None:
    """One prefill call: whole contexts (chunk of (request, slot)) or suffixes (chunk of
    (request, slot, start, window, write)) when `bucket` is given; records first tokens."""
    watch = compile_clock.Stopwatch()
    reqs, slots = [c[0] for c in chunk], [c[1] for c in chunk]
    ctxs = [context(r) for r in reqs]
    try:
      if bucket is None:
        prefixes = self.engine.prefill_many(
          params=params, prompts=ctxs, samplings=[r.sampling for r in reqs],
          seeds=[r.seed for r in reqs],
        )  # fmt: skip
        self.table.state = self.engine.insert_many(prefixes, self.table.state, slots)
        out = prefixes.next_token, prefixes.next_logprob, prefixes.version
        top = prefixes.top_ids, prefixes.top_logprobs
        starts = [0] * len(chunk)
      else:
        starts = [c[2] for c in chunk]
        self.table.state, tok, lp, version, top = self.engine.extend_slots(
          params, self.table.state, slots, [x[s:] for x, s in zip(ctxs, starts, strict=True)],
          starts, samplings=[r.sampling for r in reqs], seeds=[r.seed for r in reqs],
          bucket=bucket, window=max(c[3] for c in chunk), writes=[c[4] for c in chunk],
        )  # fmt: skip
        out = tok, lp, np.broadcast_to(np.asarray(version), (len(chunk),))
      first, logprobs, versions = (np.atleast_1d(np.asarray(x)) for x in out)
      top = tuple(np.asarray(x).reshape(len(chunk), -1) for x in top)
    except Exception as e:
      log.exception("prefill failed for %s", [r.id for r in reqs])
      self.metrics["engine_errors"] += 1
      self.table.state = self.engine.init_decode_state()  # the old one may have been donated
      error = EngineError(f"prefill failed: {type(e).__name__}: {e}")
      self.hooks.fail_active(error)
      for req in reqs:
        self.hooks.finish(req, error=error)
      return
    watch.stop(self.metrics, "prefill_s", *([] if bucket is None else ["suffix_prefill_s"]))
    self.metrics["prefill_calls"] += 1
    if bucket is not None:
      self.metrics["suffix_prefill_calls"] += 1
    for i, (req, slot) in enumerate(zip(reqs, slots, strict=True)):
      self.metrics[metric] += len(ctxs[i]) - starts[i]
      if starts[i]:
        self.metrics["prefix_hits"] += 1
        self.metrics["prefix_tokens_reused"] += starts[i]
      reason = self.hooks.record(
        req, int(first[i]), float(logprobs[i]), int(versions[i]), (top[0][i], top[1][i])
      )
      if reason is not None:
        self.park(slot, req)
        self.hooks.finish(req, reason)
        continue
      self.table.start(slot, req)

  def prefill_piece(self, params: steps.VersionedParams) -> bool:
    if self.table.prefilling:
      self.sync_pages()
    return super().prefill_piece(params)

  def reprefill_live(self, params: steps.VersionedParams, live: list[tuple[int, Request]]) -> None:
    """A recomputing weight update: every live request leaves its slot and is admitted again
    under the new weights (the block cache was cleared, so nothing old is mapped)."""
    for slot, _ in live:
      self.table.slots[slot] = None
      self.unmap(slot)
    self.admit_requests(params, [r for _, r in live], self.table.free(), metric="reprefill_tokens")
