"""The paged cache's host bookkeeping: reference counts, block-hash prefix matching, eviction."""

from __future__ import annotations

import pytest

from asearcher_jax.serving.pages import BlockCache, PageAllocator, SlotPages, block_keys


def test_allocator_counts_references_and_reuses_freed_pages():
  a = PageAllocator(5)
  assert a.free_count == 4 and a.used == 0
  p = a.alloc(3)
  assert 0 not in p and len(set(p)) == 3 and a.free_count == 1
  a.share(p[:1])
  a.free(p)
  assert a.refs(p[0]) == 1 and a.free_count == 3  # still referenced once
  a.free(p[:1])
  assert a.free_count == 4
  with pytest.raises(ValueError, match="freed more often"):
    a.free(p[:1])
  with pytest.raises(MemoryError):
    a.alloc(5)
  with pytest.raises(ValueError, match="num_pages"):
    PageAllocator(1)


def test_block_keys_chain_over_the_prefix():
  assert len(block_keys(list(range(10)), 4)) == 2  # the partial third block has no key
  a, b = block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4), block_keys([9, 2, 3, 4, 5, 6, 7, 8], 4)
  assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix


def test_cache_matches_the_longest_prefix_of_full_blocks_and_evicts_lru():
  a = PageAllocator(8)
  cache = BlockCache(a, 4)
  seq = list(range(1, 11))  # two full blocks and a partial one
  pages = a.alloc(3)
  assert cache.register(seq, pages) == 2 and a.refs(pages[0]) == 2 and a.refs(pages[2]) == 1
  assert cache.match([*seq, 99]) == pages[:2]
  assert cache.match(seq[:7]) == pages[:1]
  assert cache.match([0, *seq]) == []
  assert cache.register(seq, a.alloc(2)) == 0  # already cached: the first pages stay
  a.free(pages)  # the sequence ends: only the cache holds its blocks
  assert a.refs(pages[0]) == 1 and a.free_count == 3
  other = list(range(50, 58))
  mine = a.alloc(2)
  cache.register(other, mine)
  a.free(mine)
  cache.match(seq)  # seq's blocks are now the most recently used
  a.alloc(a.free_count)
  assert cache.evict(2) == 2 and cache.match(other) == [] and len(cache.match(seq)) == 2
  cache.clear()
  assert len(cache) == 0 and cache.match(seq) == []


def test_slot_pages_grow_share_and_release():
  sp = SlotPages(slots=3, num_pages=7, page_size=4, pages_per_seq=4)
  assert sp.grow(0, 9) and len(sp.pages[0]) == 3  # positions 0..8
  assert sp.take_table()[0, :3].tolist() == sp.pages[0] and sp.take_table() is None
  prompt = list(range(1, 10))
  sp.register(0, prompt)
  hit = sp.blocks.match(prompt)
  sp.map_shared(1, hit)
  assert sp.grow(1, 12) and sp.pages[1][:2] == sp.pages[0][:2]
  assert sp.allocator.refs(sp.pages[0][0]) == 3  # two tables and the cache
  assert not sp.grow(2, 16)  # 4 pages asked, 2 free, nothing evictable
  assert sp.pages[2] == []
  sp.release(0)
  sp.release(1)
  assert sp.table[:2].max() == 0 and sp.available() == 6  # 2 cached, evictable
  assert sp.grow(2, 16) and sp.allocator.free_count == 0 and len(sp.blocks) == 2
  assert sp.grow(0, 8) and len(sp.blocks) == 0  # the cached blocks make room
