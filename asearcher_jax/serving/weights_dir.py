"""The versioned weight store: how a trainer hands each policy version to its servers.

A root (local directory, or `gs://bucket/dir` on a pod: every path goes through `etils.epath`
and every array through tensorstore, with its own GCS driver, no mount) holds

  v<version>/arrays/<name>/  one zarr3 array per parameter, cast to the publish dtype (bf16 by
                         default), one chunk per trainer shard: on a multi-host trainer every
                         process writes the shards it holds as whole objects, nothing is
                         gathered to one host and no two processes share an object. Where the
                         servers slice a parameter otherwise (`reader_slices`: the tensor size
                         the publisher is told, `WeightSyncConfig.reader_tensor`, under the
                         engine's own rules), each chunk is a `sharding_indexed` shard of inner
                         chunks cut to the gcd of the trainer shard and the server's slice, so a
                         server's range reads fetch its own slice's bytes, not the whole
                         trainer chunks its slice crosses (4x the bytes for fsdp=8 rows under
                         tensor=4 columns, `benchmarks/weight_store.py`);
  v<version>/parts/      one marker per trainer process, written once its chunks are;
  v<version>/config.json the model config (HF form; its dtype is the trainer's parameter dtype);
  v<version>/COMMITTED   the commit marker, written by process 0 once every part marker exists;
  LATEST                 the pointer ({"version", "path", "time"}), moved last.

Writing is split so that it can run beside the train step on every process: `snapshot` (the
trainer's thread: cast, start of the device->host copies) and `write_snapshot` (any thread: host
bytes only, coordination-service barriers with timeouts, no XLA collective). Stores written
before (an Orbax checkpoint under v<version>/params/) are still read.

The pointer is replaced atomically (a rename on local disk; on GCS a small object write is atomic),
so a reader sees the previous version or the new one, never a mix. A version without its marker
(a trainer that died mid-write) is never loaded: `load` refuses it by name, `versions()` skips it
with a warning, and the next publish prunes it. Each server reads straight into its own placement:
`load(version, shardings)` restores every array onto the given sharding and dtype, each device's
slice only, so a bf16 store feeds a float32 single-device engine and a tensor-parallel one alike.
Every read of a version (all parameters, every distinct local slice) is issued at once as a
tensorstore future, up to READ_BATCH_BYTES held at a time, and waited for under one deadline; a
store laid out for other readers, one written chunk per shard, or an Orbax one, still loads.

The trainer's publisher (`rl.weight_sync`) writes through `write_version`; each `serve-model` runs
a `DirectoryWeightWatcher` that loads whatever the pointer names and hands it to its driver. One
host without a store keeps the in-process path (`rl.weight_sync.InProcessWeightSync`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from flax import nnx
from jax.sharding import SingleDeviceSharding

from asearcher_jax import distributed, storage
from asearcher_jax.errors import CheckpointError
from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model.config import ModelConfig, from_hf_config, to_hf_config
from asearcher_jax.model.transformer import Transformer
from asearcher_jax.serving import mesh as mesh_lib

log = logging.getLogger(__name__)
storage.gcs_without_listing_cache()  # readers and writers are different processes

LATEST = "LATEST"
COMMITTED = "COMMITTED"
ARRAYS = "arrays"  # one zarr3 array per parameter, one shard object per trainer shard
PARTS = "parts"  # one marker per trainer process, written once its pieces are
PARAMS = "params"  # the Orbax checkpoint of stores written before ARRAYS (still read)
CONFIG = "config.json"

StorePath = str | os.PathLike | epath.Path


class ParamsSink(Protocol):
  """What receives weights: the in-process `serving.driver.Driver`."""

  def update_params(
    self, params: nnx.State, version: int, timeout: float = ..., *, recompute: bool | None = ...
  ) -> float: ...


def store_path(root: StorePath) -> epath.Path:
  """`root` as an epath: URLs (gs://...) as they are, local paths made absolute (Orbax needs it)."""
  if isinstance(root, epath.Path) and _is_url(root):
    return root
  text = os.fspath(root)
  return epath.Path(text if _is_url(text) else os.path.abspath(text))


def _is_url(root: Any) -> bool:
  return "://" in os.fspath(root)


def version_dir(root: StorePath, version: int) -> epath.Path:
  return store_path(root) / f"v{version:08d}"


def _parse_version(name: str) -> int | None:
  return int(name[1:]) if name.startswith("v") and name[1:].isdigit() else None


def read_latest(root: StorePath) -> dict[str, Any] | None:
  """The LATEST pointer ({"version", "path", "time"}), or None if nothing is published."""
  path = store_path(root) / LATEST
  try:
    return json.loads(path.read_text())
  except FileNotFoundError:
    return None
  except json.JSONDecodeError:  # cannot happen with an atomic replace, but never crash a watcher
    log.warning("unreadable %s pointer in %s", LATEST, root)
    return None


def is_committed(path: StorePath) -> bool:
  """Whether the version directory `path` was completely written (its marker exists)."""
  return (store_path(path) / COMMITTED).exists()


def versions(root: StorePath) -> list[int]:
  """The committed versions in `root`, oldest first; uncommitted directories are skipped loudly."""
  root = store_path(root)
  if not root.exists():
    return []
  found = []
  for child in root.iterdir():
    v = _parse_version(child.name)
    if v is None:
      continue
    if is_committed(child):
      found.append(v)
    else:
      log.warning("skipping %s: no %s marker (half-written or being deleted)", child, COMMITTED)
  return sorted(found)


def _write_atomic(path: epath.Path, text: str) -> None:
  """Replaces `path` with `text` so a reader sees the old content or the new, never a mix."""
  if _is_url(path):  # object stores: a single small object write is atomic
    path.write_text(text)
    return
  tmp = path.with_name(path.name + ".tmp")
  with open(os.fspath(tmp), "w", encoding="utf-8") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(os.fspath(tmp), os.fspath(path))


def _tree(state: nnx.State) -> dict[str, Any]:
  """An NNX state as a nested dict of arrays with string keys (Orbax names arrays by key)."""
  out: dict[str, Any] = {}
  for path, var in nnx.to_flat_state(state):
    node = out
    for key in path[:-1]:
      node = node.setdefault(str(key), {})
    node[str(path[-1])] = var.get_value() if isinstance(var, nnx.Variable) else var
  return out


def _leaf(tree: dict[str, Any], path: tuple[Any, ...]) -> Any:
  for key in path:
    tree = tree[str(key)]
  return tree


@dataclasses.dataclass(frozen=True)
class _Leaf:
  """One parameter of a snapshot: its global shape and dtype, and the pieces this process writes
  (the shards with replica_id 0 among those its devices hold: each piece is written once, by
  one process) as (global index, device array or host copy)."""

  shape: tuple[int, ...]
  dtype: np.dtype
  chunk: tuple[int, ...]
  pieces: list[tuple[tuple[slice, ...], Any]]
  # The read unit inside each chunk (`_inner`); None or == chunk: whole chunks (no index).
  inner: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Snapshot:
  """One version's parameters as this process's own shards, on their way to the host.

  Taken on the trainer's thread (`snapshot`): the cast to the publish dtype runs there (an XLA
  program every process must launch in order) and the device->host copies start there; the
  writer (`write_snapshot`, any thread) only waits for host bytes and writes them, so it issues
  no XLA computation and no collective that could interleave with the train step's.
  """

  leaves: dict[str, _Leaf]
  nbytes: int  # bytes of the whole version (every process's pieces together)

  def dtypes(self) -> str:
    return ",".join(sorted({str(leaf.dtype) for leaf in self.leaves.values()}))

  def to_host(self) -> None:
    """Waits for the copies; drops the device buffers (the version no longer holds HBM)."""
    for leaf in self.leaves.values():
      leaf.pieces[:] = [(index, np.asarray(data)) for index, data in leaf.pieces]


def _name(path: tuple[Any, ...]) -> str:
  return ".".join(str(k) for k in path)


def snapshot(
  params: nnx.State, *, dtype: str | None, reader: Mapping[str, tuple[int, ...]] | None = None
) -> Snapshot:
  """`params` cast to `dtype` (None keeps each param's) as this process's own shards, with their
  device->host copies started. Call on the trainer's thread, on a copy that survives the next
  (donating) step, as `rl.weight_sync` does. `reader`: each parameter's slice shape on one
  serving chip (`reader_slices`); the arrays are then laid out so each reader fetches only its
  own bytes (`_inner`). None: whole trainer shards are the read unit (the layout before)."""
  out_dtype = None if dtype is None else jnp.dtype(dtype)
  reader = reader or {}
  leaves: dict[str, _Leaf] = {}
  nbytes = 0
  for path, var in nnx.to_flat_state(params):
    x = var.get_value() if isinstance(var, nnx.Variable) else var
    if out_dtype is not None and x.dtype != out_dtype:
      x = x.astype(out_dtype)  # on device, sharding kept
    shape = tuple(x.shape)
    name = _name(path)
    nbytes += int(np.prod(shape, dtype=np.int64)) * x.dtype.itemsize
    if not isinstance(x, jax.Array):
      arr = np.asarray(x)
      inner = _inner(shape, shape, reader.get(name))
      leaves[name] = _Leaf(
        shape, arr.dtype, shape, [(tuple(slice(None) for _ in shape), arr)], inner
      )
      continue
    pieces = []
    for shard in x.addressable_shards:
      if shard.replica_id == 0:
        shard.data.copy_to_host_async()
        pieces.append((shard.index, shard.data))
    chunk = _chunk(x)
    leaves[name] = _Leaf(
      shape, np.dtype(x.dtype), chunk, pieces, _inner(shape, chunk, reader.get(name))
    )
  return Snapshot(leaves=leaves, nbytes=nbytes)


def _chunk(x: jax.Array) -> tuple[int, ...]:
  """The largest shard's shape: one chunk per shard, so no two processes share a chunk (an
  uneven split's last shard is a partial edge chunk)."""
  spans = x.sharding.devices_indices_map(tuple(x.shape)).values()
  return tuple(
    max(1, max(len(range(*s[d].indices(n))) for s in spans)) for d, n in enumerate(x.shape)
  )


def _inner(
  shape: tuple[int, ...], chunk: tuple[int, ...], read: tuple[int, ...] | None
) -> tuple[int, ...] | None:
  """The read unit inside a trainer chunk: per dimension the gcd of the chunk and the reader's
  slice, so trainer shards and reader slices are both unions of whole units and a reader's
  range reads fetch its own bytes and no others. None where the chunk already is one (or the
  reader's slice does not fit the array: a store written for another model)."""
  if read is None or len(read) != len(shape):
    return None
  inner = tuple(math.gcd(c, r) if r <= n else c for c, r, n in zip(chunk, read, shape, strict=True))
  return None if inner == chunk else inner


def reader_slices(cfg: ModelConfig, tensor: int) -> dict[str, tuple[int, ...]]:
  """Each parameter's slice shape on one chip of a serve-model split over `tensor` chips, by the
  rules the engine places its weights with (`serving.mesh.engine_rules`): what the publisher
  lays the arrays out for (`WeightSyncConfig.reader_tensor`)."""
  if tensor < 1:
    raise ValueError(f"the readers' tensor size must be >= 1, got {tensor}")
  _, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  mesh = jax.sharding.AbstractMesh((1, 1, tensor), sharding_lib.MESH_AXES)
  rules = mesh_lib.engine_rules(cfg, tensor)
  out = {}
  for path, var in nnx.to_flat_state(state):
    shape = tuple(var.get_value().shape)
    axes = var.get_metadata().get("logical_axes") or (None,) * len(shape)
    spec = sharding_lib.logical_to_spec(axes, shape, mesh, rules)
    split = [1 if a is None else sharding_lib.axis_size(mesh, a) for a in spec]
    split += [1] * (len(shape) - len(split))
    out[_name(path)] = tuple(n // k for n, k in zip(shape, split, strict=True))
  return out


def _kvstore(path: epath.Path) -> dict[str, Any]:
  """A tensorstore kvstore spec for a local path or a gs:// URL (the library's own GCS driver,
  no mount)."""
  text = os.fspath(path)
  if text.startswith("gs://"):
    bucket, _, key = text.removeprefix("gs://").partition("/")
    return {"driver": "gcs", "bucket": bucket, "path": key.rstrip("/") + "/"}
  if _is_url(text):
    raise CheckpointError(f"weight store {text}: only local paths and gs:// URLs are supported")
  return {"driver": "file", "path": text.rstrip("/") + "/"}


def _array_spec(path: epath.Path, leaf: _Leaf | None = None, *, compress: bool = False) -> dict:
  """zarr3: chunks of the trainer's shards; where the readers slice them finer (`leaf.inner`),
  each chunk is one `sharding_indexed` object of inner chunks with an index at its end, so a
  reader's range reads fetch only its own inner chunks (plus 16 bytes of index per inner chunk)."""
  spec: dict[str, Any] = {"driver": "zarr3", "kvstore": _kvstore(path)}
  if leaf is not None:
    codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if compress:
      codecs.append({"name": "zstd", "configuration": {"level": 3}})
    if leaf.inner is not None:
      index = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
      codecs = [{"name": "sharding_indexed", "configuration": {
        "chunk_shape": list(leaf.inner), "codecs": codecs, "index_codecs": index,
        "index_location": "end",
      }}]  # fmt: skip
    spec["metadata"] = {
      "shape": list(leaf.shape),
      "data_type": leaf.dtype.name,
      "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(leaf.chunk)}},
      "codecs": codecs,
    }
  return spec


def write_snapshot(
  root: StorePath,
  snap: Snapshot,
  version: int,
  cfg: ModelConfig,
  *,
  compress: bool = False,
  sync_key: str,
  timeout_s: float = 600.0,
) -> epath.Path:
  """Writes `snap` as version `version`, then moves LATEST to it; returns its directory.

  Every process of a multi-host trainer calls it with its own snapshot (the same `version` and
  `sync_key`, unique per write) and writes its own pieces: one chunk per shard, so processes
  never touch the same file. Process 0 prepares the directory and the arrays' metadata; each
  process then writes its pieces and a part marker; process 0 writes the config, the commit
  marker and the pointer once every part marker exists, so a reader never sees a version
  missing one process's shards. The processes meet at coordination-service barriers (each at
  most `timeout_s`), never at device collectives: this may run on a writer thread beside the
  train step. An existing directory of the same version (a trainer resumed from an older
  checkpoint) is uncommitted first, then rewritten. `compress`: zstd chunks.
  """
  root = store_path(root)
  final = version_dir(root, version)
  lead = jax.process_index() == 0
  arrays = final / ARRAYS
  if lead:
    root.mkdir(parents=True, exist_ok=True)
    if final.exists():
      (final / COMMITTED).unlink(missing_ok=True)  # readers refuse it from here on
      final.rmtree()
    (final / PARTS).mkdir(parents=True)
    created = [
      ts.open(_array_spec(arrays / name, leaf, compress=compress), create=True)
      for name, leaf in snap.leaves.items()
    ]
    for future in created:
      future.result()
  distributed.kv_barrier(f"{sync_key}/prepared", timeout_s)  # metadata exists, old dir gone
  snap.to_host()
  opened = {name: ts.open(_array_spec(arrays / name), open=True) for name in snap.leaves}
  writes = []
  for name, leaf in snap.leaves.items():
    store = opened[name].result()
    writes += [store[index].write(piece) for index, piece in leaf.pieces]
  for w in writes:
    w.result()
  me = jax.process_index()
  pieces = sum(len(leaf.pieces) for leaf in snap.leaves.values())
  (final / PARTS / f"process_{me}.json").write_text(json.dumps({"pieces": pieces}))
  distributed.kv_barrier(f"{sync_key}/written", timeout_s)
  if lead:
    missing = [
      i for i in range(jax.process_count()) if not (final / PARTS / f"process_{i}.json").exists()
    ]
    if missing:
      raise CheckpointError(f"weights version {final}: no part from processes {missing}")
    (final / CONFIG).write_text(json.dumps(to_hf_config(cfg), indent=2))
    marker = {"version": version, "dtype": snap.dtypes(), "bytes": snap.nbytes, "time": time.time()}
    (final / COMMITTED).write_text(json.dumps(marker))
    pointer = {"version": version, "path": final.name, "time": time.time()}
    _write_atomic(root / LATEST, json.dumps(pointer))
  distributed.kv_barrier(f"{sync_key}/committed", timeout_s)  # the version is live everywhere
  return final


_writes = itertools.count()  # every process writes in the same order: the same keys


def write_version(
  root: StorePath,
  model: nnx.Module,
  version: int,
  *,
  dtype: str | None,
  compress: bool = False,
  reader_tensor: int = 1,
) -> epath.Path:
  """Writes `model`'s parameters as version `version` (cast to `dtype`; None keeps each param's
  dtype), then moves LATEST to it; returns the version's directory. `compress`: zstd chunks
  (fewer bytes for a slow link; readers need nothing). `reader_tensor`: the chips each server
  splits its replica over (`reader_slices`). Every process of a multi-host trainer calls this,
  in the same order (`write_snapshot`)."""
  reader = reader_slices(model.cfg, reader_tensor)
  snap = snapshot(nnx.split(model)[1], dtype=dtype, reader=reader)
  key = f"asearcher/weights_dir/write_version/{next(_writes)}"
  return write_snapshot(root, snap, version, model.cfg, compress=compress, sync_key=key)


def _checkpointer(compress: bool) -> ocp.Checkpointer:
  return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=compress))


def load_version(
  path: StorePath, shardings: nnx.State | None = None, *, timeout_s: float = 600.0
) -> nnx.State:
  """Reads the version directory `path` into an NNX state of the model's parameters.

  `shardings`: the target placement, an NNX state with the model's structure whose leaves are
  `jax.sharding.Sharding`s (`model.sharding.param_shardings`; the dtype is the model config's)
  or arrays / ShapeDtypeStructs (their sharding and dtype, e.g. the engine's current params).
  None: every array on device 0 in the config's dtype. Every slice of every parameter is read
  at once (`_read_arrays`), within `timeout_s`. Raises CheckpointError naming the version for a
  missing or uncommitted directory, a structure that does not match or a read that timed out.
  """
  path = store_path(path)
  if not is_committed(path):
    raise CheckpointError(
      f"weights version {path} has no {COMMITTED} marker: it is half-written, deleted or "
      "not a weights version"
    )
  try:
    cfg = from_hf_config(json.loads((path / CONFIG).read_text()))
  except (FileNotFoundError, json.JSONDecodeError, KeyError) as e:
    raise CheckpointError(f"cannot read the model config of weights version {path}: {e}") from e
  _, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  targets = {} if shardings is None else dict(nnx.to_flat_state(shardings))
  device0 = SingleDeviceSharding(jax.devices()[0])
  flat = nnx.to_flat_state(state)
  abstract: dict[str, Any] = {}
  for p, var in flat:
    want = var.get_value()
    t = targets.get(p, device0)
    if isinstance(t, nnx.Variable):
      t = t.get_value()
    if isinstance(t, jax.sharding.Sharding):
      leaf = jax.ShapeDtypeStruct(want.shape, want.dtype, sharding=t)
    else:
      if tuple(t.shape) != tuple(want.shape):
        raise CheckpointError(
          f"target {'/'.join(map(str, p))} has shape {tuple(t.shape)}, weights version {path} "
          f"holds {tuple(want.shape)}"
        )
      leaf = jax.ShapeDtypeStruct(want.shape, t.dtype, sharding=t.sharding)
    node = abstract
    for key in p[:-1]:
      node = node.setdefault(str(key), {})
    node[str(p[-1])] = leaf
  if (path / ARRAYS).exists():
    got = _read_arrays(path, {_name(p): _leaf(abstract, p) for p, _ in flat}, timeout_s)
    for p, var in flat:
      var.set_value(got[_name(p)])
    return nnx.from_flat_state(flat)
  # A store written before the arrays moved to one tensorstore array per parameter: an Orbax
  # checkpoint. Every array read straight onto its target sharding, cast on the way.
  restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
  try:
    with _checkpointer(False) as ckpt:
      restored = ckpt.restore(
        path / PARAMS, args=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args)
      )
  except (FileNotFoundError, KeyError, ValueError) as e:
    raise CheckpointError(f"cannot read weights version {path}: {e}") from e
  for p, var in flat:
    var.set_value(_leaf(restored, p))
  return nnx.from_flat_state(flat)


# Host bytes a load holds before it places them on devices (and frees them): the reads of a
# version are issued together up to this much, then the next batch (a bound on host memory; a
# 7B bf16 replica is ~4 batches).
READ_BATCH_BYTES = 4 << 30


def _read_arrays(
  path: epath.Path, wants: dict[str, jax.ShapeDtypeStruct], timeout_s: float = 600.0
) -> dict[str, jax.Array]:
  """The parameters `wants` names read onto their shardings and dtypes: every array opened at
  once, then every slice this process's devices hold (each distinct slice once, replicas share
  it) read at once as tensorstore futures, up to READ_BATCH_BYTES in flight, each wait bounded
  by what is left of `timeout_s`; then each parameter's pieces placed on their devices in one
  batch (one `device_put` per piece cost ~half a load on CPU)."""
  deadline = time.monotonic() + timeout_s

  def wait(future: Any, what: str) -> Any:
    try:
      return future.result(timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError as e:
      raise CheckpointError(f"reading {what} of weights version {path}: over {timeout_s} s") from e
    except ValueError as e:
      raise CheckpointError(f"cannot read {what} of weights version {path}: {e}") from e

  # One context for the whole version: its request and file-I/O concurrency limits bound every
  # read of the load together (a context per array would multiply them by the parameters), and
  # its small cache keeps each shard's index for the chips that read the same shard (without
  # it every chip fetched the index again: ~1.9x the seconds of a local load).
  context = ts.Context({"cache_pool": {"total_bytes_limit": 64 << 20}})
  opening = {
    name: ts.open(_array_spec(path / ARRAYS / name), open=True, context=context) for name in wants
  }
  stores = {name: wait(f, name) for name, f in opening.items()}
  plans: list[tuple[str, dict[Any, tuple[slice, ...]], int]] = []
  for name, want in wants.items():
    store = stores[name]
    if tuple(store.shape) != tuple(want.shape):
      raise CheckpointError(
        f"weights version {path} holds {name} with shape {tuple(store.shape)}, the model "
        f"config says {tuple(want.shape)}"
      )
    where = want.sharding.addressable_devices_indices_map(tuple(want.shape))
    slices = {_key(index, want.shape) for index in where.values()}
    nbytes = sum(_slice_bytes(k, store.dtype.numpy_dtype.itemsize) for k in slices)
    plans.append((name, where, nbytes))
  out: dict[str, jax.Array] = {}
  start = 0
  while start < len(plans):
    stop, held = start, 0
    while stop < len(plans) and (stop == start or held + plans[stop][2] <= READ_BATCH_BYTES):
      held += plans[stop][2]
      stop += 1
    batch = plans[start:stop]
    reads = {
      (name, k): stores[name][tuple(slice(a, b) for a, b in k)].read()
      for name, where, _ in batch
      for k in {_key(i, wants[name].shape) for i in where.values()}
    }  # every read issued before any is waited for
    host = {key: wait(f, key[0]) for key, f in reads.items()}
    for name, _, _ in batch:
      want = wants[name]

      def piece(index: tuple[slice, ...], name: str = name, want: Any = want, host=host) -> Any:
        return np.asarray(host[name, _key(index, want.shape)]).astype(want.dtype, copy=False)

      # The pieces are on the host already; jax places them on their devices in one batch.
      out[name] = jax.make_array_from_callback(want.shape, want.sharding, piece)
    del host  # this batch's bytes are on the devices
    start = stop
  return out


def _key(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
  """A device's index as hashable (start, stop) pairs: replicas of one slice read it once."""
  bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=False))
  return bounds + tuple((0, n) for n in shape[len(index) :])


def _slice_bytes(key: tuple[tuple[int, int], ...], itemsize: int) -> int:
  return math.prod(b - a for a, b in key) * itemsize


class WeightStore:
  """The store at one root: `publish`, `latest`, `versions`, `load`, `prune` (module docstring)."""

  def __init__(self, root: StorePath) -> None:
    self.root = store_path(root)

  def publish(
    self,
    model: nnx.Module,
    version: int,
    *,
    dtype: str | None = "bfloat16",
    compress: bool = False,
    reader_tensor: int = 1,
  ) -> epath.Path:
    return write_version(
      self.root, model, version, dtype=dtype, compress=compress, reader_tensor=reader_tensor
    )

  def latest(self) -> dict[str, Any] | None:
    return read_latest(self.root)

  def versions(self) -> list[int]:
    return versions(self.root)

  def load(self, version: int, shardings: nnx.State | None = None) -> nnx.State:
    """Version `version` placed in `shardings` (see `load_version`)."""
    return load_version(version_dir(self.root, version), shardings)

  def prune(self, *, keep: int, newest: int) -> None:
    prune_versions(self.root, keep=keep, newest=newest)


def prune_versions(root: StorePath, *, keep: int, newest: int) -> None:
  """Deletes version directories older than the `keep` newest (counted back from `newest`), and
  uncommitted ones older than `newest` (abandoned writes); never the one LATEST names."""
  root = store_path(root)
  if jax.process_index() != 0 or not root.exists():
    return
  pointed = (read_latest(root) or {}).get("path")
  for child in root.iterdir():
    v = _parse_version(child.name)
    if v is None or child.name == pointed:
      continue
    if v <= newest - keep or (v < newest and not is_committed(child)):
      (child / COMMITTED).unlink(missing_ok=True)  # a reader that gets here refuses it by name
      child.rmtree(missing_ok=True)


class DirectoryWeightWatcher:
  """Server side: polls LATEST and hands the weights it points to to the driver (`update_params`).

  The server runs whatever LATEST points to: a pointer it has not loaded yet is loaded, the
  first one included, so a server started from any init (or restarted mid-run) converges on the
  trainer's weights. A pointer to a version <= the one running (a trainer that resumed from an
  older checkpoint, or a first load over the init) is loaded with `recompute=True`: keys/values
  cached under other weights must not be continued.

  `shardings` is where the weights go (see `load_version`; serve-model passes its engine's
  params, so each version lands in the engine's own sharding and dtype). `load` replaces the
  reader (a version directory -> an NNX state). `poll_once()` does one check (tests, or a
  caller's own loop); `start()` runs it on a daemon thread every `poll_s` seconds. Loading
  failures (an uncommitted version included) are logged and retried at the next poll.
  `status()` says which pointer is loaded (servers report it on /health).
  """

  def __init__(
    self,
    root: StorePath,
    sink: ParamsSink,
    *,
    version: int = 0,
    poll_s: float = 1.0,
    load: Callable[[epath.Path], nnx.State] | None = None,
    shardings: nnx.State | None = None,
    timeout_s: float = 600.0,
  ) -> None:
    self.root = store_path(root)
    self.sink = sink
    self.version = version
    self.poll_s = poll_s
    self.timeout_s = timeout_s
    if shardings is not None:  # keep only where the weights go, not the arrays passed in
      shardings = jax.tree.map(_placement, shardings)
    self._load = load or (lambda path: load_version(path, shardings, timeout_s=timeout_s))
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self.loaded: list[int] = []
    self.pointer: dict[str, Any] | None = None  # the LATEST pointer last loaded
    self.last_load: dict[str, float] = {}  # version, load_s, gb (as the server holds them)

  def poll_once(self) -> int | None:
    """Loads and applies the pointed-to version if the pointer moved; returns it, else None."""
    latest = read_latest(self.root)
    if latest is None or _same_pointer(latest, self.pointer):
      return None
    version = int(latest["version"])
    t0 = time.perf_counter()
    params = self._load(self.root / latest["path"])
    load_s = time.perf_counter() - t0
    reset = True if version <= self.version else None  # None: the driver's kv_on_update
    self.sink.update_params(params, version, timeout=self.timeout_s, recompute=reset)
    self.version = version
    self.pointer = latest
    self.loaded.append(version)
    gb = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) / 1e9
    self.last_load = {"version": version, "load_s": load_s, "gb": gb}
    log.info("loaded version %d from %s: %.3f GB in %.2f s", version, latest["path"], gb, load_s)
    return version

  def status(self) -> dict[str, Any] | None:
    """{"version", "time"} of the loaded pointer (its publish time identifies it); None yet."""
    p = self.pointer
    return None if p is None else {"version": int(p["version"]), "time": p.get("time")}

  def start(self) -> None:
    self._thread = threading.Thread(target=self._run, name="weight-watcher", daemon=True)
    self._thread.start()

  def stop(self, timeout: float = 30.0) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout)
      self._thread = None

  def _run(self) -> None:
    while not self._stop.wait(self.poll_s):
      try:
        self.poll_once()
      except Exception:  # a torn, uncommitted or pruned version: try again at the next poll
        log.exception("weight watcher: loading from %s failed", self.root)


def _placement(x: Any) -> Any:
  if isinstance(x, jax.sharding.Sharding):
    return x
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _same_pointer(a: dict[str, Any], b: dict[str, Any] | None) -> bool:
  keys = ("version", "path", "time")
  return b is not None and all(a.get(k) == b.get(k) for k in keys)
