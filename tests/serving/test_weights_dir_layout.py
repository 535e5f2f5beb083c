"""The weight store's layout for its readers (8 fake devices): a trainer sharded over fsdp=8
publishes for servers split over tensor=4; each server reads identical arrays and fetches its own
slices' bytes, not the whole trainer chunks its slices cut across (which the layout before, one
chunk per trainer shard, makes it read, and which still loads), and stores written before that
(chunk per shard, and the Orbax `params/` checkpoint) still load. Bytes are tensorstore's own
kvstore counters."""

from __future__ import annotations

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from etils import epath
from flax import nnx

from asearcher_jax.errors import CheckpointError
from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model import transformer
from asearcher_jax.model.config import to_hf_config
from asearcher_jax.serving import mesh as mesh_lib
from asearcher_jax.serving import weights_dir as wd
from tests.model.test_model import small_cfg
from tests.serving.test_weights_dir import flat, rounded

TENSOR = 4


def model(seed: int = 0) -> transformer.Transformer:
  # Wide enough that array bytes dwarf the metadata; every dimension divides by 4 and 8.
  cfg = small_cfg(vocab_size=512, hidden_size=128, intermediate_size=256, num_heads=8, num_kv_heads=4)  # fmt: skip
  return transformer.Transformer(cfg, rngs=nnx.Rngs(seed))


def bytes_read(kvstore: str) -> int:
  got = ts.experimental_collect_matching_metrics(f"/tensorstore/kvstore/{kvstore}/bytes_read")
  return sum(int(m["values"][0].get("value", 0)) for m in got)


def trained(m: transformer.Transformer) -> transformer.Transformer:
  """`m` placed as the trainer holds it: every parameter split over fsdp=8."""
  graphdef, state = nnx.split(m)
  mesh = sharding_lib.make_mesh(fsdp=8)
  return nnx.merge(graphdef, jax.device_put(state, sharding_lib.param_shardings(state, mesh)))


def serving_shardings(m: transformer.Transformer) -> nnx.State:
  """Where a serve-model over TENSOR chips keeps `m`'s weights (its engine's rules)."""
  mesh, rules = mesh_lib.engine_layout(m.cfg, mesh_lib.ServingMeshConfig(tensor=TENSOR))
  return sharding_lib.param_shardings(nnx.split(m)[1], mesh, rules)


def json_bytes(version: epath.Path) -> int:
  """Bytes of the arrays' metadata (each zarr.json is read once by tensorstore)."""
  return sum(len(p.read_bytes()) for p in (epath.Path(version) / wd.ARRAYS).glob("*/zarr.json"))


def load_counting(store: wd.WeightStore, version: int, where: nnx.State, kvstore: str):
  """The load and the bytes it fetched: the fewer of two loads, since the counters are the
  process's (another thread's reads would count too)."""
  fetched = []
  for _ in range(2):
    before = bytes_read(kvstore)
    got = store.load(version, where)
    fetched.append(bytes_read(kvstore) - before)
  return got, min(fetched)


def test_reader_slices_are_the_engines_own():
  """What the publisher lays out for is what a tensor=4 engine holds on each chip."""
  m = model()
  slices = wd.reader_slices(m.cfg, TENSOR)
  engine = dict(nnx.to_flat_state(serving_shardings(m)))
  split = 0
  for p, var in nnx.to_flat_state(nnx.split(m)[1]):
    shape = var.get_value().shape
    want = engine[p].get_value() if isinstance(engine[p], nnx.Variable) else engine[p]
    assert slices[".".join(map(str, p))] == want.shard_shape(shape), p
    split += want.shard_shape(shape) != shape
  assert split >= 8  # projections, MLP and the vocabulary really split
  with pytest.raises(ValueError, match="tensor size must be >= 1"):
    wd.reader_slices(m.cfg, 0)


def test_servers_read_their_own_slices_not_the_trainers_chunks(tmp_path):
  m = model(seed=2)
  state = nnx.split(m)[1]
  published = trained(m)
  new, old = wd.WeightStore(tmp_path / "new"), wd.WeightStore(tmp_path / "old")
  new.publish(published, 1, reader_tensor=TENSOR)
  old.publish(published, 1)  # the layout before: one plain chunk per trainer shard
  where = serving_shardings(m)
  data = sum(x.size * 2 for x in flat(state).values())  # bf16 in the store

  got_new, read_new = load_counting(new, 1, where, "file")
  got_old, read_old = load_counting(old, 1, where, "file")
  ref, want = rounded(state), dict(nnx.to_flat_state(where))
  for got in (got_new, got_old):
    for p, v in nnx.to_flat_state(got):
      x, w = v.get_value(), want[p]
      assert x.sharding == (w.get_value() if isinstance(w, nnx.Variable) else w), p
      assert np.array_equal(np.asarray(x), ref[p]), p
  # The tensor=4 chips' slices partition every split array and a replicated one is read once:
  # the new layout reads the version's bytes once (plus metadata and shard indexes, < 5 %). The
  # old one reads each fsdp chunk a slice cuts across whole, for each chip whose read does not
  # find another chip's fetch of it still in flight (tensorstore shares those): 1x to 4x.
  own_new = read_new - json_bytes(tmp_path / "new" / "v00000001")
  own_old = read_old - json_bytes(tmp_path / "old" / "v00000001")
  # (0.99: tensorstore bumps its counters just after a read completes, so a load's last bytes
  # can land in the count a moment late.)
  assert 0.99 * data <= own_new <= 1.05 * data, (own_new, data)
  assert own_old >= 0.99 * data, (own_old, data)


@pytest.mark.parametrize("reader_tensor", [TENSOR, 1], ids=["laid-out", "chunk-per-shard"])
def test_one_chip_reads_only_its_slice(tmp_path, reader_tensor):
  """One chip's slices (chip 1 of 4) read alone: the store laid out for it fetches those bytes
  and no others; one chunk per trainer shard makes it fetch every fsdp chunk its columns cross,
  the whole array, 4x its slice."""
  m = model(seed=3)
  state = nnx.split(m)[1]
  store = wd.WeightStore(tmp_path)
  store.publish(trained(m), 1, reader_tensor=reader_tensor)
  mesh, _ = mesh_lib.engine_layout(m.cfg, mesh_lib.ServingMeshConfig(tensor=TENSOR))
  chip, ref = mesh.devices.flat[1], rounded(state)
  version = tmp_path / "v00000001"

  def read_chip_1() -> tuple[int, int]:
    """(bytes fetched, bytes of the slices) reading chip 1's slices, checked against the model."""
    own, before = 0, bytes_read("file")
    for p, s in nnx.to_flat_state(serving_shardings(m)):
      s = s.get_value() if isinstance(s, nnx.Variable) else s
      name = ".".join(map(str, p))
      arr = ts.open(wd._array_spec(epath.Path(version) / wd.ARRAYS / name), open=True).result()
      index = s.devices_indices_map(tuple(arr.shape))[chip]
      got = np.asarray(arr[index].read().result(timeout=60)).astype(np.float32)
      assert np.array_equal(got, ref[p][index]), name
      own += got.size * 2
    return bytes_read("file") - before - json_bytes(version), own

  # The fewer bytes of two reads: the counters are the process's (see load_counting).
  (read, own), (again, _) = read_chip_1(), read_chip_1()
  read = min(read, again)
  if reader_tensor == TENSOR:
    assert 0.99 * own <= read <= 1.05 * own, (read, own)
  else:
    assert read >= 3.5 * own, (read, own)


def test_stores_written_before_still_load(tmp_path):
  """An Orbax `params/` version (the layout before the arrays) loads onto a tensor=4 server."""
  m = model(seed=4)
  state = nnx.split(m)[1]
  version = tmp_path / "v00000001"
  tree = jax.tree.map(lambda x: np.asarray(x).astype(jax.numpy.bfloat16), wd._tree(state))
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckpt:
    ckpt.save(version / wd.PARAMS, args=ocp.args.PyTreeSave(tree))
  (version / wd.CONFIG).write_text(json.dumps(to_hf_config(m.cfg)))
  (version / wd.COMMITTED).write_text(json.dumps({"version": 1}))
  got = wd.WeightStore(tmp_path).load(1, serving_shardings(m))
  ref = rounded(state)
  for p, v in nnx.to_flat_state(got):
    assert np.array_equal(np.asarray(v.get_value()), ref[p]), p
  assert not all(v.get_value().sharding.is_fully_replicated for _, v in nnx.to_flat_state(got))


def test_a_read_past_its_deadline_is_one_error_naming_the_version(tmp_path, monkeypatch):
  """A store that never answers (a hung bucket): the load gives up at its deadline."""
  m = model(seed=5)
  wd.WeightStore(tmp_path).publish(m, 1, reader_tensor=TENSOR)
  promises = []

  def hung(*args, **kwargs):
    promises.append(ts.Promise.new())
    return promises[-1][1]  # a future nobody resolves

  monkeypatch.setattr(wd.ts, "open", hung)
  with pytest.raises(CheckpointError, match=r"v00000001: over 0.2 s"):
    wd.load_version(tmp_path / "v00000001", serving_shardings(m), timeout_s=0.2)
  assert promises


def test_the_layout_through_a_bucket(gcs_bucket):
  """gs:// through tensorstore's GCS driver (the emulator): the tensor=4 reader's range reads
  fetch its own bytes, and the arrays are identical."""
  m = model(seed=6)
  state = nnx.split(m)[1]
  root = f"{gcs_bucket}/run/weights"
  store = wd.WeightStore(root)
  store.publish(trained(m), 1, reader_tensor=TENSOR)
  got, read = load_counting(store, 1, serving_shardings(m), "gcs")
  ref = rounded(state)
  for p, v in nnx.to_flat_state(got):
    assert np.array_equal(np.asarray(v.get_value()), ref[p]), p
  data = sum(x.size * 2 for x in ref.values())
  own = read - json_bytes(epath.Path(root) / "v00000001")
  assert 0.99 * data <= own <= 1.05 * data, (read, data)


def test_a_load_in_batches_of_host_bytes_reads_the_same(tmp_path, monkeypatch):
  """READ_BATCH_BYTES bounds the host bytes a load holds: at its smallest every parameter is its
  own batch, and the arrays are the same."""
  m = model(seed=7)
  store = wd.WeightStore(tmp_path)
  store.publish(trained(m), 1, reader_tensor=TENSOR)
  where = serving_shardings(m)
  at_once = flat(store.load(1, where))
  monkeypatch.setattr(wd, "READ_BATCH_BYTES", 1)
  one_by_one = flat(store.load(1, where))
  ref = rounded(nnx.split(m)[1])
  assert at_once.keys() == one_by_one.keys() == ref.keys()
  for p in ref:
    assert np.array_equal(at_once[p], ref[p]) and np.array_equal(one_by_one[p], ref[p]), p
