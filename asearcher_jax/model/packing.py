"""Packing variable-length sequences into fixed-shape rows (segment ids + per-segment positions).

Fixed [rows, row_len] shapes keep the jitted step compiled once; first-fit-decreasing keeps the
padding small. Each sequence stays whole in one row, so attention masks by segment are exact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def first_fit_decreasing(lengths: Sequence[int], row_len: int) -> list[list[int]]:
  """Assigns sequence indices to rows of capacity row_len (longest first, first row that fits)."""
  rows: list[list[int]] = []
  free: list[int] = []
  for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
    n = lengths[i]
    if n > row_len:
      raise ValueError(f"sequence {i} has {n} tokens, longer than row_len={row_len}")
    for r, space in enumerate(free):
      if n <= space:
        rows[r].append(i)
        free[r] -= n
        break
    else:
      rows.append([i])
      free.append(row_len - n)
  return rows


def pack(
  sequences: Sequence[Mapping[str, Sequence]],
  row_len: int,
  *,
  num_rows: int | None = None,
  pad_id: int = 0,
) -> tuple[dict[str, np.ndarray], list[tuple[int, int, int]]]:
  """Packs sequences (each a dict with "tokens" and optional per-token fields) into rows.

  Returns the batch (tokens, positions, segment_ids [1-based, 0 = padding], and every extra
  per-token field, zero-padded) and, per input sequence, its (row, offset, length) placement.
  num_rows pads the batch to a fixed number of rows (an error if more are needed).
  """
  lengths = [len(s["tokens"]) for s in sequences]
  rows = first_fit_decreasing(lengths, row_len)
  n_rows = num_rows if num_rows is not None else max(len(rows), 1)
  if len(rows) > n_rows:
    raise ValueError(
      f"{len(sequences)} sequences need {len(rows)} rows of {row_len}, have {n_rows}"
    )
  fields = sorted({k for s in sequences for k in s} - {"tokens"})
  out = {
    "tokens": np.full((n_rows, row_len), pad_id, np.int32),
    "positions": np.zeros((n_rows, row_len), np.int32),
    "segment_ids": np.zeros((n_rows, row_len), np.int32),
  }
  for k in fields:
    dtype = np.asarray(sequences[0][k]).dtype if k in sequences[0] else np.float32
    out[k] = np.zeros((n_rows, row_len), dtype)
  placement: list[tuple[int, int, int]] = [(0, 0, 0)] * len(sequences)
  for r, members in enumerate(rows):
    offset = 0
    for seg, i in enumerate(members, 1):
      n = lengths[i]
      out["tokens"][r, offset : offset + n] = sequences[i]["tokens"]
      out["positions"][r, offset : offset + n] = np.arange(n)
      out["segment_ids"][r, offset : offset + n] = seg
      for k in fields:
        if k in sequences[i]:
          out[k][r, offset : offset + n] = sequences[i][k]
      placement[i] = (r, offset, n)
      offset += n
  return out, placement


def unpack(values: np.ndarray, placement: Sequence[tuple[int, int, int]]) -> list[np.ndarray]:
  """Per-sequence slices of a packed [rows, row_len] array, in input order."""
  return [values[r, off : off + n] for r, off, n in placement]


# --- static token-budget buckets, with GRPO groups kept on one data shard ---------------------


def balanced_partition(weights: Sequence[int], num_parts: int) -> list[list[int]]:
  """Indices split into num_parts lists, heaviest first onto the lightest part (LPT greedy);
  ties go to the lowest part, and each part keeps its indices in ascending order."""
  if num_parts < 1:
    raise ValueError(f"num_parts must be >= 1, got {num_parts}")
  parts: list[list[int]] = [[] for _ in range(num_parts)]
  load = [0] * num_parts
  for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
    p = min(range(num_parts), key=lambda p: (load[p], len(parts[p]), p))
    parts[p].append(i)
    load[p] += weights[i]
  return [sorted(p) for p in parts]


def bucket_rows(rows_per_shard: int, num_shards: int, row_buckets: Sequence[int] | None) -> int:
  """Total rows of the smallest bucket giving every shard at least rows_per_shard rows.

  row_buckets are allowed total row counts (each a multiple of num_shards); None means powers of
  two per shard (1, 2, 4, ...) times num_shards, so jit sees O(log) distinct shapes.
  """
  need = max(rows_per_shard, 1)
  if row_buckets is None:
    return (1 << (need - 1).bit_length()) * num_shards
  for b in sorted(row_buckets):
    if b % num_shards:
      raise ValueError(f"row bucket {b} is not a multiple of num_shards={num_shards}")
    if b // num_shards >= need:
      return b
  raise ValueError(
    f"batch needs {need} rows per shard x {num_shards} shards, largest bucket is "
    f"{max(row_buckets)} rows: add a bucket or split the batch into more minibatches"
  )


def pack_groups(
  sequences: Sequence[Mapping[str, Sequence]],
  group_of: Sequence[int],
  row_len: int,
  *,
  num_shards: int = 1,
  row_buckets: Sequence[int] | None = None,
  pad_id: int = 0,
) -> tuple[dict[str, np.ndarray], list[tuple[int, int, int]]]:
  """Packs sequences into a bucketed [rows, row_len] batch with every group on one data shard.

  Whole groups (sequences with equal `group_of`) are balanced over num_shards by token count,
  then first-fit-decreasing packs each shard into the same number of rows; shard s owns the
  contiguous rows [s * R, (s + 1) * R), which is exactly the block a batch dim sharded over
  (data, fsdp) puts on that shard. Returns what `pack` returns (placement rows are global).
  """
  if len(group_of) != len(sequences):
    raise ValueError(f"{len(group_of)} group ids for {len(sequences)} sequences")
  lengths = [len(s["tokens"]) for s in sequences]
  groups = sorted(set(group_of))
  members = {g: [i for i, gi in enumerate(group_of) if gi == g] for g in groups}
  weights = [sum(lengths[i] for i in members[g]) for g in groups]
  shard_seqs = [
    sorted(i for gi in part for i in members[groups[gi]])
    for part in balanced_partition(weights, num_shards)
  ]
  rows_needed = max(
    (len(first_fit_decreasing([lengths[i] for i in idx], row_len)) for idx in shard_seqs),
    default=1,
  )
  per_shard = bucket_rows(rows_needed, num_shards, row_buckets) // num_shards
  packed = [
    pack([sequences[i] for i in idx], row_len, num_rows=per_shard, pad_id=pad_id)
    for idx in shard_seqs
  ]
  template = next(b for (b, _), idx in zip(packed, shard_seqs) if idx) if sequences else None
  parts = []
  for batch, _ in packed:
    if template is not None:
      for k, v in template.items():
        if k not in batch:
          batch[k] = np.zeros((per_shard, row_len), v.dtype)
    parts.append(batch)
  out = {k: np.concatenate([p[k] for p in parts], axis=0) for k in parts[0]}
  placement: list[tuple[int, int, int]] = [(0, 0, 0)] * len(sequences)
  for s, ((_, place), idx) in enumerate(zip(packed, shard_seqs)):
    for local, i in enumerate(idx):
      r, off, n = place[local]
      placement[i] = (s * per_shard + r, off, n)
  return out, placement
