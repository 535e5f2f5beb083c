"""What a recipe's checkpoints and published weight versions cost: bytes, seconds, storage.

A checkpoint holds the train state: fp32 master weights and Adam's two fp32 moments, 12 bytes a
parameter (the bf16 compute copy and the gradients are never saved); a published weight version
holds the parameters in the publish dtype (bf16: 2 bytes). Every trainer host writes its own
shards in parallel (Orbax for checkpoints, tensorstore for weight versions), so a write takes
size / (hosts x per-host bandwidth). Checkpoints are written asynchronously: the trainer waits
only for the device->host copy, so what matters is that one checkpoint's write finishes well
within the `every` steps before the next (`write_fraction_of_interval` < 1), and how much the
kept checkpoints and versions occupy in the bucket.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointPlan:
  """A recipe's checkpoint policy and the bandwidth its cost is stated at."""

  # Steps between checkpoints (the recipe's TrainConfig.checkpoint_every).
  every: int = 10
  # Checkpoints kept (TrainConfig.checkpoints_kept; older ones are deleted).
  keep: int = 2
  # Weight versions kept in the store (WeightSyncConfig.keep_versions).
  versions_kept: int = 2
  # Bytes a parameter takes in a checkpoint: fp32 master (4) + Adam's fp32 mu and nu (8).
  state_bytes_per_param: float = 12.0
  # Bytes a parameter takes in a published version (WeightSyncConfig.dtype bfloat16: 2).
  weight_bytes_per_param: float = 2.0
  # Sustained write bandwidth of one trainer host to the bucket, GB/s (assumed: ~1 GB/s is
  # what one VM's parallel GCS uploads reach without tuning; measure yours and bind it).
  host_write_gb_s: float = 1.0
  # Chips per trainer host (v4 / v5p: 4).
  chips_per_host: int = 4

  def __post_init__(self):
    for name in ("every", "keep", "versions_kept", "chips_per_host"):
      if getattr(self, name) < 1:
        raise ValueError(f"CheckpointPlan.{name} must be >= 1, got {getattr(self, name)}")
    if self.host_write_gb_s <= 0:
      raise ValueError(f"CheckpointPlan.host_write_gb_s must be > 0, got {self.host_write_gb_s}")


def checkpoint_cost(
  num_params: int, policy: CheckpointPlan, *, trainer_chips: int, step_s: float
) -> dict[str, float]:
  """GB, seconds and bucket storage of `policy` for a model of `num_params` parameters trained
  on `trainer_chips` chips at `step_s` seconds a step (the trainer's wall time per step)."""
  hosts = max(1, math.ceil(trainer_chips / policy.chips_per_host))
  bandwidth = hosts * policy.host_write_gb_s
  ckpt_gb = num_params * policy.state_bytes_per_param / 1e9
  version_gb = num_params * policy.weight_bytes_per_param / 1e9
  write_s = ckpt_gb / bandwidth
  interval_s = policy.every * step_s  # also the most training a crash can lose
  return {
    "every_steps": policy.every,
    "kept": policy.keep,
    "checkpoint_gb": round(ckpt_gb, 1),
    "checkpoint_write_s": round(write_s, 1),
    "weights_version_gb": round(version_gb, 1),
    "weights_write_s": round(version_gb / bandwidth, 1),
    "write_gb_s": round(bandwidth, 2),
    "interval_s": round(interval_s, 1),
    "write_fraction_of_interval": round(write_s / max(interval_s, 1e-9), 3),
    "storage_gb": round(policy.keep * ckpt_gb + policy.versions_kept * version_gb, 1),
  }
