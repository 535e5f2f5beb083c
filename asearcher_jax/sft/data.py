"""SFT data: trajectory JSONL files -> training sequences -> fixed-shape packed batches.

Training sequences come from `Trajectory.training_sequences()` (the prefix-merge rule), so SFT
trains on exactly the token ids the expert's engine calls saw and produced, with loss on the
generated tokens only. Batches are [rows_per_batch, row_len] with segment ids and per-segment
positions (`model.packing`), so the jitted step compiles once. Each epoch packs all sequences with
first-fit-decreasing, shuffles the rows with a seed derived from (seed, epoch) and cuts them into
batches: the plan of step k is a pure function of (data, config, k), which is what makes resume
exact without storing a data cursor.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from asearcher_jax.agent.trajectory import Trajectory
from asearcher_jax.model import packing

log = logging.getLogger(__name__)

Seq = dict[str, np.ndarray]  # tokens (int32), loss_mask (float32)
BATCH_KEYS = ("tokens", "positions", "segment_ids", "loss_mask")


def file_sha256(path: str | Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def load_trajectories(paths: str | Path | Sequence[str | Path]) -> list[Trajectory]:
  """Trajectories from JSONL files (one `Trajectory.to_json()` per line; `.gz` allowed)."""
  paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
  if not paths:
    raise ValueError("no trajectory files given")
  out: list[Trajectory] = []
  for path in map(Path, paths):
    if not path.is_file():
      raise FileNotFoundError(f"trajectory file {str(path)!r} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
      for lineno, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          out.append(Trajectory.from_json(json.loads(line)))
        except (json.JSONDecodeError, TypeError, KeyError) as e:
          raise ValueError(f"{path}:{lineno}: not a trajectory: {e}") from e
  return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequenceStats:
  """What became of the trajectories' sequences (reported in the summary)."""

  trajectories: int  # trajectories read
  skipped_trajectories: int  # below min_score or environment failures
  sequences: int  # training sequences kept
  truncated: int  # sequences cut to row_len
  dropped: int  # sequences dropped (too long with "drop", or no generated token left)
  tokens: int  # tokens of the kept sequences
  loss_tokens: int  # generated (loss-masked) tokens of the kept sequences


def to_sequences(
  trajectories: Sequence[Trajectory],
  *,
  row_len: int,
  long_sequences: Literal["truncate", "drop"] = "truncate",
  min_score: float | None = None,
) -> tuple[list[list[Seq]], SequenceStats]:
  """Per trajectory, its training sequences as {tokens, loss_mask}; stats of what was kept.

  The first token of a sequence gets loss_mask 0 (nothing predicts it). Sequences longer than
  row_len keep their first row_len tokens ("truncate") or are dropped ("drop"); sequences left
  without a generated token are dropped. Trajectories with an environment failure, or with a
  score below `min_score` when given, are skipped whole.
  """
  per_traj: list[list[Seq]] = []
  skipped = truncated = dropped = tokens = loss_tokens = 0
  for t in trajectories:
    if t.environment_failure or (min_score is not None and (t.score or 0.0) < min_score):
      skipped += 1
      per_traj.append([])
      continue
    kept: list[Seq] = []
    for s in t.training_sequences():
      ids = np.asarray(s["tokens"], np.int32)
      mask = np.asarray(s["loss_mask"], np.float32).copy()
      mask[:1] = 0.0
      if ids.size > row_len:
        if long_sequences == "drop":
          dropped += 1
          continue
        ids, mask = ids[:row_len], mask[:row_len]
        truncated += 1
      if not mask.any():
        dropped += 1
        continue
      kept.append({"tokens": ids, "loss_mask": mask})
      tokens += ids.size
      loss_tokens += int(mask.sum())
    per_traj.append(kept)
  stats = SequenceStats(
    trajectories=len(trajectories), skipped_trajectories=skipped,
    sequences=sum(len(k) for k in per_traj), truncated=truncated, dropped=dropped,
    tokens=tokens, loss_tokens=loss_tokens,
  )  # fmt: skip
  return per_traj, stats


def split_eval(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
  """(train, eval) trajectory indices: a seeded ceil(fraction * n) held out, at least one when
  fraction > 0 and n >= 2; whole trajectories, so no sequence of an eval episode is trained on."""
  if not 0.0 <= fraction < 1.0:
    raise ValueError(f"eval fraction must be in [0, 1), got {fraction}")
  n_eval = min(max(math.ceil(fraction * n), 1), n - 1) if fraction > 0 and n >= 2 else 0
  order = np.random.default_rng([seed, 0xE7A1]).permutation(n)
  return sorted(order[n_eval:].tolist()), sorted(order[:n_eval].tolist())


def pack_rows(seqs: Sequence[Seq], row_len: int) -> list[list[int]]:
  """Sequence indices per packed row (first-fit-decreasing)."""
  return packing.first_fit_decreasing([len(s["tokens"]) for s in seqs], row_len)


def build_batch(
  seqs: Sequence[Seq], rows: Sequence[Sequence[int]], row_len: int, num_rows: int, pad_id: int
) -> dict[str, np.ndarray]:
  """[num_rows, row_len] arrays of BATCH_KEYS for these rows (empty rows are all padding:
  segment id 0, loss mask 0)."""
  out = {
    "tokens": np.full((num_rows, row_len), pad_id, np.int32),
    "positions": np.zeros((num_rows, row_len), np.int32),
    "segment_ids": np.zeros((num_rows, row_len), np.int32),
    "loss_mask": np.zeros((num_rows, row_len), np.float32),
  }
  for r, members in enumerate(rows):
    row, _ = packing.pack([seqs[i] for i in members], row_len, num_rows=1, pad_id=pad_id)
    for k in BATCH_KEYS:
      out[k][r] = row[k][0]
  return out


class EpochPlan:
  """Batches of one epoch: all sequences packed, rows shuffled by (seed, epoch), then cut into
  batches of rows_per_batch rows (the last one padded with empty rows)."""

  def __init__(
    self, seqs: Sequence[Seq], *, row_len: int, rows_per_batch: int, seed: int, pad_id: int
  ) -> None:
    if not seqs:
      raise ValueError("no training sequences")
    self.seqs = list(seqs)
    self.row_len = row_len
    self.rows_per_batch = rows_per_batch
    self.seed = seed
    self.pad_id = pad_id
    self._epoch: int | None = None
    self._rows: list[list[int]] = []
    # FFD's row count does not depend on the order, so batches per epoch is fixed.
    self.num_rows = len(pack_rows(self.seqs, row_len))
    self.batches_per_epoch = -(-self.num_rows // rows_per_batch)

  def _plan(self, epoch: int) -> None:
    if self._epoch == epoch:
      return
    rng = np.random.default_rng([self.seed, epoch])
    order = rng.permutation(len(self.seqs))  # shuffles which equal-length sequences pair up
    rows = [[int(order[i]) for i in row] for row in pack_rows([self.seqs[i] for i in order],
                                                                self.row_len)]  # fmt: skip
    self._rows = [rows[i] for i in rng.permutation(len(rows))]
    self._epoch = epoch

  def batch(self, step: int) -> tuple[int, dict[str, np.ndarray]]:
    """(epoch, host batch) consumed by optimizer step `step` (0-based)."""
    epoch, i = divmod(step, self.batches_per_epoch)
    self._plan(epoch)
    b = self.rows_per_batch
    rows = self._rows[i * b : (i + 1) * b]
    return epoch, build_batch(self.seqs, rows, self.row_len, b, self.pad_id)


def eval_batches(
  seqs: Sequence[Seq], *, row_len: int, rows_per_batch: int, pad_id: int
) -> list[dict[str, np.ndarray]]:
  """Every eval sequence exactly once, packed into fixed-shape batches."""
  rows = pack_rows(seqs, row_len) if seqs else []
  b = rows_per_batch
  return [build_batch(seqs, rows[i : i + b], row_len, b, pad_id) for i in range(0, len(rows), b)]
