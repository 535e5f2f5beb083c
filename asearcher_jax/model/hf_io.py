"""Hugging Face checkpoint I/O: `config.json` + (sharded) `*.safetensors` <-> an NNX Transformer.

Loading never materialises the whole model on one host: the model is built abstractly with
`nnx.eval_shape`, and every parameter is assembled with `jax.make_array_from_callback`, which reads
from the memory-mapped safetensors file only the slice each device holds under the target sharding.
Names follow transformers' Qwen2/Qwen3 modules (`model.layers.3.self_attn.q_proj.weight`); torch
Linear weights are [out, in] and ours are [in, out], hence the transposes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding
from safetensors import SafetensorError, safe_open
from safetensors.flax import save_file

from asearcher_jax import distributed
from asearcher_jax.errors import CheckpointError
from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model.config import ModelConfig, from_hf_config, to_hf_config
from asearcher_jax.model.transformer import Transformer

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# Tensors transformers may save that carry no parameters of ours.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def hf_name(path: tuple[Any, ...]) -> tuple[str, bool]:
  """(Hugging Face tensor name, needs transpose) for one of our parameter paths."""
  parts = [str(p) for p in path]
  if parts == ["lm_head"]:
    return "lm_head.weight", False
  if parts == ["embed_tokens"]:
    return "model.embed_tokens.weight", False
  leaf = parts[-1]
  transpose = leaf == "kernel"
  parts[-1] = {"kernel": "weight", "scale": "weight", "bias": "bias"}[leaf]
  return "model." + ".".join(parts), transpose


def read_config(model_dir: str | Path) -> dict[str, Any]:
  model_dir = Path(model_dir)
  if not model_dir.is_dir():
    raise CheckpointError(f"checkpoint directory {str(model_dir)!r} does not exist")
  path = model_dir / "config.json"
  if not path.is_file():
    raise CheckpointError(f"no config.json in checkpoint directory {str(model_dir)!r}")
  try:
    return json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path} is not valid JSON: {e}") from e


class _TensorSource:
  """Name -> lazily sliced tensor over one or many safetensors files."""

  def __init__(self, model_dir: Path):
    index = model_dir / INDEX_FILE
    if index.is_file():
      try:
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
      except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
      files = sorted(set(weight_map.values()))
    else:
      files = sorted(p.name for p in model_dir.glob("*.safetensors"))
      weight_map = {}
    if not files:
      raise CheckpointError(f"no *.safetensors files in checkpoint directory {str(model_dir)!r}")
    self._handles = {}
    for name in files:
      path = model_dir / name
      if not path.is_file():
        raise CheckpointError(f"{INDEX_FILE} names {name!r}, which is missing from {model_dir}")
      try:
        self._handles[name] = safe_open(str(path), framework="flax")
      except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"corrupt safetensors file {str(path)!r}: {e}") from e
    self.where: dict[str, str] = {}
    for fname, h in self._handles.items():
      for key in h.keys():  # noqa: SIM118 (safe_open is not a mapping)
        self.where[key] = fname
    for key, fname in weight_map.items():
      if self.where.get(key) != fname:
        raise CheckpointError(f"{INDEX_FILE} maps {key!r} to {fname!r}, which does not hold it")

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._handles[self.where[name]].get_slice(name).get_shape())

  def read(self, name: str, index: tuple[slice, ...]) -> jax.Array:
    try:
      return self._handles[self.where[name]].get_slice(name)[index]
    except (SafetensorError, OSError, ValueError) as e:
      raise CheckpointError(f"cannot read tensor {name!r} from {self.where[name]!r}: {e}") from e


def _host_local_array(
  src: _TensorSource,
  name: str,
  transpose: bool,
  shape: tuple[int, ...],
  dtype: jnp.dtype,
  sharding: jax.sharding.Sharding,
) -> jax.Array:
  def read_shard(index: tuple[slice, ...]) -> np.ndarray:
    idx = tuple(index)
    if transpose:
      return np.asarray(src.read(name, idx[::-1]).T.astype(dtype))
    return np.asarray(src.read(name, idx).astype(dtype))

  return jax.make_array_from_callback(shape, sharding, read_shard)


def load(
  model_dir: str | Path,
  *,
  mesh: Mesh | None = None,
  rules: Mapping = sharding_lib.DEFAULT_RULES,
  config_overrides: Mapping[str, Any] | None = None,
) -> tuple[Transformer, ModelConfig]:
  """Loads a Hugging Face Qwen2/Qwen3 checkpoint; params placed with their mesh sharding.

  Raises CheckpointError naming the file or tensor for a missing path, a corrupt file, a missing
  or unexpected tensor or a shape mismatch; UnsupportedModelError for an unsupported config.
  """
  model_dir = Path(model_dir)
  cfg = from_hf_config(read_config(model_dir), **dict(config_overrides or {}))
  src = _TensorSource(model_dir)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  if mesh is not None:
    shardings = sharding_lib.param_shardings(state, mesh, rules)
    flat_shardings = dict(nnx.to_flat_state(shardings))
  else:
    flat_shardings = {}
  single = SingleDeviceSharding(jax.local_devices()[0])  # this process's own first device
  used: set[str] = set()
  flat = nnx.to_flat_state(state)
  for path, var in flat:
    name, transpose = hf_name(path)
    if name not in src.where:
      raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {model_dir}")
    want = tuple(var.get_value().shape)
    have = src.shape(name)
    expect = want[::-1] if transpose else want
    if have != expect:
      raise CheckpointError(
        f"tensor {name!r} has shape {list(have)}, expected {list(expect)} for {cfg.model_type} "
        f"(hidden={cfg.hidden_size}, layers={cfg.num_layers})"
      )
    sh = flat_shardings.get(path, single)
    var.set_value(_host_local_array(src, name, transpose, want, var.get_value().dtype, sh))
    used.add(name)
  unexpected = sorted(
    k for k in set(src.where) - used
    if not k.endswith(_IGNORED_SUFFIXES) and not (k == "lm_head.weight" and cfg.tie_word_embeddings)
  )  # fmt: skip
  if unexpected:
    more = f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
    raise CheckpointError(
      f"unexpected tensors in checkpoint {str(model_dir)!r}: {unexpected[:5]}{more}"
    )
  return nnx.merge(graphdef, nnx.from_flat_state(flat)), cfg


def save(
  model: Transformer,
  out_dir: str | Path,
  *,
  max_shard_bytes: int = 5 * 2**30,
  dtype: str | None = None,
  extra_files: Mapping[str, Callable[[Path], None]] | None = None,
) -> Path:
  """Writes config.json and safetensors (sharded with an index above max_shard_bytes).

  The output loads with transformers' `AutoModelForCausalLM.from_pretrained` and with `load`.
  In a multi-process program every process must call it (a tensor sharded across processes is
  gathered with a collective); only process 0 writes, and returns the same path.
  """
  out_dir = Path(out_dir)
  lead = distributed.is_lead()
  if lead:
    out_dir.mkdir(parents=True, exist_ok=True)
  cfg: ModelConfig = model.cfg
  out_dtype = jnp.dtype(dtype or cfg.param_dtype)
  hf_cfg = to_hf_config(cfg.replace(param_dtype=str(out_dtype)))
  _, state = nnx.split(model)
  shards: list[dict[str, jax.Array]] = [{}]
  size = 0
  for path, var in nnx.to_flat_state(state):
    name, transpose = hf_name(path)
    # One tensor at a time on the host (gathered only when other processes hold parts of it).
    host = distributed.gather_to_host(var.get_value())
    if not lead:
      continue
    arr = jnp.asarray(host.T if transpose else host, dtype=out_dtype)
    nbytes = arr.size * arr.dtype.itemsize
    if size and size + nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = arr
    size += nbytes
  if not lead:
    return out_dir
  for old in out_dir.glob("*.safetensors"):
    old.unlink()
  if len(shards) == 1:
    save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / INDEX_FILE).unlink(missing_ok=True)
  else:
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
      fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
      save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
      for k, v in shard.items():
        weight_map[k] = fname
        total += v.size * v.dtype.itemsize
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))
  (out_dir / "config.json").write_text(json.dumps(hf_cfg, indent=2))
  for fname, writer in (extra_files or {}).items():
    writer(out_dir / fname)
  return out_dir
