"""The weight store's read side for a tensor-parallel server: bytes each serving chip reads and
seconds per load, for the layout before (one zarr3 chunk per trainer shard, read one slice after
another) against the layout for the readers (each trainer shard one `sharding_indexed` object of
inner chunks cut to the readers' slices, every slice of a version read at once), side by side in
one run (no arguments; ~1-2 minutes on 2 CPU cores, local disk).

The policy is Qwen2.5-7B's shape at reduced width and depth (28 query and 4 KV heads, vocabulary
and MLP at the same ratios to the hidden size, 4 layers: ~90M parameters, 0.18 GB in bf16),
random init, placed as the trainer holds it: every parameter split over fsdp=8 (8 fake CPU
devices). It is published at bf16 both ways, then loaded into a tensor=4 serve-model's placement
(`serving.mesh.engine_layout`, the first 4 devices):
  * chunk_serial: the layout before, read as the reader before did (`load_version` with its
    reads one synchronous read per device slice, one parameter after another);
  * chunk_parallel: the layout before, read by today's `load_version` (all reads in flight at
    once; tensorstore shares a chunk fetch between slices whose reads overlap in time);
  * laid_out_parallel: `WeightSyncConfig.reader_tensor=4`, read by `load_version`.
Each: median seconds of 3 loads after a warm-up, bytes read (tensorstore's kvstore counters, the
arrays' zarr.json included) per load and per reader chip (a chip's slices read alone: what a
reader holding only that chip fetches), against the chip's own slice bytes; and the publish
seconds of each layout; then the loads again from gs:// on a local GCS emulator (gcs_*: each read
an HTTP round trip). GB = 1e9 bytes. The last line is one JSON object.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import json
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax
import numpy as np
import tensorstore as ts
from flax import nnx

from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model import transformer
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.serving import mesh as mesh_lib
from asearcher_jax.serving import weights_dir as wd

CONFIG = ModelConfig(
  vocab_size=19008, hidden_size=896, intermediate_size=4736, num_layers=4, num_heads=28,
  num_kv_heads=4, max_position_embeddings=256,
)  # fmt: skip
TENSOR = 4
REPEATS = 3
GB = 1e9


def _get(x):
  return x.get_value() if isinstance(x, nnx.Variable) else x


def bytes_read(kvstore: str = "file") -> int:
  got = ts.experimental_collect_matching_metrics(f"/tensorstore/kvstore/{kvstore}/bytes_read")
  return sum(int(m["values"][0].get("value", 0)) for m in got)


def serial_reads(path, wants: dict, timeout_s: float = 600.0) -> dict:
  """The reader before, in `load_version`'s place: one synchronous read per device slice, one
  parameter after another."""
  out = {}
  for name, want in wants.items():
    store = ts.open(wd._array_spec(path / wd.ARRAYS / name), open=True).result()

    def piece(index, store=store, want=want):
      return np.asarray(store[index].read().result()).astype(want.dtype)

    out[name] = jax.make_array_from_callback(want.shape, want.sharding, piece)
  return out


def serial_load(store: wd.WeightStore, where: nnx.State) -> nnx.State:
  parallel = wd._read_arrays
  wd._read_arrays = serial_reads
  try:
    return store.load(1, where)
  finally:
    wd._read_arrays = parallel


def one_chip(version, shardings: nnx.State, chip) -> int:
  """Bytes fetched reading only `chip`'s slices (each one after another)."""
  before = bytes_read()
  for p, s in nnx.to_flat_state(shardings):
    s = s.get_value() if isinstance(s, nnx.Variable) else s
    store = ts.open(wd._array_spec(version / wd.ARRAYS / ".".join(map(str, p))), open=True)
    store = store.result()
    store[s.devices_indices_map(tuple(store.shape))[chip]].read().result()
  return bytes_read() - before


def timed(load, kvstore: str = "file") -> tuple[float, int]:
  load()  # warm-up
  seconds, fetched = [], []
  for _ in range(REPEATS):
    before = bytes_read(kvstore)
    t0 = time.perf_counter()
    jax.block_until_ready(load())
    seconds.append(time.perf_counter() - t0)
    fetched.append(bytes_read(kvstore) - before)
  return statistics.median(seconds), int(statistics.median(fetched))


def through_a_bucket(m: transformer.Transformer, where: nnx.State) -> dict:
  """The same loads from gs:// on a local GCS emulator (tests/gcs_emulator.py: fake-gcs-server on
  loopback, tensorstore's GCS driver): every read an HTTP round trip, as on a pod, without the
  network's latency. {} where the emulator is not installed."""
  try:
    from tests import gcs_emulator
  except ImportError:
    return {}
  out = {}
  with gcs_emulator.running() as emulator:
    bucket = emulator.create_bucket("weight-store-bench")
    for layout, reader_tensor in (("chunk", 1), ("laid_out", TENSOR)):
      store = wd.WeightStore(f"{bucket}/{layout}")
      store.publish(m, 1, reader_tensor=reader_tensor)
      legs = {"parallel": lambda store=store: store.load(1, where)}
      if layout == "chunk":
        legs["serial"] = lambda store=store: serial_load(store, where)
      for how, load in legs.items():
        seconds, fetched = timed(load, "gcs")
        out[f"gcs_{layout}_{how}_load_s"] = seconds
        out[f"gcs_{layout}_{how}_read_gb"] = fetched / GB
  return out


def main() -> dict:
  m = transformer.Transformer(CONFIG, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(m)
  trainer_mesh = sharding_lib.make_mesh(fsdp=8)
  state = jax.device_put(state, sharding_lib.param_shardings(state, trainer_mesh))
  m = nnx.merge(graphdef, state)
  mesh, rules = mesh_lib.engine_layout(CONFIG, mesh_lib.ServingMeshConfig(tensor=TENSOR))
  where = sharding_lib.param_shardings(state, mesh, rules)
  chip = mesh.devices.flat[1]
  own = sum(
    int(np.prod(_get(sv).shard_shape(x.get_value().shape))) * 2
    for (_, x), (_, sv) in zip(nnx.to_flat_state(state), nnx.to_flat_state(where), strict=True)
  )
  stored = sum(x.get_value().size * 2 for _, x in nnx.to_flat_state(state))
  out: dict = {
    "params": sum(x.get_value().size for _, x in nnx.to_flat_state(state)),
    "stored_gb": stored / GB,
    "tensor": TENSOR,
    "own_slice_gb_per_chip": own / GB,
  }
  with tempfile.TemporaryDirectory() as tmp:
    for layout, reader_tensor in (("chunk", 1), ("laid_out", TENSOR)):
      store = wd.WeightStore(os.path.join(tmp, layout))
      t0 = time.perf_counter()
      store.publish(m, 1, reader_tensor=reader_tensor)
      out[f"{layout}_publish_s"] = time.perf_counter() - t0
      version = wd.version_dir(store.root, 1)
      out[f"{layout}_one_chip_gb"] = one_chip(version, where, chip) / GB
      legs = {"parallel": lambda store=store: store.load(1, where)}
      if layout == "chunk":
        legs["serial"] = lambda store=store: serial_load(store, where)
      for how, load in legs.items():
        seconds, fetched = timed(load)
        out[f"{layout}_{how}_load_s"] = seconds
        out[f"{layout}_{how}_read_gb"] = fetched / GB
        out[f"{layout}_{how}_read_gb_per_chip"] = fetched / TENSOR / GB
  out.update(through_a_bucket(m, where))
  out["read_ratio_before_over_after"] = (
    out["chunk_serial_read_gb"] / out["laid_out_parallel_read_gb"]
  )
  out["load_speedup"] = out["chunk_serial_load_s"] / out["laid_out_parallel_load_s"]
  return out


if __name__ == "__main__":
  print(json.dumps(main()), flush=True)
