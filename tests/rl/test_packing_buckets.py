"""Bucketed packing invariants: every sequence once and intact, a handful of static shapes, and
every GRPO group inside one data shard's contiguous block of rows."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asearcher_jax.apps.quickstart import LEARNER_ROW_BUCKETS
from asearcher_jax.model.packing import (
  balanced_partition,
  bucket_rows,
  first_fit_decreasing,
  pack_groups,
  unpack,
)

ROW_LEN = 32


@st.composite
def _batches(draw):
  n_groups = draw(st.integers(1, 10))
  lengths, group_of = [], []
  for g in range(n_groups):
    for _ in range(draw(st.integers(1, 4))):
      lengths.append(draw(st.integers(2, ROW_LEN)))
      group_of.append(g)
  return lengths, group_of, draw(st.sampled_from([1, 2, 4]))


def _seqs(lengths):
  out = []
  for i, n in enumerate(lengths):
    mask = (np.arange(n) >= 1).astype(np.int32)
    out.append({
      "tokens": (np.arange(n) + i) % 50 + 1,
      "loss_mask": mask,
      "logprobs": -np.arange(n, dtype=np.float32) / 10,
      "versions": np.where(mask > 0, i, -1).astype(np.int32),
    })  # fmt: skip
  return out


@settings(deadline=None, max_examples=60)
@given(_batches())
def test_pack_groups_invariants(batch):
  lengths, group_of, shards = batch
  seqs = _seqs(lengths)
  out, placement = pack_groups(seqs, group_of, ROW_LEN, num_shards=shards)
  rows = out["tokens"].shape[0]
  per = rows // shards
  # static shapes: a power of two rows per shard, times the shard count
  assert rows % shards == 0 and per & (per - 1) == 0 and out["tokens"].shape[1] == ROW_LEN
  # every sequence exactly once, intact, with fresh positions and one segment id
  cells = {(r, o + k) for r, o, n in placement for k in range(n)}
  assert len(cells) == sum(lengths)
  for key in ("tokens", "loss_mask", "logprobs", "versions"):
    for s, got in zip(seqs, unpack(out[key], placement), strict=True):
      np.testing.assert_array_equal(got, s[key])
    if key != "tokens":  # tokens are always int32; other fields keep their dtype
      assert out[key].dtype == np.asarray(seqs[0][key]).dtype
  for r, o, n in placement:
    np.testing.assert_array_equal(out["positions"][r, o : o + n], np.arange(n))
    assert len(set(out["segment_ids"][r, o : o + n])) == 1 and out["segment_ids"][r, o] > 0
  assert (out["segment_ids"] > 0).sum() == sum(lengths)
  assert not out["loss_mask"][out["segment_ids"] == 0].any()
  # each group lives in one shard's contiguous block of rows
  for g in set(group_of):
    assert len({placement[i][0] // per for i, gi in enumerate(group_of) if gi == g}) == 1
  # and the bucket is the smallest that holds the fullest shard
  need = max(
    len(first_fit_decreasing([lengths[i] for i, _ in enumerate(lengths)
                              if placement[i][0] // per == s], ROW_LEN))
    for s in range(shards)
  )  # fmt: skip
  assert per == bucket_rows(need, shards, None) // shards


def test_few_static_shapes_over_many_batches():
  rng = np.random.default_rng(0)
  shapes = set()
  for _ in range(50):
    lengths = rng.integers(2, ROW_LEN, rng.integers(4, 40)).tolist()
    group_of = [i // 4 for i in range(len(lengths))]
    out, _ = pack_groups(_seqs(lengths), group_of, ROW_LEN, num_shards=4)
    shapes.add(out["tokens"].shape)
  assert len(shapes) <= 4


def test_explicit_buckets_and_errors():
  seqs = _seqs([30, 30, 30])
  out, _ = pack_groups(seqs, [0, 1, 2], ROW_LEN, num_shards=2, row_buckets=(4, 8, 16))
  assert out["tokens"].shape == (4, ROW_LEN)
  with pytest.raises(ValueError, match="largest bucket"):
    pack_groups(seqs * 3, list(range(9)), ROW_LEN, num_shards=1, row_buckets=(2, 4))
  with pytest.raises(ValueError, match="multiple of num_shards"):
    bucket_rows(1, 4, (6,))
  with pytest.raises(ValueError, match="longer than row_len"):
    pack_groups(_seqs([ROW_LEN + 1]), [0], ROW_LEN)
  # fewer groups than shards: empty shards are all padding
  out, placement = pack_groups(_seqs([5]), [7], ROW_LEN, num_shards=4)
  assert out["tokens"].shape == (4, ROW_LEN) and placement == [(0, 0, 5)]
  assert set(out) == {"tokens", "positions", "segment_ids", "loss_mask", "logprobs", "versions"}


@given(st.lists(st.integers(0, 100), max_size=30), st.integers(1, 5))
def test_balanced_partition_is_a_partition_with_lpt_bound(weights, parts):
  out = balanced_partition(weights, parts)
  assert len(out) == parts
  assert sorted(i for p in out for i in p) == list(range(len(weights)))
  loads = [sum(weights[i] for i in p) for p in out]
  if weights:
    assert max(loads) <= sum(weights) / parts + max(weights)


def test_a_long_horizon_batch_packs_into_the_quickstarts_buckets():
  # 16 episodes of a long chain: each compaction starts a training sequence holding the whole
  # context so far, ~18 sequences of 300-2,100 tokens an episode, in rows of 3,072 tokens (the
  # crash of 2026-11-26 was a batch that needed 78 rows when the buckets stopped at 64).
  rng = np.random.default_rng(0)
  lengths = [int(x) for x in rng.integers(300, 2100, size=16 * 18)]
  group_of = [i // (8 * 18) for i in range(len(lengths))]
  seqs = [{"tokens": np.arange(n) % 97 + 1} for n in lengths]
  batch, placement = pack_groups(seqs, group_of, 3072, row_buckets=LEARNER_ROW_BUCKETS)
  rows = batch["tokens"].shape[0]
  assert rows in LEARNER_ROW_BUCKETS and rows > 64
  assert len(placement) == len(seqs)
  assert np.count_nonzero(batch["tokens"]) == sum(lengths)
  with pytest.raises(ValueError, match="largest bucket is 512"):
    pack_groups(seqs * 6, group_of * 6, 3072, row_buckets=LEARNER_ROW_BUCKETS)
