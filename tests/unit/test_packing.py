from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asearcher_jax.model.packing import first_fit_decreasing, pack, unpack


@given(st.lists(st.integers(1, 32), min_size=1, max_size=40))
def test_pack_places_every_sequence_exactly_once(lengths):
  seqs = [{"tokens": np.arange(n) + 1, "loss_mask": np.ones(n, np.float32)} for n in lengths]
  batch, placement = pack(seqs, row_len=32)
  rows = first_fit_decreasing(lengths, 32)
  assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
  for s, got in zip(seqs, unpack(batch["tokens"], placement), strict=True):
    np.testing.assert_array_equal(got, s["tokens"])
  for (r, off, n), _ in zip(placement, seqs, strict=True):
    np.testing.assert_array_equal(batch["positions"][r, off : off + n], np.arange(n))
    assert len(set(batch["segment_ids"][r, off : off + n])) == 1
  assert batch["loss_mask"].sum() == sum(lengths)
  assert (batch["segment_ids"] == 0).sum() == batch["tokens"].size - sum(lengths)


def test_pack_errors_and_fixed_rows():
  with pytest.raises(ValueError, match="longer than row_len"):
    pack([{"tokens": [1] * 9}], row_len=8)
  with pytest.raises(ValueError, match="need 2 rows"):
    pack([{"tokens": [1] * 8}, {"tokens": [1] * 8}], row_len=8, num_rows=1)
  batch, _ = pack([{"tokens": [1, 2]}], row_len=8, num_rows=3)
  assert batch["tokens"].shape == (3, 8)
