"""Process bootstrap for multi-host runs, and the few cross-process primitives the trainer needs.

A JAX program on a TPU pod is one process per host; every process must call
`jax.distributed.initialize` before it touches a device, and every jitted computation over a
global mesh must then be launched by all of them. `initialize` is called once by `main.py`
(before the subcommand runs) from a `DistributedConfig` that gin or the environment fills in:
on a Cloud TPU VM nothing needs setting (JAX finds its peers from the TPU metadata); on CPU or
GPU hosts the coordinator address, process count and process id come from
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID. With none of that, the program
stays a single process and nothing is initialised.

Process 0 is the lead: it owns the rollout controller, the replay queue and every file written
once per run (metrics, replay journal, HF exports). `broadcast_bytes` is how it hands the other
processes what they must agree on (each training batch), and `agree` how they stop together.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import numpy as np

log = logging.getLogger(__name__)

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_LOCAL_DEVICES = "ASEARCHER_LOCAL_DEVICE_COUNT"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
  """How this process joins a multi-process JAX program; every unset field falls back to its
  environment variable (named in the comment), and a config with nothing set is one process."""

  # host:port of process 0's coordination service (JAX_COORDINATOR_ADDRESS); None on one
  # process, or on a TPU VM where JAX finds it from the metadata server.
  coordinator_address: str | None = None
  # Processes in the program (JAX_NUM_PROCESSES); None: 1, or auto-detected on TPU.
  num_processes: int | None = None
  # This process's index, 0 = the lead (JAX_PROCESS_ID); None: 0, or auto-detected on TPU.
  process_id: int | None = None
  # Fake CPU devices per process (ASEARCHER_LOCAL_DEVICE_COUNT), for simulating a pod on one
  # machine; sets XLA's host device count, so it must be applied before jax starts its backend.
  local_device_count: int | None = None
  # "auto": initialise on a Cloud TPU VM even with nothing set (JAX's own cluster detection);
  # "never": stay single-process unless an address is given.
  tpu_autodetect: str = "auto"
  # Longest wait for every process to join, in seconds.
  initialization_timeout_s: int = 300
  # A process silent this long is declared dead and every other process aborts (a dead lead is
  # noticed at once: its coordination service goes with it). Measured on CPU: a SIGKILLed
  # follower takes the lead down ~66 s later with the default; the lead's death, < 1 s.
  heartbeat_timeout_s: int = 100
  # JAX's preemption service: it traps SIGTERM so that a program can stop at a
  # `multihost_utils.reached_preemption_sync_point`. Nothing here calls one, so on (JAX's
  # default) it only made SIGTERM a no-op for every process of a multi-process trainer, and
  # `launch stop` had to wait for its SIGKILL fallback; off, SIGTERM ends the process as it does
  # a single-process one (resume picks up from the last committed checkpoint).
  preemption_service: bool = False

  def __post_init__(self):
    if self.num_processes is not None and self.num_processes < 1:
      raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
    if self.process_id is not None and self.process_id < 0:
      raise ValueError(f"process_id must be >= 0, got {self.process_id}")
    if self.local_device_count is not None and self.local_device_count < 1:
      raise ValueError(f"local_device_count must be >= 1, got {self.local_device_count}")
    if self.tpu_autodetect not in ("auto", "never"):
      raise ValueError(f"tpu_autodetect must be 'auto' or 'never', got {self.tpu_autodetect!r}")
    if self.initialization_timeout_s <= 0 or self.heartbeat_timeout_s <= 0:
      raise ValueError("initialization_timeout_s and heartbeat_timeout_s must be > 0")

  def resolved(self, env: dict[str, str] | None = None) -> DistributedConfig:
    """This config with unset fields taken from the environment."""
    env = os.environ if env is None else env

    def num(name: str, value: int | None) -> int | None:
      if value is not None or not env.get(name):
        return value
      try:
        return int(env[name])
      except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None

    return dataclasses.replace(
      self,
      coordinator_address=self.coordinator_address or env.get(ENV_COORDINATOR) or None,
      num_processes=num(ENV_NUM_PROCESSES, self.num_processes),
      process_id=num(ENV_PROCESS_ID, self.process_id),
      local_device_count=num(ENV_LOCAL_DEVICES, self.local_device_count),
    )

  @property
  def multi_process(self) -> bool:
    return (self.num_processes or 1) > 1


def _on_tpu_vm() -> bool:
  """A Cloud TPU VM (libtpu installed and TPU devices present), without starting a backend."""
  if os.environ.get("JAX_PLATFORMS", "").strip() not in ("", "tpu"):
    return False
  return any(os.path.exists(p) for p in ("/dev/accel0", "/dev/vfio/0"))


def _set_host_device_count(n: int) -> None:
  flags = [
    f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f
  ]
  os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])


def initialize(config: DistributedConfig = DistributedConfig()) -> DistributedConfig:
  """Joins the multi-process program `config` (resolved from the environment) describes, or
  does nothing for a single process; returns the resolved config. Idempotent: a second call
  after the first initialised is a no-op. Must run before anything creates a jax array."""
  cfg = config.resolved()
  if cfg.local_device_count is not None:
    _set_host_device_count(cfg.local_device_count)
  if jax.distributed.is_initialized():
    return cfg
  if cfg.multi_process or cfg.coordinator_address:
    missing = [
      name for name, v in (("coordinator_address", cfg.coordinator_address),
                           ("num_processes", cfg.num_processes), ("process_id", cfg.process_id))
      if v is None
    ]  # fmt: skip
    if missing:
      raise ValueError(
        f"DistributedConfig: {', '.join(missing)} unset (or {ENV_COORDINATOR}, "
        f"{ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}): a multi-process run needs all three"
      )
    if cfg.process_id >= cfg.num_processes:
      raise ValueError(f"process_id {cfg.process_id} >= num_processes {cfg.num_processes}")
    jax.config.update("jax_enable_preemption_service", cfg.preemption_service)
    jax.distributed.initialize(
      coordinator_address=cfg.coordinator_address,
      num_processes=cfg.num_processes,
      process_id=cfg.process_id,
      initialization_timeout=cfg.initialization_timeout_s,
      heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
    )
  elif cfg.tpu_autodetect == "auto" and _on_tpu_vm():
    jax.config.update("jax_enable_preemption_service", cfg.preemption_service)
    jax.distributed.initialize(
      initialization_timeout=cfg.initialization_timeout_s,
      heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
    )
  else:
    return cfg
  log.info(
    "jax.distributed: process %d of %d, %d local / %d global devices",
    jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count(),
  )  # fmt: skip
  return cfg


def is_lead() -> bool:
  """Whether this is process 0 (the one that writes run-wide files)."""
  return jax.process_index() == 0


def multi_process() -> bool:
  return jax.process_count() > 1


def _bucket(n: int) -> int:
  """Payload sizes are padded to powers of two (>= 4 KiB) so the broadcast compiles a handful of
  shapes, not one per batch."""
  return max(4096, 1 << (max(n, 1) - 1).bit_length())


def broadcast_bytes(payload: bytes | None) -> bytes:
  """Process 0's `payload` on every process (others pass None). Collective: every process must
  call it, in the same order. Runs over the devices' own links (ICI / DCN on a pod, gloo on
  CPU), so batches of any size travel; one process alone gets its payload back."""
  if not multi_process():
    if payload is None:
      raise ValueError("broadcast_bytes: the lead must pass its payload")
    return payload
  from jax.experimental import multihost_utils

  lead = is_lead()
  if lead and payload is None:
    raise ValueError("broadcast_bytes: the lead must pass its payload")
  n = int(
    multihost_utils.broadcast_one_to_all(np.asarray([len(payload) if lead else 0], np.int32))[0]
  )
  buf = np.zeros(_bucket(n), np.uint8)
  if lead:
    buf[:n] = np.frombuffer(payload, np.uint8)
  out = multihost_utils.broadcast_one_to_all(buf)
  return np.asarray(out[:n], np.uint8).tobytes()


def agree(value: int) -> int:
  """Process 0's integer on every process: decisions taken on the lead alone (stop on a time
  budget, a failed batch) become the same decision everywhere."""
  if not multi_process():
    return int(value)
  from jax.experimental import multihost_utils

  return int(multihost_utils.broadcast_one_to_all(np.asarray([value], np.int32))[0])


def gather_to_host(tree):
  """Every array of `tree` as a full numpy array on every process (`process_allgather`), for
  writers that need whole tensors (HF exports); arrays a process already holds whole are just
  fetched, so one process never takes part in a collective."""
  from jax.experimental import multihost_utils

  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))

  return jax.tree.map(one, tree)


# --- coordination-service primitives (safe from any thread) ------------------------------------
# `broadcast_bytes`, `agree` and Orbax's default barriers are XLA collectives: every process
# must launch them in the same order as every other collective, so they belong on the
# trainer's thread. These go through the coordination service's key-value store instead, never
# through the devices: a writer thread may wait on them while the train step's collectives run.


def _client():
  from jax._src import distributed as jax_distributed

  client = jax_distributed.global_state.client
  if client is None:
    raise RuntimeError("jax.distributed is not initialised: no coordination service to use")
  return client


def kv_barrier(key: str, timeout_s: float) -> None:
  """Waits until every process reached barrier `key` (unique per use), at most `timeout_s`
  seconds (then raises TimeoutError naming it); one process returns at once."""
  if not multi_process():
    return
  try:
    _client().wait_at_barrier(key, max(1, int(timeout_s * 1000)))
  except Exception as e:  # XlaRuntimeError DEADLINE_EXCEEDED, or a peer that died
    raise TimeoutError(
      f"barrier {key!r}: not every process arrived within {timeout_s:g} s ({e})"
    ) from e


def kv_set(key: str, value: str) -> None:
  """Publishes `value` under `key` for every process (written once)."""
  _client().key_value_set(key, value)


def kv_get(key: str, timeout_s: float) -> str | None:
  """The value set under `key`, waiting at most `timeout_s` seconds; None if none came."""
  try:
    return _client().blocking_key_value_get(key, max(1, int(timeout_s * 1000)))
  except Exception as e:
    if "DEADLINE_EXCEEDED" in str(e) or "deadline" in str(e).lower():
      return None
    raise
