"""The engine's own device mesh: one policy served across a slice's chips by tensor parallelism.

The engine runs on a (data=1, fsdp=1, tensor=t) mesh of `model.sharding`'s axes, built from
`ServingMeshConfig`, independent of any learner mesh (weights arriving in another layout are placed
into the engine's, see `Engine.versioned`). The layout is Megatron's, one all-reduce after
attention and one after the MLP per layer:
  * q/k/v projections split by heads (kernel columns), o_proj by its input heads (rows);
  * gate/up projections split by MLP columns, down_proj by rows;
  * the embedding (and the tied output head) split by vocabulary rows: the lookup is a masked
    gather plus an all-reduce, logits come out vocabulary-sharded and sampling reduces over them;
  * the KV cache [slots, max_seq_len, kv_heads, head_dim] split by KV heads, so each chip keeps
    the keys and values of the heads it computes and cache memory per chip falls with t;
  * norms and the per-slot bookkeeping (lengths, PRNG keys, sampling settings) replicated.
Heads are split only on head boundaries. When num_kv_heads does not divide by t (Qwen2.5-0.5B to
3B have 2 KV heads; Qwen2.5-7B has 4 at t = 8), the k/v projections are replicated: every chip
computes every KV head (a few columns of compute). The cache need not be: a cache built with
`cache_kv_heads` heads -- each KV head repeated t / num_kv_heads times, as vLLM does, where t
divides by num_kv_heads and divides the query heads (`ragged_paged.kv_repeat`) -- splits over "tensor" like any other, each
chip keeping the copy of the one head its query heads read (1 / t of the cache, not all of it).
The engine's page pools are built so (engine.pages_layout), as is the compiled paged step
(`ragged_paged.paged_step(repeat=...)`); the fixed-slot cache keeps
num_kv_heads heads and stays replicated there. The query heads, o_proj, MLP and vocabulary stay
split either way.
When num_heads does not divide by t, attention is replicated and only the MLP and vocabulary split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from asearcher_jax.errors import AsearcherError
from asearcher_jax.model import ragged_paged
from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model.config import ModelConfig

# Logical name of the KV cache's head axis (activations use `act_*` names; see model/sharding.py).
CACHE_HEADS = "act_kv_heads"
CACHE_AXES = ("batch", "length", CACHE_HEADS, None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServingMeshConfig:
  """The engine's devices."""

  # Chips each layer is split over (heads, MLP columns, vocabulary, KV cache heads); -1: every
  # visible device. The engine uses the first `tensor` of jax.devices(); 1: one device, no
  # collectives (the default, and what the CPU quickstart runs).
  tensor: int = 1

  def __post_init__(self):
    if self.tensor == 0 or self.tensor < -1:
      raise AsearcherError(f"ServingMeshConfig.tensor must be >= 1 or -1, got {self.tensor}")


def make_engine_mesh(cfg: ServingMeshConfig, devices: Sequence | None = None) -> Mesh:
  """A (1, 1, tensor) mesh over the first `tensor` of `devices` (None: jax.devices(); a
  rehearsal passes a TPU slice's devices that are not there)."""
  devices = list(jax.devices() if devices is None else devices)
  t = len(devices) if cfg.tensor == -1 else cfg.tensor
  if t > len(devices):
    raise AsearcherError(
      f"ServingMeshConfig.tensor={t} needs {t} devices, {len(devices)} are visible"
    )
  return sharding_lib.make_mesh(data=1, fsdp=1, tensor=t, devices=devices[:t])


def engine_rules(model: ModelConfig, tensor: int) -> Mapping[str, str | tuple[str, ...] | None]:
  """Logical-axis rules for serving `model` over `tensor` chips (the module docstring's layout):
  no fsdp or batch split, heads split only where their count divides by `tensor`."""
  heads = "tensor" if model.num_heads % tensor == 0 else None
  kv = "tensor" if model.num_kv_heads % tensor == 0 else None
  # A cache of duplicated heads (cache_kv_heads) divides by the chips; a cache of num_kv_heads
  # that does not stays replicated whatever this says (logical_to_spec checks divisibility).
  cache = "tensor" if heads and cache_kv_heads(model, tensor) % tensor == 0 else kv
  return {
    **sharding_lib.DEFAULT_RULES,
    "embed": None,
    "batch": None,
    "q_heads": heads,
    "act_heads": heads,
    "kv_heads": kv,
    CACHE_HEADS: cache,
  }


def cache_kv_heads(model: ModelConfig, tensor: int) -> int:
  """KV heads the cache carries on `tensor` chips: num_kv_heads, or `tensor` where the chips
  outnumber the heads and divide by them (each head duplicated so every chip holds one)."""
  return model.num_kv_heads * ragged_paged.kv_repeat(model, tensor)


def engine_layout(
  model: ModelConfig, mesh_cfg: ServingMeshConfig
) -> tuple[Mesh, Mapping[str, str | tuple[str, ...] | None]]:
  """(mesh, rules) a policy of this architecture is served with: what `load_policy` places a
  checkpoint's tensors by, so that the engine finds its weights where it computes."""
  mesh = make_engine_mesh(mesh_cfg)
  return mesh, engine_rules(model, mesh.shape["tensor"])


def cache_sharding(mesh: Mesh, rules: Mapping, shape: tuple[int, ...]) -> NamedSharding:
  """Sharding of one [slots, length, kv_heads, head_dim] cache buffer."""
  return NamedSharding(mesh, sharding_lib.logical_to_spec(CACHE_AXES, shape, mesh, rules))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())
