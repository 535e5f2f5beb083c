"""The versioned weight store (`serving.weights_dir`) on real files: bf16 and float32 round trips,
a trainer's sharding read back into another mesh's sharding (8 fake devices), half-written
versions never read, the pointer replaced atomically, pruning, and gs:// roots routed to epath."""

from __future__ import annotations

import json
import logging
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath
from etils.epath import testing as epath_testing
from flax import nnx

from asearcher_jax.errors import CheckpointError
from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model import transformer
from asearcher_jax.rl.weight_sync import WeightSyncConfig
from asearcher_jax.serving import weights_dir as wd
from tests.model.test_model import small_cfg


def model(seed: int = 0):
  # Sizes divisible by 4 and 8 so every parameter really splits over the meshes below.
  cfg = small_cfg(vocab_size=128, hidden_size=32, intermediate_size=64)
  return transformer.Transformer(cfg, rngs=nnx.Rngs(seed))


def flat(state) -> dict[tuple, np.ndarray]:
  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


def rounded(state) -> dict[tuple, np.ndarray]:
  return {p: np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(x.dtype)) for p, x in flat(state).items()}  # fmt: skip


def test_round_trip_bf16_and_float32(tmp_path):
  m = model()
  _, state = nnx.split(m)
  store16, store32 = wd.WeightStore(tmp_path / "bf16"), wd.WeightStore(tmp_path / "f32")
  store16.publish(m, 1)
  store32.publish(m, 1, dtype=None)
  meta16 = json.loads((tmp_path / "bf16" / "v00000001" / wd.COMMITTED).read_text())
  meta32 = json.loads((tmp_path / "f32" / "v00000001" / wd.COMMITTED).read_text())
  assert meta16["dtype"] == "bfloat16" and meta32["dtype"] == "float32"
  assert meta32["bytes"] == 2 * meta16["bytes"] == sum(x.nbytes for x in flat(state).values())
  # No target: the config's dtype (float32) on device 0, holding the bf16 values.
  got16, got32 = flat(store16.load(1)), flat(store32.load(1))
  want16, want32 = rounded(state), flat(state)
  assert got16.keys() == want32.keys()
  for p in want32:
    assert got32[p].dtype == np.float32 and np.array_equal(got32[p], want32[p]), p
    assert got16[p].dtype == np.float32 and np.array_equal(got16[p], want16[p]), p
  assert any(not np.array_equal(got16[p], want32[p]) for p in want32)  # bf16 really rounds
  # A bf16 target (a bf16 engine) gets bf16 arrays, bit-equal to the cast.
  target = jax.tree.map(lambda x: x.astype(jnp.bfloat16), state)
  for p, v in nnx.to_flat_state(store16.load(1, target)):
    x = v.get_value()
    assert x.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(x), np.asarray(flat(state)[p].astype(jnp.bfloat16)))


def test_each_server_reads_into_its_own_sharding(tmp_path):
  """A trainer on an fsdp=8 mesh publishes; a tensor-parallel server (fsdp=2 x tensor=4) and a
  one-device server each read the same version straight into their own placement."""
  assert len(jax.devices()) == 8
  m = model(seed=3)
  graphdef, state = nnx.split(m)
  trainer_mesh = sharding_lib.make_mesh(fsdp=8)
  sharded = jax.device_put(state, sharding_lib.param_shardings(state, trainer_mesh))
  assert any(not v.get_value().sharding.is_fully_replicated for _, v in nnx.to_flat_state(sharded))
  store = wd.WeightStore(tmp_path / "w")
  store.publish(nnx.merge(graphdef, sharded), 5)

  server_mesh = sharding_lib.make_mesh(fsdp=2, tensor=4)
  want = sharding_lib.param_shardings(state, server_mesh)
  got = store.load(5, want)
  want_flat, ref = dict(nnx.to_flat_state(want)), rounded(state)
  split = 0
  for p, v in nnx.to_flat_state(got):
    x = v.get_value()
    assert x.sharding == want_flat[p], p
    assert x.dtype == jnp.float32 and np.array_equal(np.asarray(x), ref[p]), p
    split += not x.sharding.is_fully_replicated
  assert split >= 10  # embeddings, projections and MLP kernels are really split

  one = jax.sharding.SingleDeviceSharding(jax.devices()[5])
  on_one = store.load(5, jax.tree.map(lambda _: one, state))
  assert all(v.get_value().sharding == one for _, v in nnx.to_flat_state(on_one))
  with pytest.raises(CheckpointError, match="has shape"):
    bad = jax.tree.map(lambda x: jax.ShapeDtypeStruct((3, *x.shape), x.dtype), state)
    store.load(5, bad)


def test_a_half_written_version_is_never_read(tmp_path, caplog):
  """The trainer died after writing v2's arrays but before its commit marker: readers stay on
  v1, refuse v2 by name even when a pointer names it, and the next publish removes it."""
  root = tmp_path / "w"
  store = wd.WeightStore(root)
  store.publish(model(seed=1), 1)
  wd.WeightStore(tmp_path / "other").publish(model(seed=2), 2)
  os.rename(tmp_path / "other" / "v00000002", root / "v00000002")  # arrays complete ...
  (root / "v00000002" / wd.COMMITTED).unlink()  # ... marker never written
  (root / "v00000003" / "params").mkdir(parents=True)  # and one that stopped early

  class Sink:
    def __init__(self) -> None:
      self.updates: list[int] = []

    def update_params(self, params, version, timeout=0.0, *, recompute=None) -> float:
      self.updates.append(version)
      return 0.0

  sink = Sink()
  watcher = wd.DirectoryWeightWatcher(root, sink)
  assert watcher.poll_once() == 1 and watcher.poll_once() is None
  with caplog.at_level(logging.WARNING, logger=wd.__name__):
    assert store.versions() == [1]
  assert "v00000002: no COMMITTED marker" in caplog.text and "v00000003" in caplog.text
  with pytest.raises(CheckpointError, match=r"v00000002 has no COMMITTED marker"):
    store.load(2)
  # Even a pointer naming it (a torn copy of the store) does not get it loaded.
  (root / wd.LATEST).write_text(json.dumps({"version": 2, "path": "v00000002", "time": 9.0}))
  with pytest.raises(CheckpointError, match="half-written"):
    watcher.poll_once()
  assert watcher.version == 1 and sink.updates == [1]
  store.publish(model(seed=4), 4)
  store.prune(keep=4, newest=4)  # v2 and v3 are within keep=4, but abandoned: removed
  assert sorted(p.name for p in root.iterdir()) == [wd.LATEST, "v00000001", "v00000004"]
  assert watcher.poll_once() == 4


def test_the_watcher_loads_into_the_servers_own_params(tmp_path):
  """serve-model hands the watcher its engine's params: every version lands with their sharding
  and dtype (here bf16 on device 5), whatever the trainer's."""
  m = model(seed=6)
  _, state = nnx.split(m)
  five = jax.sharding.SingleDeviceSharding(jax.devices()[5])
  engine_params = jax.device_put(jax.tree.map(lambda x: x.astype(jnp.bfloat16), state), five)
  store = wd.WeightStore(tmp_path)
  store.publish(m, 1, dtype=None)  # float32 in the store

  class Sink:
    params = None

    def update_params(self, params, version, timeout=0.0, *, recompute=None) -> float:
      self.params = params
      return 0.0

  sink = Sink()
  watcher = wd.DirectoryWeightWatcher(tmp_path, sink, shardings=engine_params)
  del engine_params
  assert watcher.poll_once() == 1
  for p, v in nnx.to_flat_state(sink.params):
    x = v.get_value()
    assert x.sharding == five and x.dtype == jnp.bfloat16, p
    assert np.array_equal(np.asarray(x), np.asarray(flat(state)[p].astype(jnp.bfloat16))), p


def test_the_pointer_is_replaced_atomically(tmp_path, monkeypatch):
  """A reader polling while the writer moves the pointer 300 times sees only whole pointers, in
  order; a writer that dies mid-write leaves the previous pointer in place."""
  root = wd.store_path(tmp_path)
  path = root / wd.LATEST
  wd._write_atomic(path, json.dumps({"version": 0, "pad": ""}))
  seen, errors, done = [], [], threading.Event()

  def read():
    while not done.is_set():
      try:
        seen.append(json.loads(path.read_text())["version"])
      except Exception as e:  # any failure is what the test looks for
        errors.append(repr(e))

  reader = threading.Thread(target=read)
  reader.start()
  try:
    for v in range(1, 301):
      wd._write_atomic(path, json.dumps({"version": v, "pad": "x" * (v * 97 % 4000)}))
  finally:
    done.set()
    reader.join(30)
  assert errors == [] and len(seen) > 10
  assert seen == sorted(seen) and set(seen) <= set(range(301)) and len(set(seen)) >= 2
  assert wd.read_latest(tmp_path)["version"] == 300

  def crash(*a):
    raise OSError("disk gone")

  monkeypatch.setattr(wd.os, "replace", crash)
  with pytest.raises(OSError, match="disk gone"):
    wd._write_atomic(path, json.dumps({"version": 301}))
  assert wd.read_latest(tmp_path)["version"] == 300


def test_prune_keeps_the_newest_and_the_pointed_version(tmp_path):
  store = wd.WeightStore(tmp_path)
  m = model()
  for v in range(1, 5):
    store.publish(m, v)
    store.prune(keep=2, newest=v)
  assert store.versions() == [3, 4] and store.latest()["version"] == 4
  # A trainer resumed from v1's checkpoint republishes v1: v1 is rewritten under a new pointer,
  # and pruning counted from v1 deletes nothing the pointer (or a newer run) may still need.
  before = store.latest()["time"]
  store.publish(m, 1)
  store.prune(keep=1, newest=1)
  assert store.versions() == [1, 3, 4]
  assert store.latest()["version"] == 1 and store.latest()["time"] > before
  assert WeightSyncConfig().dtype == "bfloat16"
  with pytest.raises(ValueError, match="dtype"):
    WeightSyncConfig(dtype="bfloat17")


def test_a_gs_url_is_routed_through_epath(tmp_path):
  """gs:// roots stay URLs (not made local paths) and the pointer, markers and listing go through
  epath's backend: here a stand-in backend that maps gs://bucket onto a local directory (the
  arrays themselves go through tensorstore's GCS driver, which needs a bucket)."""
  local = tmp_path / "bucket"
  calls: list[str] = []

  def to_local(p) -> str:
    p = os.fspath(p)
    calls.append(p)
    assert p.startswith("gs://bucket/"), p
    return str(local / p.removeprefix("gs://bucket/"))

  def route(fn_name):
    def fn(original, path, *a, **kw):
      return original(to_local(path), *a, **kw)

    return fn

  root = wd.store_path("gs://bucket/run/weights")
  assert (
    os.fspath(root) == "gs://bucket/run/weights" and wd.version_dir(root, 7).name == "v00000007"
  )
  (local / "run" / "weights" / "v00000007").mkdir(parents=True)
  (local / "run" / "weights" / "v00000008").mkdir(parents=True)
  names = ("open", "exists", "isdir", "listdir", "glob", "mkdir", "makedirs", "remove", "stat")
  with epath_testing.mock_epath(**{n: route(n) for n in names}):
    assert wd.read_latest(root) is None
    wd._write_atomic(root / wd.LATEST, json.dumps({"version": 7, "path": "v00000007", "time": 1}))
    epath.Path("gs://bucket/run/weights/v00000007/COMMITTED").write_text("{}")
    assert wd.read_latest(root)["version"] == 7
    assert wd.versions(root) == [7]  # v8 has no marker
  assert json.loads((local / "run" / "weights" / wd.LATEST).read_text())["version"] == 7
  assert not (local / "run" / "weights" / (wd.LATEST + ".tmp")).exists()
  assert calls and all(c.startswith("gs://bucket/run/weights") for c in calls)


def _publish_from_process(process_id: int, port: int, root: str) -> None:
  """One of two trainer processes (4 CPU devices each) publishing version 2 of `model(seed=3)`
  sharded fsdp=8 over both: each process holds, and writes, only its own shards."""
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
    initialization_timeout=60,
  )  # fmt: skip
  graphdef, state = nnx.split(model(seed=3))
  shardings = dict(nnx.to_flat_state(sharding_lib.param_shardings(state, sharding_lib.make_mesh())))
  flat_state = nnx.to_flat_state(state)
  for p, var in flat_state:
    host = np.asarray(var.get_value())
    var.set_value(jax.make_array_from_callback(host.shape, shardings[p], lambda i, h=host: h[i]))
  assert len(jax.local_devices()) == 4 and len(jax.devices()) == 8
  wd.write_version(root, nnx.merge(graphdef, nnx.from_flat_state(flat_state)), 2, dtype="bfloat16")
  jax.distributed.shutdown()


@pytest.mark.slow  # two jax.distributed processes: 40-100 s on 2 shared cores
def test_two_trainer_processes_write_their_own_shards(tmp_path):
  """A multi-host trainer (2 processes x 4 devices over jax.distributed on 127.0.0.1) publishes
  without gathering: each process writes its own shards, process 0 the marker and pointer; a
  server with all 8 devices reads the version into its tensor-parallel sharding."""
  import socket
  import subprocess
  import sys

  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
         "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.getcwd()}  # fmt: skip
  code = "from tests.serving.test_weights_dir import _publish_from_process as f; "
  procs = []
  for i in range(2):
    argv = [sys.executable, "-c", code + f"f({i}, {port}, {str(tmp_path / 'w')!r})"]
    procs.append(
      subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    )
  try:
    outs = [p.communicate(timeout=240)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
  parts = tmp_path / "w" / "v00000002" / wd.PARTS
  assert sorted(p.name for p in parts.iterdir()) == ["process_0.json", "process_1.json"]
  # Each process wrote its own shards (fsdp=8 over 2 x 4 devices): both wrote pieces.
  pieces = [json.loads((parts / f"process_{i}.json").read_text())["pieces"] for i in (0, 1)]
  assert min(pieces) > 0 and sum(pieces) > len(nnx.to_flat_state(nnx.split(model(seed=3))[1]))
  store = wd.WeightStore(tmp_path / "w")
  assert store.latest()["version"] == 2 and store.versions() == [2]
  _, state = nnx.split(model(seed=3))
  want = sharding_lib.param_shardings(state, sharding_lib.make_mesh(fsdp=2, tensor=4))
  got, ref, want_flat = store.load(2, want), rounded(state), dict(nnx.to_flat_state(want))
  for p, v in nnx.to_flat_state(got):
    assert v.get_value().sharding == want_flat[p] and np.array_equal(
      np.asarray(v.get_value()), ref[p]
    )
