"""`asearcher train` killed with SIGKILL at random points, again and again, in one run directory.

Each life is a real process (`python -m asearcher_jax.main train`). A kill lands either early
(somewhere in start-up, restore, compilation or the first step) or after the life has written a
checkpoint of its own (so the run makes progress) plus a random delay: mid-generation, mid-train,
mid-save, mid-commit. Before the next life starts, the checkpoint it will resume from is read, so
its resume log (`rl.inflight.ResumeLog`) can be checked against exactly what was saved: every
resumed episode must replay all of its recorded calls instead of generating them again.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from asearcher_jax.checkpoint import CheckpointConfig, Checkpointer
from asearcher_jax.rl.inflight import RESUME_LOG, read_resume_log
from asearcher_jax.rl.replay import logged_group_ids
from asearcher_jax.rl.rollout import group_item_key

# A CPU-sized `asearcher train` over a byte tokenizer (cheap softmax), group size 2, B = 1,
# the run's own retrieval server on the given index. Episodes of many short generate calls and
# three groups in flight (eta = 3): when one group is trained the others are mid-episode, so a
# checkpoint holds finished calls in their journals. (On a CPU a train step stalls generation,
# so a group admitted as a step starts has done nothing by that step's checkpoint.)
TRAIN_GIN = """
from __gin__ import dynamic_registration
from asearcher_jax.agent import asearcher
from asearcher_jax.model import presets
from asearcher_jax.apps import train as commands
from asearcher_jax.apps import train_config
from asearcher_jax.rl import rollout
from asearcher_jax.rl import staleness
from asearcher_jax.serving import engine

include 'gin/runs/train.gin'

presets.model_config.vocab_size = {vocab}
commands.train.run_dir = "{run_dir}"
commands.train.tokenizer_dir = "{tok_dir}"
commands.train.retrieval_index_dir = "{index_dir}"
commands.train.max_questions = 24
train_config.TrainConfig.train_steps = {steps}
staleness.StalenessConfig.batch_groups = 1
staleness.StalenessConfig.max_staleness = {eta}
staleness.StalenessConfig.max_concurrent = 3
rollout.RolloutConfig.group_size = 2
engine.EngineConfig.max_slots = 6
engine.EngineConfig.max_seq_len = 2048
engine.EngineConfig.prefill_buckets = (1024,)
asearcher.AsearcherAgentConfig.max_tokens = 2048
asearcher.AsearcherAgentConfig.max_new_tokens = 8
asearcher.AsearcherAgentConfig.max_turns = 8
"""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CrashLoopConfig:
  """Attributes:
  kills: SIGKILLs to deliver before the last life runs to the end.
  seed: seeds the kill points.
  early_frac: fraction of kills aimed anywhere in a life's first `early_window_s` (possibly
    before it has restored or trained anything).
  early_window_s: see early_frac.
  journal_frac: fraction of kills aimed after a checkpoint whose in-flight episodes hold finished
    generate calls that the next life will replay (the case resuming from journals is for; with
    generation faster than training most checkpoints find only a fresh group in flight).
  late_delay_s: "late" kills land this long (uniform in [0, late_delay_s]) after the life's own
    first checkpoint; "journal" ones land as soon as such a checkpoint is seen.
  journal_patience: a "journal" kill settles for any new checkpoint once the life has written
    this many without finished calls in flight. Counted in checkpoints, not seconds: on busy
    CI cores a life can take minutes to reach its first checkpoint.
  min_replay_lives: after `kills`, keep killing ("journal" kills) until this many lives have
    replayed calls from their journals, at most `max_extra_kills` more times. Whether a
    checkpoint holds finished calls is timing: when generation outpaces training (a CPU, busy
    cores) most checkpoints find only the group admitted as the step ended, and a journal kill
    falls back to any checkpoint after `journal_patience` of them.
  max_extra_kills: see min_replay_lives.
  final_steps: steps the last life trains past the version it resumes at.
  life_timeout_s: a life that neither checkpoints nor exits within this is a hang (an error).
  """

  kills: int = 10
  seed: int = 0
  early_frac: float = 0.2
  early_window_s: float = 12.0
  journal_frac: float = 0.4
  late_delay_s: float = 4.0
  journal_patience: int = 30
  min_replay_lives: int = 0
  max_extra_kills: int = 8
  final_steps: int = 2
  life_timeout_s: float = 600.0


@dataclasses.dataclass(kw_only=True)
class Life:
  """One process of the run."""

  pid: int
  restored: int | None  # version it resumed at (None: fresh), from its own output
  killed: bool
  kind: str  # "early", "late", "journal" or "final"
  seconds: float
  # The checkpoint this life resumed from: {(group key, episode): recorded calls}.
  saved_calls: dict[tuple[str, int], int] = dataclasses.field(default_factory=dict)
  log: str = ""


def write_gin(path: Path, **fmt: Any) -> Path:
  path.write_text(TRAIN_GIN.format(**fmt))
  return path


def latest_saved_calls(run_dir: Path) -> tuple[int | None, dict[tuple[str, int], int]]:
  """(latest complete checkpoint, recorded calls of each in-flight episode saved in it)."""
  directory = run_dir / "checkpoints"
  if not directory.is_dir():
    return None, {}
  with Checkpointer(CheckpointConfig(directory=str(directory), async_save=False)) as ckpt:
    step = ckpt.latest_step()
    if step is None:
      return None, {}
    _, items = ckpt.restore({"meta": None}, step)
  rollout = items["meta"].get("rollout") or {}
  out = {}
  for g in rollout.get("inflight", ()):
    for i, e in enumerate(g["episodes"]):
      out[(g["key"], i)] = len(e["calls"])
  return step, out


def _checkpoints(run_dir: Path) -> set[int]:
  d = run_dir / "checkpoints"
  return {int(p.name) for p in d.iterdir() if p.name.isdigit()} if d.is_dir() else set()


def run_lives(
  cmd: list[str], run_dir: Path, config: CrashLoopConfig, *, env: dict[str, str], cwd: Path
) -> list[Life]:
  """Kills `cmd` `config.kills` times (plus the extra journal kills of `min_replay_lives`), then
  lets one more life finish `final_steps` steps past where it resumes (`--gin_param` overrides
  train_steps). Raises on a hang or a failed life."""
  rng = random.Random(config.seed)
  lives: list[Life] = []
  logs = run_dir.parent / f"{run_dir.name}-logs"
  logs.mkdir(parents=True, exist_ok=True)
  for n in itertools.count():
    extra = n >= config.kills
    final = extra and (
      replay_lives(run_dir, lives) >= config.min_replay_lives
      or n >= config.kills + config.max_extra_kills
    )
    step, saved = latest_saved_calls(run_dir)
    args = list(cmd)
    if final:
      args.append(
        f"--gin_param=train_config.TrainConfig.train_steps={(step or 0) + config.final_steps}"
      )
    log_path = logs / f"life{n}.log"
    t0 = time.monotonic()
    with open(log_path, "wb") as out:
      proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
      try:
        kind = "final" if final else "journal" if extra else _draw_kind(rng, config)
        if final:
          proc.wait(config.life_timeout_s)
        elif kind == "early":
          _sleep_alive(proc, rng.uniform(0.5, config.early_window_s))
        else:
          patience = config.journal_patience if kind == "journal" else 0
          _wait_checkpoint(proc, run_dir, t0 + config.life_timeout_s, patience=patience)
          # A journal kill lands at once, on the life stopped at its checkpoint: a few seconds
          # later a newer checkpoint, often with no finished calls in flight, would be the one
          # the next life resumes from.
          delay = rng.uniform(0.0, config.late_delay_s)
          _sleep_alive(proc, delay if kind == "late" else 0.0)
        if not final:
          if proc.poll() is not None:
            raise RuntimeError(f"life {n} exited on its own ({proc.returncode}): {log_path}")
          proc.send_signal(signal.SIGKILL)
      finally:
        if proc.poll() is None:  # an error here (or in the caller's timeout) leaves no orphan
          proc.kill()
        proc.wait(30)
    text = log_path.read_text(errors="replace")
    if final and proc.returncode != 0:
      raise RuntimeError(f"the last life failed ({proc.returncode}):\n{text[-3000:]}")
    m = re.search(r"\[train\] resumed at version (\d+)", text)
    lives.append(
      Life(
        pid=proc.pid,
        restored=int(m.group(1)) if m else None,
        killed=not final,
        kind=kind,
        seconds=time.monotonic() - t0,
        saved_calls=saved,
        log=str(log_path),
      )
    )
    if final:
      return lives
  raise AssertionError("unreachable")


def replay_lives(run_dir: Path, lives: list[Life]) -> int:
  """How many of `lives` replayed at least one recorded call (from the run's resume log)."""
  pids = {life.pid for life in lives}
  records = read_resume_log(run_dir / RESUME_LOG)
  return len({r["pid"] for r in records if r["pid"] in pids and r["replayed_calls"]})


def _draw_kind(rng: random.Random, config: CrashLoopConfig) -> str:
  u = rng.random()
  if u < config.early_frac:
    return "early"
  return "journal" if u < config.early_frac + config.journal_frac else "late"


def _wait_checkpoint(proc: subprocess.Popen, run_dir: Path, deadline: float, *, patience: int):
  """Until the life writes a new checkpoint whose in-flight episodes hold finished generate calls
  that the next life will replay, or (after `patience` new checkpoints without; 0: at once) any
  new one. A "journal" return leaves the life stopped (SIGSTOP) for the caller's SIGKILL.

  The life is stopped while its checkpoint is inspected: a group that finishes in the meantime
  is queued in the replay log, and the next life rightly skips its journal instead of replaying
  it (on busy cores that happened to most of them between seeing the checkpoint and the kill)."""
  before = _checkpoints(run_dir)
  seen: set[int] = set()
  inspected: set[int] = set()
  while proc.poll() is None:
    new = sorted(_checkpoints(run_dir) - before)
    seen.update(new)
    if new and len(seen) > patience:
      return
    if new and new[-1] not in inspected and _has_calls(run_dir, new[-1]):
      proc.send_signal(signal.SIGSTOP)
      latest = max(_checkpoints(run_dir))  # stable now: no save is written while stopped
      inspected.add(latest)
      if _replayable_calls(run_dir, latest) > 0:
        return
      proc.send_signal(signal.SIGCONT)
    if time.monotonic() > deadline:
      raise TimeoutError(f"no new checkpoint in {run_dir} before the deadline")
    time.sleep(0.05)


def _replayable_calls(run_dir: Path, step: int) -> int:
  """Finished calls saved in `step` for groups the replay log does not hold yet: the calls the
  next life replays (a queued group is skipped on resume; its result already exists)."""
  logged = {group_item_key(g) for g in logged_group_ids(run_dir / "replay")}
  meta = _read_meta(run_dir, step)
  inflight = (meta.get("rollout") or {}).get("inflight", ())
  return sum(len(e["calls"]) for g in inflight if g["key"] not in logged for e in g["episodes"])


def _read_meta(run_dir: Path, step: int) -> dict[str, Any]:
  """A checkpoint's JSON meta item; {} until it is complete enough to parse."""
  try:
    return json.loads((run_dir / "checkpoints" / str(step) / "meta" / "metadata").read_text())
  except (OSError, ValueError):
    return {}


def _has_calls(run_dir: Path, step: int) -> bool:
  inflight = (_read_meta(run_dir, step).get("rollout") or {}).get("inflight", ())
  return any(e["calls"] for g in inflight for e in g["episodes"])


def _sleep_alive(proc: subprocess.Popen, seconds: float) -> None:
  end = time.monotonic() + seconds
  while time.monotonic() < end and proc.poll() is None:
    time.sleep(0.05)


def resume_evidence(run_dir: Path, lives: list[Life]) -> dict[str, Any]:
  """Matches each life's resume records with the checkpoint it resumed from.

  Returns counts plus `mismatches`: records whose episode was not in that checkpoint, whose
  saved-call count differs from the checkpoint's, or which did not replay every recorded call."""
  records = read_resume_log(run_dir / RESUME_LOG)
  by_pid: dict[int, list[dict]] = {}
  for r in records:
    by_pid.setdefault(r["pid"], []).append(r)
  out = {"lives": len(lives), "kills": sum(x.killed for x in lives), "resumed_episodes": 0,
         "replayed_calls": 0, "saved_calls": 0, "continued_tokens": 0, "lives_with_replays": 0,
         "mismatches": []}  # fmt: skip
  for life in lives:
    mine = by_pid.get(life.pid, [])
    if any(r["replayed_calls"] for r in mine):
      out["lives_with_replays"] += 1
    for r in mine:
      key = (r["group"], r["episode"])
      out["resumed_episodes"] += 1
      out["replayed_calls"] += r["replayed_calls"]
      out["saved_calls"] += r["saved_calls"]
      out["continued_tokens"] += r["continued_tokens"]
      if (
        key not in life.saved_calls
        or life.saved_calls[key] != r["saved_calls"]
        or r["replayed_calls"] != r["saved_calls"]
        or r["diverged"]
      ):
        out["mismatches"].append({**r, "checkpoint_calls": life.saved_calls.get(key)})
  return out


def train_command(gin: Path) -> list[str]:
  return [sys.executable, "-m", "asearcher_jax.main", "train", f"--gin_file={gin}"]


def cpu_env(compile_cache: Path | None = None) -> dict[str, str]:
  """The lives' environment: CPU, and (`compile_cache`) JAX's persistent compilation cache, so
  only the first life compiles, as an operator's restarts would."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  if compile_cache is not None:
    env["JAX_COMPILATION_CACHE_DIR"] = str(compile_cache)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
    # No size bound: one life runs at a time, and a bound makes every write list the directory.
    env["JAX_COMPILATION_CACHE_MAX_SIZE"] = "-1"
  return env
