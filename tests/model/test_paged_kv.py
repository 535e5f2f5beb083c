"""The paged KV cache gives what the fixed one gives: same keys at the same positions."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asearcher_jax.model import kv_cache as kv_lib
from asearcher_jax.model import transformer
from asearcher_jax.model.kv_cache import NULL_PAGE, KVCache, PagedKVCache
from tests.model.test_model import _model, small_cfg

B, MAX_LEN, PAGE = 3, 32, 4
PAGES_PER_SEQ = MAX_LEN // PAGE


def _scattered_table(num_pages: int, seed: int = 1) -> np.ndarray:
  """Every row's pages drawn at random from the pool (never the null page), distinct."""
  pages = np.random.default_rng(seed).permutation(np.arange(1, num_pages))
  return pages[: B * PAGES_PER_SEQ].reshape(B, PAGES_PER_SEQ).astype(np.int32)


@nnx.jit
def _extend(model, tokens, start, cache, rows=None, write_len=None):
  """Transformer.extend over a 16-position window, compiled (eager runs op by op: ~10x slower)."""
  return model.extend(tokens, start, cache, 16, rows=rows, write_len=write_len)


# How the pages are read, and copies of each KV head: the fixed cache is the oracle of each.
READS = pytest.mark.parametrize(
  "attention,repeat",
  [("gather", 1), ("ragged_reference", 2)],
)


@READS
def test_prefill_and_decode_over_pages_equal_the_fixed_cache(attention, repeat):
  cfg = small_cfg(vocab_size=101)
  model = _model(cfg, seed=3)
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 100, (B, 8)))
  fixed = KVCache.init(cfg, batch=B, max_len=MAX_LEN)
  paged = PagedKVCache.init(
    cfg, slots=B, num_pages=1 + B * PAGES_PER_SEQ, page_size=PAGE, pages_per_seq=PAGES_PER_SEQ,
    attention=attention, repeat=repeat,
  )  # fmt: skip
  paged = paged.replace(page_table=jnp.asarray(_scattered_table(paged.num_pages)))
  zeros = jnp.zeros((B,), jnp.int32)
  want, fixed = _extend(model, tokens, zeros, fixed)
  got, paged = _extend(model, tokens, zeros, paged)
  np.testing.assert_allclose(got, want, atol=1e-6)
  start = jnp.asarray([8, 8, 8], jnp.int32)
  for step in range(6):  # decode; row 1 only rides along from step 3 on (writes nothing)
    nxt = jnp.argmax(want[:, -1], -1)[:, None].astype(jnp.int32)
    ride = jnp.asarray([1, int(step < 3), 1], jnp.int32)
    want, fixed = _extend(model, nxt, start, fixed)
    before = np.asarray(paged.k[0])
    got, paged = _extend(model, nxt, start, paged, jnp.arange(B), ride)
    np.testing.assert_allclose(got[0::2], want[0::2], atol=1e-6)
    if step >= 3:  # the ride-along row's page is untouched
      page = int(paged.page_table[1, int(start[1]) // PAGE])
      np.testing.assert_array_equal(np.asarray(paged.k[0])[page], before[page])
    start = start + ride
  assert int(start[1]) == 11


@READS
def test_a_few_rows_of_a_large_table_and_a_suffix_over_shared_pages(attention, repeat):
  """Rows map to table rows (a decode over a few slots), and two rows whose tables share their
  first pages attend the same prefix keys: the suffix of one equals a fixed-cache continuation."""
  cfg = small_cfg(vocab_size=101)
  model = _model(cfg, seed=4)
  prompt = jnp.asarray(np.random.default_rng(2).integers(1, 100, (1, 8)))
  suffix = jnp.asarray([[7, 9, 11, 0]])  # three real tokens, one pad
  fixed = KVCache.init(cfg, batch=1, max_len=MAX_LEN)
  _, fixed = _extend(model, prompt, jnp.zeros((1,), jnp.int32), fixed)
  want, fixed = _extend(model, suffix, jnp.asarray([8], jnp.int32), fixed)

  paged = PagedKVCache.init(cfg, slots=4, num_pages=12, page_size=PAGE, pages_per_seq=8,
                            attention=attention, repeat=repeat)  # fmt: skip
  table = np.zeros((4, 8), np.int32)
  table[2, :2] = [5, 3]  # the prompt's two pages, written through slot 2
  table[0, :3] = [5, 3, 9]  # slot 0 maps them, and a page of its own for the suffix
  paged = paged.replace(page_table=jnp.asarray(table))
  _, paged = _extend(model, prompt, jnp.zeros((1,), jnp.int32), paged, jnp.asarray([2]))
  shared = np.asarray(paged.k[1])[[5, 3]]
  got, paged = _extend(
    model, suffix, jnp.asarray([8], jnp.int32), paged, jnp.asarray([0]), jnp.asarray([3])
  )
  np.testing.assert_allclose(got[0, :3], want[0, :3], atol=1e-6)
  np.testing.assert_array_equal(np.asarray(paged.k[1])[[5, 3]], shared)  # shared pages kept
  assert not np.array_equal(np.asarray(paged.k[1])[9, :3], 0)  # the suffix landed in page 9
  np.testing.assert_array_equal(np.asarray(paged.k[1])[9, 3], 0)  # the pad was dropped


def test_page_coordinates():
  table = jnp.asarray([[4, 2, 0]], jnp.int32)
  positions = jnp.asarray([[0, 5, 9, 12, 13]])
  valid = jnp.asarray([[True, True, True, True, False]])
  page, offset = kv_lib.page_coordinates(table, positions, valid, 4)
  # Position 9 is in an unmapped page, 12 past the table, 13 not valid: all on the null page.
  assert page.tolist() == [[4, 2, NULL_PAGE, NULL_PAGE, NULL_PAGE]]
  assert offset.tolist() == [[0, 1, 1, 0, 1]]
  assert transformer.PageView._fields[:3] == ("write_page", "write_offset", "read_table")


def test_combined_pools_interleave_keys_and_values_and_repeat_heads():
  """The pools hold the kernel's layout: head h's keys at 2h, its values at 2h + 1, and with a
  repeat each model head once per copy, side by side."""
  cfg = small_cfg(vocab_size=101)  # 2 KV heads
  cache = PagedKVCache.init(cfg, slots=1, num_pages=3, page_size=2, pages_per_seq=2, repeat=2)
  assert cache.kv_heads == 4 and cache.kv[0].shape[2] == 8
  k = jnp.arange(2 * 8, dtype=jnp.float32).reshape(1, 1, 2, 8)  # [B, T, K, hd]
  v = -k
  pool = kv_lib.paged_write(cache.kv[0], k, v, jnp.asarray([[2]]), jnp.asarray([[1]]))
  got = np.asarray(pool[2, 1])  # [2 * 4, hd]
  for j in range(4):  # cache head j holds model head j // 2
    np.testing.assert_array_equal(got[2 * j], np.asarray(k[0, 0, j // 2]))
    np.testing.assert_array_equal(got[2 * j + 1], np.asarray(v[0, 0, j // 2]))
  keys, values = kv_lib.paged_gather(pool, jnp.asarray([[1, 2]]))
  np.testing.assert_array_equal(np.asarray(keys[0, 3]), got[0::2])
  np.testing.assert_array_equal(np.asarray(values[0, 3]), got[1::2])


@nnx.jit(static_argnums=4)
def _extend_at(model, tokens, start, cache, attend_len, write_len=None):
  return model.extend(tokens, start, cache, attend_len, write_len=write_len)


@READS
def test_a_padded_suffix_at_the_context_limit_attends_from_its_own_positions(attention, repeat):
  """A suffix whose padded bucket runs past the context (start 28 + 8 > 32 positions): its real
  tokens must sit at 28, 29, 30 and attend what a fixed cache's continuation attends. (The
  ragged program once clipped the length to the table, which moved every query back.)"""
  cfg = small_cfg(vocab_size=101)
  model = _model(cfg, seed=6)
  prompt = jnp.asarray(np.random.default_rng(3).integers(1, 100, (1, 28)))
  suffix = jnp.asarray([[7, 9, 11, 0, 0, 0, 0, 0]])  # three real tokens padded to a bucket of 8
  zero, at = jnp.zeros((1,), jnp.int32), jnp.asarray([28], jnp.int32)
  fixed = KVCache.init(cfg, batch=1, max_len=MAX_LEN + 8)  # room for the pad: the oracle
  _, fixed = _extend_at(model, prompt, zero, fixed, MAX_LEN + 8)
  want, _ = _extend_at(model, suffix, at, fixed, MAX_LEN + 8)
  paged = PagedKVCache.init(cfg, slots=1, num_pages=1 + PAGES_PER_SEQ, page_size=PAGE,
                            pages_per_seq=PAGES_PER_SEQ, attention=attention, repeat=repeat)  # fmt: skip
  paged = paged.replace(page_table=jnp.arange(1, 1 + PAGES_PER_SEQ, dtype=jnp.int32)[None])
  _, paged = _extend_at(model, prompt, zero, paged, MAX_LEN)
  got, _ = _extend_at(model, suffix, at, paged, MAX_LEN, jnp.asarray([3]))
  np.testing.assert_allclose(got[:, :3], want[:, :3], atol=1e-5)


@nnx.jit
def _extend_live(model, tokens, start, cache, live):
  return model.extend(tokens, start, cache, 16, live=live)


@READS
def test_rows_not_live_read_and_write_no_page(attention, repeat):
  """A 4-token extend of three rows with the middle one not live (its table mapping pages that
  hold NaN): the live rows give the fixed cache's outputs (the ragged program puts them first
  and hands the kernel only those), and no page but the null page changes. With no row live,
  nothing reaches a page either, and the outputs stay finite."""
  cfg = small_cfg(vocab_size=101)
  model = _model(cfg, seed=4)
  rng = np.random.default_rng(5)
  prompt, suffix = (jnp.asarray(rng.integers(1, 100, (B, n))) for n in (6, 4))
  fixed = KVCache.init(cfg, batch=B, max_len=MAX_LEN)
  paged = PagedKVCache.init(
    cfg, slots=B, num_pages=1 + B * PAGES_PER_SEQ, page_size=PAGE, pages_per_seq=PAGES_PER_SEQ,
    attention=attention, repeat=repeat,
  )  # fmt: skip
  table = _scattered_table(paged.num_pages, seed=2)
  paged = paged.replace(page_table=jnp.asarray(table))
  zeros, six = jnp.zeros((B,), jnp.int32), jnp.full((B,), 6, jnp.int32)
  _, fixed = _extend(model, prompt, zeros, fixed)
  want, _ = _extend(model, suffix, six, fixed)
  _, paged = _extend(model, prompt, zeros, paged)
  paged = paged.replace(kv=tuple(p.at[table[1]].set(jnp.nan) for p in paged.kv))
  before = [np.asarray(p) for p in paged.kv]
  live = jnp.asarray([True, False, True])
  got, after = _extend_live(model, suffix, six, paged, live)
  np.testing.assert_allclose(got[0::2], want[0::2], atol=1e-5)
  written = np.zeros(paged.num_pages, bool)
  written[[NULL_PAGE, *table[[0, 2]].ravel()]] = True
  for b, a in zip(before, after.kv, strict=True):  # the idle row's NaN pages are untouched
    np.testing.assert_array_equal(np.asarray(a)[~written], b[~written])
  paged = paged.replace(kv=tuple(p.at[table[1]].set(0.0) for p in paged.kv))
  before = [np.asarray(p) for p in paged.kv]
  got, after = _extend_live(model, suffix, six, paged, jnp.zeros((B,), bool))
  assert np.isfinite(np.asarray(got)).all()
  for b, a in zip(before, after.kv, strict=True):
    np.testing.assert_array_equal(np.asarray(a)[1:], b[1:])
