"""The weight store on a bucket (a local GCS emulator, tests/gcs_emulator.py): the trainer publishes
to gs://.../weights through tensorstore's GCS driver and epath, a server's watcher reads the newest
version back. What the pod does, with no bucket and no network."""

from __future__ import annotations

import json

import jax
import numpy as np
from etils import epath
from flax import nnx

from asearcher_jax.serving import weights_dir as wd
from tests.serving.test_weights_dir import flat, model, rounded


class _Sink:
  def __init__(self) -> None:
    self.got: list[tuple[int, nnx.State]] = []

  def update_params(self, params, version, timeout=0.0, *, recompute=None) -> float:
    self.got.append((version, params))
    return 0.0


def test_two_versions_published_to_a_bucket_and_the_newest_read_back(gcs_bucket):
  root = f"{gcs_bucket}/run/weights"
  store = wd.WeightStore(root)
  assert store.latest() is None and store.versions() == []
  first, second = model(seed=1), model(seed=2)
  store.publish(first, 1)
  store.publish(second, 2, dtype=None)
  assert store.versions() == [1, 2]
  assert store.latest()["version"] == 2 and store.latest()["path"] == "v00000002"
  marker = json.loads((epath.Path(root) / "v00000002" / wd.COMMITTED).read_text())
  assert marker["dtype"] == "float32"

  sink = _Sink()
  watcher = wd.DirectoryWeightWatcher(root, sink)
  assert watcher.poll_once() == 2 and watcher.poll_once() is None
  [(version, params)] = sink.got
  want = flat(nnx.split(second)[1])
  got = flat(params)
  assert version == 2 and got.keys() == want.keys()
  for p in want:
    assert np.array_equal(got[p], want[p]), p
  # The older version reads back too (bf16 in the store), onto another device.
  five = jax.sharding.SingleDeviceSharding(jax.devices()[5])
  old = store.load(1, jax.tree.map(lambda _: five, nnx.split(first)[1]))
  want1 = rounded(nnx.split(first)[1])
  for p, v in nnx.to_flat_state(old):
    assert v.get_value().sharding == five and np.array_equal(np.asarray(v.get_value()), want1[p])

  # Pruning deletes objects in the bucket; the pointed version stays.
  store.publish(first, 3)
  store.prune(keep=1, newest=3)
  assert store.versions() == [3] and store.latest()["version"] == 3
  assert not (epath.Path(root) / "v00000001").exists()


def test_a_server_that_listed_the_store_sees_what_another_process_publishes(gcs_bucket):
  """gcsfs caches directory listings per process and trusts them for `exists` and for the size
  of a file it opens; only its own writes invalidate them. A server that listed the store (or a
  trainer process that pruned it) must still see the pointer and the versions that another
  process writes, whole."""
  import gcsfs

  root = f"{gcs_bucket}/run/weights"
  store = wd.WeightStore(root)
  store.publish(model(seed=1), 1)
  assert store.versions() == [1]  # lists the root (and the version) in this process
  other = gcsfs.GCSFileSystem(skip_instance_cache=True, token="anon")  # another process
  pointer = {"version": 9, "path": "v00000009", "time": 2.0, "pad": "x" * 200}
  other.pipe(f"{root.removeprefix('gs://')}/v00000009/{wd.COMMITTED}", b"{}")
  other.pipe(f"{root.removeprefix('gs://')}/{wd.LATEST}", json.dumps(pointer).encode())
  assert store.latest() == pointer
  assert store.versions() == [1, 9]
