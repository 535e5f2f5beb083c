"""JAX's persistent compilation cache, on by default for every `asearcher` command.

Every process of this project compiles the same programs again: a resumed run after a crash, the
next seed of a sweep, each host of a pod, the evaluation of a finished run. On 2 CPU cores the
quickstart's engine warm-up is 78 s without the cache and 21 s from it (2026-11-28,
`benchmarks/compile_cache.py`); on an accelerator an engine's warm-up can outlast a short lease.
JAX keeps compiled executables in a directory keyed by the program, the devices, the compile
options and the jax/jaxlib versions, so a hit is the executable the compiler would have produced
(nothing about results changes). JAX's own default writes only programs that took >= 1 s to
compile; most of a small model's ~120 engine programs take less, and together they are most of
the warm-up, so this writes every program (`min_compile_s`).

With `max_size_gb` set, JAX evicts least recently used entries past the size and takes a file
lock around each read and write, which is what makes one directory safe for several processes at
once (a pod's hosts on shared storage, runs side by side on one machine).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import jax

log = logging.getLogger(__name__)

# Overrides `CompileCacheConfig.dir` when that is unset: a directory, or "off" / "" for none.
ENV_DIR = "ASEARCHER_COMPILE_CACHE"
OFF = ("", "off")
# JAX's own variable: where only it is set, JAX's settings are used as they are (the test suite's).
JAX_ENV_DIR = "JAX_COMPILATION_CACHE_DIR"


def default_dir(env: dict[str, str] | None = None) -> Path:
  """$ASEARCHER_HOME/jax_cache, else ~/.cache/asearcher_jax/jax_cache: per user, beside the
  shipped corpus's index (`apps/index.py` keeps that in the same home)."""
  env = os.environ if env is None else env
  home = env.get("ASEARCHER_HOME") or Path.home() / ".cache" / "asearcher_jax"
  return Path(home) / "jax_cache"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileCacheConfig:
  """Where compiled programs are kept between processes."""

  # A directory (local, or any path JAX's epath opens, such as gs://bucket/cache for a pod);
  # "off" or "": no cache; None: $ASEARCHER_COMPILE_CACHE, else $JAX_COMPILATION_CACHE_DIR,
  # else `default_dir()`.
  dir: str | None = None
  # Programs that compiled faster than this are not written. JAX's default is 1 s; the engine's
  # many small programs are most of its warm-up (from the cache: 46 s with 1 s, 21 s with 0, CPU).
  min_compile_s: float = 0.0
  # Least recently used entries are evicted past this size; also turns on JAX's file lock, so
  # concurrent processes can share the directory (each write then lists it: ~10 ms with a
  # thousand entries, only on a miss). The quickstart writes ~11 MB.
  max_size_gb: float = 4.0

  def __post_init__(self):
    if self.min_compile_s < 0:
      raise ValueError(f"CompileCacheConfig.min_compile_s must be >= 0, got {self.min_compile_s}")
    if self.max_size_gb <= 0:
      raise ValueError(f"CompileCacheConfig.max_size_gb must be > 0, got {self.max_size_gb}")

  def resolved_dir(self, env: dict[str, str] | None = None) -> str | None:
    """The directory this config names (None: the cache is off)."""
    env = os.environ if env is None else env
    chosen = self.dir
    if chosen is None:
      chosen = env.get(ENV_DIR, env.get(JAX_ENV_DIR, str(default_dir(env))))
    chosen = chosen.strip()
    if chosen.lower() in OFF:
      return None
    if "://" in chosen:
      return chosen
    return str(Path(chosen).expanduser())


def enable(cfg: CompileCacheConfig, env: dict[str, str] | None = None) -> str | None:
  """Points JAX at the cache `cfg` names (before the first compile, or earlier programs are not
  read from it); returns the directory, or None when the cache is off. Where only JAX's own
  $JAX_COMPILATION_CACHE_DIR names one, JAX's settings are left as its environment made them.
  Raises ValueError, one line, when a local directory cannot be made."""
  env = os.environ if env is None else env
  where = cfg.resolved_dir(env)
  if where is None:
    jax.config.update("jax_compilation_cache_dir", None)
    return None
  if cfg.dir is None and ENV_DIR not in env and JAX_ENV_DIR in env:
    return where
  if "://" not in where:
    try:
      Path(where).mkdir(parents=True, exist_ok=True)
    except OSError as e:
      raise ValueError(
        f"compile cache directory {where!r} cannot be made ({e.strerror}): set "
        f"CompileCacheConfig.dir or ${ENV_DIR} to another directory, or to 'off'"
      ) from None
  jax.config.update("jax_compilation_cache_dir", where)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(cfg.min_compile_s))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no size floor
  jax.config.update("jax_compilation_cache_max_size", int(cfg.max_size_gb * 2**30))
  log.info("compile cache: %s (ASEARCHER_COMPILE_CACHE=off for none)", where)
  return where


def enable_if_asked(env: dict[str, str] | None = None) -> str | None:
  """For scripts whose figures are cold compiles unless told otherwise (benchmarks): the cache
  only where $ASEARCHER_COMPILE_CACHE names one (on a short accelerator lease, a directory an
  earlier call filled and carried back). Returns the directory, or None."""
  env = os.environ if env is None else env
  if ENV_DIR not in env:
    return None
  return enable(CompileCacheConfig(), env)
