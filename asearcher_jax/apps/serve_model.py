"""`asearcher serve-model`: the policy behind the OpenAI facade (and optionally JetStream gRPC).

A keyword-only function that gin binds; it runs with no gin file at all (a random qwen2-tiny
policy, the packaged tokenizer, a loopback server on a free port), which is what smoke runs and
tests use. Remote rollout workers find the server through its address file.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

from asearcher_jax.apps import rehearsal
from asearcher_jax.errors import AsearcherError, ConfigValueError
from asearcher_jax.model.loading import PolicyConfig, load_policy
from asearcher_jax.serving.driver import Driver, DriverConfig
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.serving.mesh import engine_layout
from asearcher_jax.serving.openai_api import OpenAIServer, OpenAIServerConfig
from asearcher_jax.serving.weights_dir import DirectoryWeightWatcher

log = logging.getLogger(__name__)


def pin_cpus(cpus: Iterable[int]) -> None:
  """Restricts every thread of this process (XLA's pools included) to `cpus` (Linux). Threads
  started later inherit it from the thread that starts them. The kernel silently drops cores
  the process may not use, so the calling thread's mask is read back: a narrower one is an
  error, not a quieter pin. Widening again after a narrower pin is allowed."""
  wanted = set(cpus)
  before = os.sched_getaffinity(0)
  try:
    os.sched_setaffinity(0, wanted)
    got = os.sched_getaffinity(0)
  except (OSError, ValueError, OverflowError) as e:
    got = f"none ({e})"
  if got != wanted:
    os.sched_setaffinity(0, before)
    raise AsearcherError(f"cannot pin to cores {sorted(wanted)}: the kernel granted {got}")
  for tid in os.listdir("/proc/self/task"):
    with contextlib.suppress(ProcessLookupError):  # a thread that just exited
      os.sched_setaffinity(int(tid), wanted)


def write_address(path: Path, addresses: dict[str, str]) -> None:
  """Atomically writes `{"http": "ip:port", "grpc": "ip:port"?, "pid": ...}` to `path`."""
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(json.dumps({**addresses, "pid": os.getpid()}))
  tmp.replace(path)


def serve(
  *,
  policy: PolicyConfig = PolicyConfig(),
  engine: EngineConfig = EngineConfig(),
  driver: DriverConfig = DriverConfig(),
  api: OpenAIServerConfig = OpenAIServerConfig(),
  grpc_port: int | None = None,
  address_file: str | None = None,
  weights_dir: str | None = None,
  weights_poll_s: float = 1.0,
  warmup_modes: tuple[str, ...] = (),
  cpus: tuple[int, ...] = (),
  serve_seconds: float | None = None,
) -> int:
  """Serves the policy until SIGINT/SIGTERM (or for `serve_seconds`); returns the exit code.

  Args:
    policy: the checkpoint (or random architecture and seed) and tokenizer to serve.
    engine: slots, context length, prefill buckets and the engine's mesh (`engine.mesh.tensor`:
      chips the policy is split over).
    driver: the RL driver's settings (request timeout, admission per step).
    api: the OpenAI facade: host (loopback by default, "0.0.0.0" only on a trusted network),
      port (0: a free one), the model id it reports, request timeout and body limits.
    grpc_port: also serve JetStream's gRPC `Orchestrator` on this port (0: a free one); None: no.
    address_file: where to write the bound addresses (JSON: http, grpc, pid); removed at exit.
    weights_dir: a trainer's weight store (`DirectoryWeightPublisher` root: a local directory or
      gs://bucket/dir; disaggregated RL: the trainer and this server are separate programs),
      read into the engine's sharding and dtype: the version its LATEST pointer names is loaded
      before the address is announced, and each one published later is swapped in between
      decode steps; None: the weights never change.
    weights_poll_s: how often to look for a newer version in weights_dir.
    warmup_modes: sampling modes ("greedy", "sample", "truncate") to compile every engine shape
      for before the address is announced, so no request pays a compile; (): compile on demand.
    cpus: the cores this server may use (a trainer on the same host gets the others); (): all.
    serve_seconds: stop after this long (smoke runs and tests); None: until a signal.
  """
  if weights_poll_s <= 0:
    raise ConfigValueError(f"weights_poll_s must be > 0, got {weights_poll_s}")
  bad = set(warmup_modes) - {"greedy", "sample", "truncate"}
  if bad:
    raise ConfigValueError(f"unknown warmup_modes {sorted(bad)}: use greedy, sample, truncate")
  if rehearsal.active():  # `asearcher rehearse`: this server's programs, compiled for its slice
    return rehearsal.serving(
      policy=policy, engine=engine, warmup_modes=warmup_modes, jetstream=grpc_port is not None
    )
  if cpus:
    pin_cpus(cpus)
  # Weights are read (or initialised) straight into the engine's shardings on its mesh.
  layout = functools.partial(engine_layout, mesh_cfg=engine.mesh)
  module, tokenizer, what = load_policy(
    policy.model_dir, policy.model, policy.tokenizer_dir, policy.seed, layout=layout
  )
  eng = Engine.from_model(module, tokenizer, engine)
  log.info("serving %s: %d slots x %d tokens on %s", what, engine.max_slots, engine.max_seq_len,
           _mesh_text(eng))  # fmt: skip
  if warmup_modes:
    seconds = eng.warmup(modes=tuple(warmup_modes), jetstream=grpc_port is not None)
    log.info("compiled the engine in %.1f s", seconds)
  asyncio.run(
    _serve(eng, driver, api, grpc_port, address_file, serve_seconds, weights_dir,
           weights_poll_s)
  )  # fmt: skip
  return 0


def _mesh_text(eng: Engine) -> str:
  platform = next(iter(eng.mesh.devices.flat)).platform
  return f"{eng.mesh.size} {platform} device(s) (tensor={eng.mesh.shape['tensor']})"


async def _serve(
  eng: Engine,
  driver_config: DriverConfig,
  api_config: OpenAIServerConfig,
  grpc_port: int | None,
  address_file: str | None,
  serve_seconds: float | None,
  weights_dir: str | None = None,
  weights_poll_s: float = 1.0,
) -> None:
  stop = asyncio.Event()
  loop = asyncio.get_running_loop()
  for sig in (signal.SIGINT, signal.SIGTERM):
    with contextlib.suppress(NotImplementedError, RuntimeError):
      loop.add_signal_handler(sig, stop.set)
  driver = Driver(eng, driver_config)
  watcher = None
  if weights_dir is not None:
    # Each version is read straight into the engine's own placement and dtype.
    watcher = DirectoryWeightWatcher(
      weights_dir, driver, poll_s=weights_poll_s, shardings=eng.load_params().state
    )
    # A server (re)started mid-run loads the current version before it announces itself, so
    # no request is served by the initial weights under a version they are not.
    try:
      if await asyncio.to_thread(watcher.poll_once) is not None:
        log.info("serving version %d from %s", watcher.version, weights_dir)
    except Exception as e:  # unreadable weights: refuse to serve rather than serve the init
      await asyncio.to_thread(driver.close)
      raise AsearcherError(f"cannot load the published weights in {weights_dir}: {e}") from e
    watcher.start()
  mesh = {
    "tensor": eng.mesh.shape["tensor"],
    "devices": [d.id for d in eng.mesh.devices.flat],
    "kv_heads_per_chip": eng.kv_heads_per_chip,
  }

  def health_extra() -> dict:
    return {"mesh": mesh, **({} if watcher is None else {"weights": watcher.status()})}

  api = OpenAIServer(driver, api_config, health_extra=health_extra)
  grpc_server = None
  addr_path = Path(address_file) if address_file else None
  t0 = time.perf_counter()
  try:
    http_port = await api.start()  # a port taken: one line naming it (http_guard.listen)
    addresses = {"http": f"{api_config.host}:{http_port}"}
    print(f"serve-model: OpenAI API on http://{addresses['http']}/v1", flush=True)
    if grpc_port is not None:
      from asearcher_jax.serving.jetstream_server import GrpcServerConfig, JetStreamGrpcServer

      grpc_server = JetStreamGrpcServer(eng, GrpcServerConfig(host=api_config.host, port=grpc_port))
      try:
        addresses["grpc"] = f"{api_config.host}:{await grpc_server.start()}"
      except OSError as e:
        grpc_server = None
        raise AsearcherError(str(e)) from e
      print(f"serve-model: JetStream gRPC on {addresses['grpc']}", flush=True)
    if addr_path is not None:
      write_address(addr_path, addresses)
    with contextlib.suppress(TimeoutError):
      await asyncio.wait_for(stop.wait(), serve_seconds)
  finally:
    if addr_path is not None:
      with contextlib.suppress(OSError):  # e.g. a directory there: the servers still stop
        addr_path.unlink(missing_ok=True)
    if grpc_server is not None:
      await grpc_server.stop()
    await api.stop()
    if watcher is not None:
      await asyncio.to_thread(watcher.stop)
    await asyncio.to_thread(driver.close)
    print(f"serve-model: stopped after {time.perf_counter() - t0:.0f} s", flush=True)
