"""A thin Orbax wrapper: named items of one step, async save, keep-N, restore onto a sharding.

An item is either a pytree of arrays (params, optimizer state, a TrainState) or a JSON-able value
(policy version, data cursor, staleness counters, ...); the RL issue adds items without touching
this module. Restoring an array item needs an abstract target (`abstract_like(x)` or
ShapeDtypeStructs with shardings): arrays come back directly with those shardings, so a
checkpoint written on one mesh restores onto another.

Resume order used by the trainers: the run's own directory, then an init checkpoint, then scratch.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from asearcher_jax import storage
from asearcher_jax.errors import CheckpointError

log = logging.getLogger(__name__)
storage.gcs_without_listing_cache()  # every trainer process writes its own parts of a step


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
  """Attributes:
  directory: where step directories are written (local path or gs://...).
  max_to_keep: newest checkpoints kept; None keeps all.
  save_interval_steps: `save(step)` writes only when step % interval == 0 (or force=True).
  async_save: write in a background thread; `wait()` or `close()` blocks until done.
  """

  directory: str
  max_to_keep: int | None = 3
  save_interval_steps: int = 1
  async_save: bool = True

  def __post_init__(self):
    if self.max_to_keep is not None and self.max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 or None, got {self.max_to_keep}")
    if self.save_interval_steps < 1:
      raise ValueError(f"save_interval_steps must be >= 1, got {self.save_interval_steps}")


def _is_json(x: Any) -> bool:
  if x is None or isinstance(x, (bool, int, float, str)):
    return True
  if isinstance(x, (list, tuple)):
    return all(_is_json(v) for v in x)
  if isinstance(x, dict):
    return all(isinstance(k, str) and _is_json(v) for k, v in x.items())
  return False


def abstract_like(tree: Any, shardings: Any = None) -> Any:
  """ShapeDtypeStructs of a pytree of arrays: a restore target.

  Shardings come from the arrays themselves, or from `shardings`, a tree with the same structure
  or a prefix of it (e.g. `sharding.param_shardings(params, mesh)` for an NNX state).
  """

  def one(x, sharding=None):
    sharding = sharding if sharding is not None else getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

  if shardings is None:
    return jax.tree.map(one, tree)
  return jax.tree.map(lambda s, sub: jax.tree.map(lambda x: one(x, s), sub), shardings, tree)


class Checkpointer:
  """Saves and restores named items per step under one directory."""

  def __init__(self, cfg: CheckpointConfig):
    self.cfg = cfg
    directory = cfg.directory
    if "://" not in directory:  # Orbax wants absolute local paths
      directory = str(Path(directory).resolve())
      Path(directory).mkdir(parents=True, exist_ok=True)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=cfg.max_to_keep,
      save_interval_steps=cfg.save_interval_steps,
      enable_async_checkpointing=cfg.async_save,
      create=True,
    )
    self._manager = ocp.CheckpointManager(directory, options=options)
    self._directory = directory
    self.fallbacks: list[tuple[int, str]] = []  # unreadable checkpoints skipped by restore_latest

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, items: Mapping[str, Any], *, force: bool = False) -> bool:
    """Starts saving (async by default); returns whether a checkpoint is written for `step`."""
    if not items:
      raise ValueError("nothing to save")
    args = {
      name: ocp.args.JsonSave(value) if _is_json(value) else ocp.args.StandardSave(value)
      for name, value in items.items()
    }
    try:
      saved = self._manager.save(step, args=ocp.args.Composite(**args), force=force)
    except OSError as e:
      if e.errno != errno.ENOSPC:
        raise
      raise CheckpointError(
        f"checkpoint step {step}: no space left on device under {self.cfg.directory!r}; free "
        f"space and rerun: the run resumes from step {self.latest_step()}"
      ) from e
    if saved:
      log.info("checkpoint step %d: saving %s", step, sorted(items))
    return bool(saved)

  def restore(
    self, targets: Mapping[str, Any], step: int | None = None
  ) -> tuple[int, dict[str, Any]]:
    """Restores the named items of `step` (default: latest).

    `targets` maps item name -> abstract pytree (array items, restored onto its shardings) or
    None (JSON items). Raises CheckpointError if there is no checkpoint or an item is missing.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"no checkpoint in {self.cfg.directory!r}")
    if step not in self.all_steps():
      raise CheckpointError(f"no checkpoint for step {step} in {self.cfg.directory!r}")
    args = {
      name: ocp.args.JsonRestore() if target is None else ocp.args.StandardRestore(target)
      for name, target in targets.items()
    }
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**args))
    except (FileNotFoundError, KeyError, ValueError) as e:
      raise CheckpointError(
        f"cannot restore items {sorted(targets)} of step {step} from {self.cfg.directory!r}: {e}"
      ) from e
    return step, {name: restored[name] for name in targets}

  def restore_part(self, name: str, key: str, target: Any, step: int) -> Any:
    """Only `key` of the array item `name` (a TrainState's "params"), restored as host numpy
    arrays in the dtypes they were saved in; the rest of the item (optimizer state: twice the
    parameters under Adam) is never read. `target` gives the structure and shapes."""
    if step not in self.all_steps():
      raise CheckpointError(f"no checkpoint for step {step} in {self.cfg.directory!r}")
    path = epath.Path(self._directory) / str(step) / name
    restore_args = jax.tree.map(lambda _: ocp.ArrayRestoreArgs(restore_type=np.ndarray), target)
    args = ocp.args.PyTreeRestore(
      item={key: target}, restore_args={key: restore_args}, partial_restore=True
    )
    try:
      with ocp.PyTreeCheckpointer() as ckptr:
        return ckptr.restore(path, args=args)[key]
    except (FileNotFoundError, KeyError, ValueError) as e:
      raise CheckpointError(
        f"cannot restore {name}.{key} of step {step} from {self.cfg.directory!r}: {e}"
      ) from e

  def part_keys(self, name: str, key: str, step: int) -> list[str]:
    """The top-level keys of `key` in the array item `name` of `step`, from the checkpoint's
    metadata (no array is read): which form a tree was saved in, since a partial restore
    against the wrong structure fills what is missing from its target instead of failing."""
    path = epath.Path(self._directory) / str(step) / name
    try:
      with ocp.PyTreeCheckpointer() as ckptr:
        tree = ckptr.metadata(path).item_metadata
      return sorted(tree[key].keys())
    except (FileNotFoundError, KeyError, TypeError, ValueError) as e:
      raise CheckpointError(
        f"cannot read the metadata of {name}.{key} of step {step} from {self.cfg.directory!r}: {e}"
      ) from e

  def restore_latest(self, targets: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
    """Like `restore(targets)`, but a newest checkpoint that cannot be read (a crash or a bad
    disk mid-write, a file gone) is skipped, loudly, for the one before it; each skip is kept
    in `fallbacks` (step, error) so the trainer can report it as a metric."""
    steps = sorted(self.all_steps(), reverse=True)
    for i, step in enumerate(steps):
      try:
        return self.restore(targets, step)
      except Exception as e:  # any damage: Orbax, tensorstore and JSON errors differ
        if i + 1 == len(steps):
          raise CheckpointError(f"no readable checkpoint in {self.cfg.directory!r}: {e}") from e
        kept = self._set_aside(step)
        log.error(
          "checkpoint step %d in %s is unreadable (%s: %s); falling back to step %d (%s)",
          step, self.cfg.directory, type(e).__name__, e, steps[i + 1], kept,
        )  # fmt: skip
        self.fallbacks.append((step, f"{type(e).__name__}: {e}"))
    raise CheckpointError(f"no checkpoint in {self.cfg.directory!r}")

  def _set_aside(self, step: int) -> str:
    """Renames an unreadable step to `<step>.unreadable` (kept for inspection, never deleted: the
    error may have been transient), so the run can write that step again."""
    src = epath.Path(self._directory) / str(step)
    dst, n = src.parent / f"{step}.unreadable", 1
    while dst.exists():
      dst, n = src.parent / f"{step}.unreadable{n}", n + 1
    src.rename(dst)
    self._manager.reload()
    return f"kept as {dst}"

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def saving(self) -> bool:
    """Whether a background save is still being written."""
    return self._manager.is_saving_in_progress()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
