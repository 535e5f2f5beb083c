"""The paged KV cache's host side: a page allocator with reference counts, a prefix cache of
page-aligned token blocks, and every slot's page table.

The device holds per-layer page pools and a [slots, pages_per_seq] page table
(`model.kv_cache.PagedKVCache`); this module decides which pages each slot maps. A page is
referenced by every slot table that maps it and by the block cache while it caches it; it returns
to the free list when the last reference goes. Pages are shared only when full and never written
again (a block of page_size tokens is immutable once computed), so sharing needs no copy and
there is no copy-on-write: a slot writes only into pages it alone maps (the partial last page
of its sequence is never shared).

The block cache is vLLM's automatic prefix caching: block i of a sequence is keyed by a hash
chained over blocks 0..i (so equal keys mean equal prefixes), and a new sequence maps the longest
run of cached blocks its tokens start with instead of prefilling them. The other samples of a
group map their shared prompt, an agent's next turn the earlier turns of its episode. Cached
blocks nobody maps are evicted least recently used first when pages run out.

Bookkeeping only: no engine, no device arrays. The driver's engine thread owns it (not locked).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

from asearcher_jax.model.kv_cache import NULL_PAGE


class PageAllocator:
  """Pages 1..num_pages-1 (0 is the null page), each with a reference count."""

  def __init__(self, num_pages: int):
    if num_pages < 2:
      raise ValueError(f"EngineConfig.num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
    self.num_pages = num_pages
    self._refs = np.zeros(num_pages, np.int32)
    self._free: collections.deque[int] = collections.deque(range(1, num_pages))

  @property
  def free_count(self) -> int:
    return len(self._free)

  @property
  def used(self) -> int:
    """Pages referenced at least once."""
    return self.num_pages - 1 - len(self._free)

  def refs(self, page: int) -> int:
    return int(self._refs[page])

  def alloc(self, n: int) -> list[int]:
    """n fresh pages, each referenced once. Raises MemoryError when fewer are free (the caller
    evicts or preempts first: `free_count` says how many are)."""
    if n > len(self._free):
      raise MemoryError(f"{n} pages asked, {len(self._free)} free")
    pages = [self._free.popleft() for _ in range(n)]
    self._refs[pages] = 1
    return pages

  def share(self, pages: Sequence[int]) -> None:
    """One more reference to each page (another table maps it, or the block cache keeps it)."""
    for p in pages:
      if self._refs[p] < 1:
        raise ValueError(f"page {p} is not allocated")
      self._refs[p] += 1

  def free(self, pages: Sequence[int]) -> None:
    """Drops one reference to each page; a page nobody references is free again."""
    for p in pages:
      if self._refs[p] < 1:
        raise ValueError(f"page {p} freed more often than referenced")
      self._refs[p] -= 1
      if self._refs[p] == 0:
        self._free.append(p)


def block_keys(tokens: Sequence[int], page_size: int) -> list[int]:
  """The chained key of every full block of `tokens`: key i hashes blocks 0..i."""
  keys, parent = [], 0
  for i in range(len(tokens) // page_size):
    parent = hash((parent, tuple(tokens[i * page_size : (i + 1) * page_size])))
    keys.append(parent)
  return keys


class BlockCache:
  """Full pages of computed keys/values by block key, least recently used first; the cache holds
  one reference to each. `enabled` False keeps it empty (`DriverConfig.prefix_reuse`)."""

  def __init__(self, allocator: PageAllocator, page_size: int, *, enabled: bool = True):
    self.allocator = allocator
    self.page_size = page_size
    self.enabled = enabled
    # key -> (page, the block's tokens and its parent's key: checked on a hit, so a hash
    # collision can never map the wrong keys/values)
    self._blocks: collections.OrderedDict[int, tuple[int, tuple]] = collections.OrderedDict()

  def __len__(self) -> int:
    return len(self._blocks)

  def match(self, tokens: Sequence[int]) -> list[int]:
    """The pages of the longest run of cached blocks `tokens` starts with (most recently used
    now); the caller shares them before use."""
    pages, parent = [], 0
    ps = self.page_size
    for i, key in enumerate(block_keys(tokens, ps)):
      hit = self._blocks.get(key)
      if hit is None or hit[1] != (parent, tuple(tokens[i * ps : (i + 1) * ps])):
        break
      self._blocks.move_to_end(key)
      pages.append(hit[0])
      parent = key
    return pages

  def register(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
    """Caches the full blocks of `tokens`, held by `pages` (block i in pages[i]); a block cached
    already keeps its page. Returns the blocks added."""
    if not self.enabled:
      return 0
    added, parent = 0, 0
    ps = self.page_size
    for i, key in enumerate(block_keys(tokens, ps)[: len(pages)]):
      if key not in self._blocks:
        self.allocator.share([pages[i]])
        self._blocks[key] = (pages[i], (parent, tuple(tokens[i * ps : (i + 1) * ps])))
        added += 1
      parent = key
    return added

  def evict(self, want_free: int) -> int:
    """Evicts least recently used blocks that no table maps until `want_free` pages are free
    (or nothing more can go); returns the pages freed."""
    freed = 0
    for key in list(self._blocks):
      if self.allocator.free_count >= want_free:
        break
      page = self._blocks[key][0]
      if self.allocator.refs(page) == 1:  # the cache's own reference only
        del self._blocks[key]
        self.allocator.free([page])
        freed += 1
    return freed

  def clear(self) -> None:
    """Forgets every block (their keys/values are no longer valid, e.g. after new weights)."""
    for page, _ in self._blocks.values():
      self.allocator.free([page])
    self._blocks.clear()


class SlotPages:
  """Every slot's pages (its page-table row on the host), the allocator and the block cache.

  `table` is what the device's page table must equal before the next call (`dirty` says it
  changed since the engine last took it). A slot maps pages for positions 0..len(pages) *
  page_size - 1; unmapped entries are the null page.
  """

  def __init__(
    self, *, slots: int, num_pages: int, page_size: int, pages_per_seq: int, reuse: bool = True
  ):
    self.page_size = page_size
    self.pages_per_seq = pages_per_seq
    self.allocator = PageAllocator(num_pages)
    self.blocks = BlockCache(self.allocator, page_size, enabled=reuse)
    self.table = np.full((slots, pages_per_seq), NULL_PAGE, np.int32)
    self.pages: list[list[int]] = [[] for _ in range(slots)]
    self.dirty = False

  def pages_for(self, length: int) -> int:
    """Pages that hold positions 0..length-1."""
    return min(-(-length // self.page_size), self.pages_per_seq)

  def available(self) -> int:
    """Pages free now or once unmapped cached blocks are evicted."""
    evictable = sum(1 for p, _ in self.blocks._blocks.values() if self.allocator.refs(p) == 1)
    return self.allocator.free_count + evictable

  def _alloc(self, n: int) -> list[int] | None:
    if self.allocator.free_count < n:
      self.blocks.evict(n)
    if self.allocator.free_count < n:
      return None
    return self.allocator.alloc(n)

  def map_shared(self, slot: int, pages: Sequence[int]) -> None:
    """Maps cached pages as the slot's first pages (the slot holds none yet)."""
    if self.pages[slot]:
      raise ValueError(f"slot {slot} already maps pages")
    self.allocator.share(pages)
    self.pages[slot] = list(pages)
    self.table[slot, : len(pages)] = pages
    self.dirty = True

  def grow(self, slot: int, length: int) -> bool:
    """Maps fresh pages so the slot holds positions 0..length-1; False (nothing mapped) when
    the pool cannot supply them even after evicting unmapped cached blocks."""
    have, want = len(self.pages[slot]), self.pages_for(length)
    if want <= have:
      return True
    new = self._alloc(want - have)
    if new is None:
      return False
    self.table[slot, have:want] = new
    self.pages[slot].extend(new)
    self.dirty = True
    return True

  def register(self, slot: int, tokens: Sequence[int]) -> int:
    """Caches the full blocks of `tokens`, whose keys/values the slot's pages hold (or will:
    calls already dispatched write them before any later call reads them)."""
    return self.blocks.register(tokens, self.pages[slot])

  def release(self, slot: int) -> None:
    """Unmaps every page of the slot (each freed unless mapped elsewhere or cached)."""
    self.allocator.free(self.pages[slot])
    self.pages[slot] = []
    self.table[slot] = NULL_PAGE
    self.dirty = True

  def take_table(self) -> np.ndarray | None:
    """The table to send to the device, or None when it has not changed."""
    if not self.dirty:
      return None
    self.dirty = False
    return self.table.copy()
