"""Device mesh, logical-axis rules, and the shardings of parameters and activations.

Every parameter carries logical axis names (`embed`, `mlp`, `q_heads`, ...) as metadata; every
activation the model constrains uses `act_*` names. One rule table maps logical names to the mesh
axes `data`, `fsdp` and `tensor`, so the same model code runs single-device, FSDP, tensor-parallel
or both, and changing the layout is a one-line change of rules.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axis (or axes, or None = replicated).
DEFAULT_RULES: Mapping[str, str | tuple[str, ...] | None] = {
  # parameters
  "vocab": "tensor",
  "embed": "fsdp",
  "q_heads": "tensor",
  "kv_heads": "tensor",
  "mlp": "tensor",
  "norm": None,
  # activations
  "batch": ("data", "fsdp"),
  "length": None,
  "act_embed": None,
  "act_heads": "tensor",
  "act_mlp": "tensor",
  "act_vocab": "tensor",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
  """The (data, fsdp, tensor) mesh a command builds over all its devices (every process's, in a
  multi-process run); one size may be -1: whatever the others leave."""

  # Data-parallel replicas: each holds a full (fsdp-sharded) copy of the parameters.
  data: int = 1
  # Parameters, gradients and optimizer state sharded over this axis; batch rows too.
  fsdp: int = -1
  # Tensor parallelism over heads and MLP columns (keep within a host's chips: it talks most).
  tensor: int = 1
  # Devices the mesh spans: the first N of one process's (part of a shared host, or one device
  # where a test process fakes eight); None: every device of every process.
  devices: int | None = None

  def __post_init__(self):
    sizes = (self.data, self.fsdp, self.tensor)
    if any(s == 0 or s < -1 for s in sizes) or sizes.count(-1) > 1:
      raise ValueError(f"MeshConfig sizes must be >= 1, at most one -1; got {sizes}")
    if self.devices is not None and self.devices < 1:
      raise ValueError(f"MeshConfig.devices must be >= 1 or None, got {self.devices}")

  def build(self, devices: Sequence | None = None) -> Mesh:
    """The mesh over `devices` (default: the first `self.devices`, else all devices of all
    processes)."""
    if devices is None and self.devices is not None:
      have = jax.devices()
      if jax.process_count() > 1 and self.devices != len(have):
        raise ValueError(
          f"MeshConfig.devices = {self.devices}: a multi-process mesh spans every process's "
          f"devices ({len(have)}); leave it None"
        )
      if self.devices > len(have):
        raise ValueError(f"MeshConfig.devices = {self.devices}, but {len(have)} device(s) exist")
      devices = have[: self.devices]
    return make_mesh(data=self.data, fsdp=self.fsdp, tensor=self.tensor, devices=devices)


def make_mesh(
  *, data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence | None = None
) -> Mesh:
  """A (data, fsdp, tensor) mesh over `devices` (default: all); one size may be -1 (the rest)."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = [data, fsdp, tensor]
  if sizes.count(-1) > 1:
    raise ValueError("at most one mesh axis size may be -1")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f"{len(devices)} devices do not divide into mesh sizes {sizes}")
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                     f"have {len(devices)}")  # fmt: skip
  try:
    from jax.experimental import mesh_utils

    grid = mesh_utils.create_device_mesh(sizes, devices)  # topology-aware on TPU
  except (ValueError, NotImplementedError, AssertionError):
    grid = np.asarray(devices).reshape(sizes)
  return Mesh(grid, MESH_AXES)


def put(tree, shardings):
  """Places `tree` (host or local arrays, the same values on every process) on `shardings`.

  One process: `jax.device_put`. Several: each process builds only the shards its own devices
  hold (`jax.make_array_from_callback`), as a global array cannot be device_put from one host.
  `shardings` is a tree of shardings with the structure of `tree` (or a prefix of it), or one
  sharding for all."""
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)

  def one(x, sharding):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:  # already global (hf_io.load)
      return x if x.sharding == sharding else jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: one(x, shardings), tree)
  # `shardings` may be a prefix of `tree` (one sharding per nnx.Variable).
  return jax.tree.map(lambda s, sub: jax.tree.map(lambda x: one(x, s), sub), shardings, tree)


def logical_to_spec(
  axes: Sequence[str | None],
  shape: Sequence[int],
  mesh: Mesh,
  rules: Mapping[str, str | tuple[str, ...] | None] = DEFAULT_RULES,
) -> PartitionSpec:
  """PartitionSpec for an array with these logical axes; a dim that does not divide evenly by its
  mesh axes, or whose mesh axis is already used by an earlier dim, stays replicated."""
  used: set[str] = set()
  out = []
  for name, size in zip(axes, shape, strict=True):
    mesh_axes = rules.get(name) if name is not None else None
    if mesh_axes is None:
      out.append(None)
      continue
    mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    mesh_axes = tuple(a for a in mesh_axes if a not in used and mesh.shape[a] > 1)
    n = math.prod(mesh.shape[a] for a in mesh_axes)
    if not mesh_axes or size % n:
      out.append(None)
      continue
    used.update(mesh_axes)
    out.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
  return PartitionSpec(*out)


def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def param_shardings(state: nnx.State, mesh: Mesh, rules: Mapping = DEFAULT_RULES) -> nnx.State:
  """NamedSharding for every variable of an (abstract or concrete) NNX state, from its metadata."""

  def one(var):
    value = var.get_value()
    axes = var.get_metadata().get("logical_axes") or (None,) * len(value.shape)
    return NamedSharding(mesh, logical_to_spec(axes, value.shape, mesh, rules))

  return jax.tree.map(one, state, is_leaf=_is_var)


# The mesh and rules that `constrain` applies; unset (the default) makes it a no-op, so the model
# runs unchanged on one device and in tests.
_ACTIVATION_CONTEXT: contextvars.ContextVar[tuple[Mesh, Mapping] | None] = contextvars.ContextVar(
  "activation_sharding", default=None
)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Mapping = DEFAULT_RULES) -> Iterator[None]:
  """Within this context (entered while tracing), model activations get sharding constraints."""
  token = _ACTIVATION_CONTEXT.set((mesh, rules))
  try:
    yield
  finally:
    _ACTIVATION_CONTEXT.reset(token)


def activation_context() -> tuple[Mesh, Mapping] | None:
  """The (mesh, rules) of the enclosing `activation_sharding`, or None: a kernel that runs per
  shard (splash attention's `shard_map`) needs the mesh itself, not just constraints."""
  return _ACTIVATION_CONTEXT.get()


def axis_size(mesh: Mesh, axes: str | tuple[str, ...]) -> int:
  """Devices along one mesh axis, or the product along several (a PartitionSpec entry)."""
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  return math.prod(mesh.shape[a] for a in axes)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  ctx = _ACTIVATION_CONTEXT.get()
  if ctx is None:
    return x
  mesh, rules = ctx
  spec = logical_to_spec(axes, x.shape, mesh, rules)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def batch_sharding(mesh: Mesh, ndim: int = 2, rules: Mapping = DEFAULT_RULES) -> NamedSharding:
  """Sharding of a [batch, length, ...] input array: batch over data x fsdp, the rest replicated."""
  mesh_axes = rules["batch"]
  mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
  mesh_axes = tuple(a for a in mesh_axes if mesh.shape[a] > 1)
  first = None if not mesh_axes else (mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
  return NamedSharding(mesh, PartitionSpec(first, *([None] * (ndim - 1))))
