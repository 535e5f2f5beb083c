"""The learner's programs compiled ahead of time for a TPU slice that is not there.

libtpu's compiler runs on any Linux x86-64 host: `jax.experimental.topologies` gives the devices
of a named slice (`v5p-32`: 16 chips in a 2x2x4 torus), and `jit(...).lower(abstract args)
.compile()` compiles for them. Compiled for the learner's own mesh, from its own train state and
minibatch shapes with their shardings (`steps.abstract_train_state`: no weights, no data), the
optimizer step and the proximal log-prob pass report what each chip needs (XLA's memory
analysis: arguments, temporaries, outputs; donated arguments alias outputs) and the FLOPs of a
step: an OOM is found before a slice is paid for (MaxText's train_compile.py does the same).

The programs are `learner.compile_steps`, the functions the Learner runs; and, for a serving
replica, the paged engine step (`compile_serving`: decode and prefill over a paged cache with
the ragged paged attention kernel).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from asearcher_jax import tpu_env
from asearcher_jax.errors import ConfigValueError
from asearcher_jax.model import attention as attention_lib
from asearcher_jax.model import ragged_paged, steps
from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.rl import learner as learner_lib

GIB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuSlice:
  """One Cloud TPU slice as `jax.experimental.topologies` names it."""

  # The Cloud TPU name: v4 and v5p count TensorCores (2 a chip), v5e and v6e chips.
  name: str
  # Chips in the slice (one JAX device each: v4 and v5p run megacore).
  chips: int
  # libtpu's topology string, e.g. "v5p:2x2x4" (3-D torus for v4/v5p, 2-D for v5e/v6e).
  topology: str
  # Chips per host along each axis (a host has 4 chips, v5e/v6e-8 hosts 8).
  chips_per_host: tuple[int, int, int]
  # libtpu's chip configuration: "megacore" fuses v4's two TensorCores into one device.
  chip_config: str
  # HBM per chip, GiB (Cloud TPU system architecture tables).
  hbm_gib: float


def _slices() -> dict[str, TpuSlice]:
  out = {}
  torus = {8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4"}
  for gen, hbm, config in (("v4", 32.0, "megacore"), ("v5p", 95.0, "default")):
    for cores, shape in torus.items():
      out[f"{gen}-{cores}"] = TpuSlice(
        name=f"{gen}-{cores}", chips=cores // 2, topology=f"{gen}:{shape}",
        chips_per_host=(2, 2, 1), chip_config=config, hbm_gib=hbm,
      )  # fmt: skip
  grid = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
  for gen, hbm in (("v5e", 16.0), ("v6e", 32.0)):
    for chips, shape in grid.items():
      out[f"{gen}-{chips}"] = TpuSlice(
        name=f"{gen}-{chips}", chips=chips, topology=f"{gen}:{shape}",
        chips_per_host=(2, 4, 1) if chips == 8 else (2, 2, 1), chip_config="default",
        hbm_gib=hbm,
      )  # fmt: skip
  return out


# Named slices a compile can target (each one checked against libtpu 0.0.42.1 on this host).
SLICES: dict[str, TpuSlice] = _slices()


# gcloud's accelerator-type prefixes that differ from the generation's name ("v5litepod-16" is
# v5e-16): either spelling names a slice here, as in launch specs (launch/spec.py).
GCLOUD_PREFIXES = {"v5litepod": "v5e"}


def slice_name(name: str) -> str:
  """The SLICES name of a slice spelled either way ('v5litepod-16' -> 'v5e-16'); unknown names
  are returned as given."""
  prefix, dash, size = name.strip().rpartition("-")
  return f"{GCLOUD_PREFIXES.get(prefix, prefix)}-{size}" if dash else name


def tpu_slice(name: str) -> TpuSlice:
  """The slice called `name` (either spelling); an unknown one is one line listing the known
  ones."""
  canonical = slice_name(name)
  if canonical not in SLICES:
    aliases = ", ".join(f"{g}-N = {n}-N" for g, n in GCLOUD_PREFIXES.items())
    raise ConfigValueError(f"unknown TPU slice {name!r} (known: {', '.join(SLICES)}; {aliases})")
  return SLICES[canonical]


def slice_for(generation: str, chips: int) -> TpuSlice:
  """The slice of `chips` chips of a generation (a recipe's plan: chip "v5p", 16 chips)."""
  found = [s for s in SLICES.values() if s.name.startswith(f"{generation}-") and s.chips == chips]
  if not found:
    raise ConfigValueError(
      f"no known {generation} slice has {chips} chips (known: {', '.join(SLICES)})"
    )
  return found[0]


def require_libtpu() -> None:
  """Raises ConfigValueError (one line, the install command) when libtpu is not installed."""
  if not tpu_env.libtpu_installed():
    raise ConfigValueError(f"compiling for a TPU slice needs libtpu: {tpu_env.INSTALL_HINT}")


def slice_devices(s: TpuSlice) -> list:
  """The devices of slice `s` (no TPU needed; run `tpu_env.for_ahead_of_time` before jax
  starts a backend on a host without one, or libtpu prints its metadata warnings)."""
  require_libtpu()
  from jax.experimental import topologies

  tpu_env.for_ahead_of_time()  # libtpu reads these when it starts, which is now
  topology = topologies.get_topology_desc(
    platform="tpu", topology_name=s.topology, chip_config_name=s.chip_config,
    chips_per_host_bounds=s.chips_per_host, num_slices=1,
  )  # fmt: skip
  devices = list(topology.devices)
  if len(devices) != s.chips:
    raise RuntimeError(f"{s.name}: libtpu gave {len(devices)} devices for {s.chips} chips")
  return devices


def with_attention(model: ModelConfig, choice: str | None, platform: str) -> ModelConfig:
  """`model` with its attention resolved for the platform compiled for (the host's own
  platform would pick the CPU kernel for a TPU program). choice None keeps the model's own."""
  return model.replace(
    attention=attention_lib.resolve_attention(choice or model.attention, platform)
  )


def attention_of(model: ModelConfig) -> str:
  """The attention a model config computes with."""
  return model.attention


def abstract_batch(rows: int, row_len: int, mesh: Mesh, rules: Mapping) -> dict[str, Any]:
  """A packed minibatch as the learner feeds it (`learner.DEVICE_KEYS`, [rows, row_len], rows
  over data x fsdp), as ShapeDtypeStructs."""
  sharding = sharding_lib.batch_sharding(mesh, rules=rules)
  dtypes = {"tokens": jnp.int32, "positions": jnp.int32, "segment_ids": jnp.int32}
  return {
    k: jax.ShapeDtypeStruct((rows, row_len), dtypes.get(k, jnp.float32), sharding=sharding)
    for k in learner_lib.DEVICE_KEYS
  }


def memory_report(compiled: Any, hbm_bytes: float) -> dict[str, Any]:
  """Per-chip bytes of a compiled program by XLA's accounting; total = arguments + temporaries
  + outputs not aliased to (donated) arguments."""
  m = compiled.memory_analysis()
  total = (
    m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
  )
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, Sequence) else cost  # older jax: one dict per module
  return {
    "argument_bytes": int(m.argument_size_in_bytes),
    "temp_bytes": int(m.temp_size_in_bytes),
    "output_bytes": int(m.output_size_in_bytes),
    "alias_bytes": int(m.alias_size_in_bytes),
    "total_bytes": int(total),
    "total_gib": round(total / GIB, 3),
    "fits": bool(total <= hbm_bytes),
    "flops_per_chip": float((cost or {}).get("flops", 0.0)),
  }


_OOM = re.compile(r"required for (?P<what>[\w ]+?) \((?P<size>[\d.]+)(?P<unit>[KMGT]?)\)")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def argument_bytes(args: Any) -> int:
  """Bytes per chip of abstract arguments: each one's shard (device 0's, the largest)."""
  return sum(
    math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
    for x in jax.tree.leaves(args)
    if isinstance(x, jax.ShapeDtypeStruct)
  )


def out_of_memory_report(message: str, args: Any, hbm_bytes: float) -> dict[str, Any]:
  """The report of a program the TPU compiler refused because it exceeds the chip's HBM
  (RESOURCE_EXHAUSTED): the temporaries it names, the arguments' shards, and their sum as a
  lower bound of the total (no output figure: nothing was compiled)."""
  m = _OOM.search(message)
  temp = int(float(m.group("size")) * _UNITS[m.group("unit")]) if m else 0
  args_b = argument_bytes(args)
  return {
    "argument_bytes": args_b,
    "temp_bytes": temp,
    "output_bytes": None,
    "alias_bytes": None,
    "total_bytes": args_b + temp,
    "total_gib": round((args_b + temp) / GIB, 3),
    "total_is_lower_bound": True,
    "fits": False,
    "flops_per_chip": None,
    "error": message.strip().splitlines()[0][:300],
  }


def compile_report(fn: Any, args: Sequence[Any], hbm_bytes: float) -> dict[str, Any]:
  """Lowers and compiles jitted `fn` for `args` (abstract, with shardings): `memory_report`, or
  `out_of_memory_report` when the compiler finds it does not fit; plus compile_s."""
  t0 = time.perf_counter()
  try:
    report = memory_report(fn.lower(*args).compile(), hbm_bytes)
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    report = out_of_memory_report(str(e), args, hbm_bytes)
  return {**report, "compile_s": round(time.perf_counter() - t0, 2)}


def compile_learner(
  model: ModelConfig,
  *,
  devices: Sequence,
  hbm_gib: float,
  ppo: learner_lib.PPOConfig,
  optimizer: steps.OptimizerConfig = steps.OptimizerConfig(),
  precision: steps.PrecisionConfig = steps.PrecisionConfig(),
  mesh: sharding_lib.MeshConfig = sharding_lib.MeshConfig(),
  rules: Mapping = sharding_lib.DEFAULT_RULES,
  rows_per_shard: int | None = None,
  score: bool = True,
) -> dict[str, Any]:
  """Compiles the learner's optimizer step (and, with `score`, its proximal log-prob pass) for
  `devices` (`slice_devices`), the model in its attention as given (`with_attention`), and
  returns the per-chip report: `train` and `score` (`memory_report` + compile_s), the mesh, the
  minibatch rows.

  rows_per_shard: rows of the compiled minibatch per data shard; None = two micro-batches
  (2 x ppo.micro_rows), so the step accumulates gradients as it does on any larger bucket
  (one row when micro_rows is None). The prox pass scores that minibatch in one pass."""
  m = mesh.build(devices=list(devices))
  shards = learner_lib.num_shards(m)
  if rows_per_shard is None:
    rows_per_shard = 2 * ppo.micro_rows if ppo.micro_rows is not None else 1
  rows = rows_per_shard * shards
  opt = steps.make_optimizer(optimizer)
  graphdef, params = steps.abstract_params(
    model, mesh=m, rules=rules, master_dtype=precision.master_dtype,
    stacked=steps.trains_stacked(model),
  )  # fmt: skip
  state = steps.abstract_train_state(params, opt)
  train_fn, score_fn = learner_lib.compile_steps(
    graphdef, state, ppo=ppo, optimizer=opt, mesh=m, rules=rules
  )
  batch = abstract_batch(rows, ppo.row_len, m, rules)
  hbm = hbm_gib * GIB
  out: dict[str, Any] = {
    "chips": len(devices),
    "mesh": dict(m.shape),
    "rows": rows,
    "row_len": ppo.row_len,
    "micro_batch_rows": ppo.micro_batch_rows(shards),
    "attention": attention_of(model),
    "params_b": round(model.num_params() / 1e9, 3),
    "hbm_gib_per_chip": hbm_gib,
  }
  out["train"] = compile_report(train_fn, (state, batch), hbm)
  if score:
    inputs = {k: batch[k] for k in ("tokens", "positions", "segment_ids")}
    # static temperature: jit's static_argnums take it at lower time
    out["score"] = compile_report(score_fn, (state.params, inputs, ppo.temperature), hbm)
    # With one minibatch a step takes pi_prox from its own forward (PPOConfig.prox_in_step).
    out["score"]["runs"] = bool(ppo.recompute_prox and not ppo.prox_in_step)
  return out


def compile_for_slice(
  model: ModelConfig, slice_name: str, *, attention: str | None = None, **kwargs: Any
) -> dict[str, Any]:
  """`compile_learner` for the named slice (`SLICES`), attention resolved for TPU; the report
  adds the slice's name and topology."""
  s = tpu_slice(slice_name)
  model = with_attention(model, attention, "tpu")
  report = compile_learner(model, devices=slice_devices(s), hbm_gib=s.hbm_gib, **kwargs)
  return {"topology": s.name, "topology_desc": s.topology, **report}


# The ragged kernel's tiling in the serving compiles (its own defaults).
SERVING_BLOCKS = ragged_paged.RaggedBlocks()


def compile_serving(
  model: ModelConfig,
  *,
  devices: Sequence,
  hbm_gib: float,
  slots: int,
  pages: int,
  page_size: int,
  pages_per_seq: int,
  prefill_tokens: int,
  blocks: ragged_paged.RaggedBlocks = SERVING_BLOCKS,
) -> dict[str, Any]:
  """Compiles one serving replica's engine step for `devices` (tensor parallel over all of
  them, serving/mesh.py's layout): `ragged_paged.paged_step` with the TPU kernel over a combined
  paged cache of `pages` pages a layer (KV heads duplicated to the chips where they outnumber
  them), as a decode step (one token for each of `slots` sequences) and as a prefill step (a
  chunk of `prefill_tokens` tokens). The cache is donated (updated in place). Returns the
  per-chip `memory_report` + compile_s of each, and the layout."""
  from asearcher_jax.serving import mesh as serving_mesh

  tp = len(devices)
  m = sharding_lib.make_mesh(data=1, fsdp=1, tensor=tp, devices=list(devices))
  rules = serving_mesh.engine_rules(model, tp)
  graphdef, params = steps.abstract_params(model, mesh=m, rules=rules)
  repeat = ragged_paged.kv_repeat(model, tp)
  heads = model.num_kv_heads * repeat
  shape = (pages, page_size, 2 * heads, model.resolved_head_dim)
  pool = NamedSharding(
    m, sharding_lib.logical_to_spec((None, None, serving_mesh.CACHE_HEADS, None), shape, m, rules)
  )
  kv = tuple(
    jax.ShapeDtypeStruct(shape, jnp.dtype(model.dtype), sharding=pool)
    for _ in range(model.num_layers)
  )
  rep = NamedSharding(m, PartitionSpec())

  def i32(*dims: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(dims, jnp.int32, sharding=rep)

  def step(params, kv, tokens, positions, page_table, lengths, cu_q_lens, num_seqs):
    policy = nnx.merge(graphdef, params)
    with sharding_lib.activation_sharding(m, rules):
      return ragged_paged.paged_step(
        policy, tokens, positions, kv, page_table, lengths, cu_q_lens, num_seqs,
        kernel=True, repeat=repeat, blocks=blocks,
      )  # fmt: skip

  fn = jax.jit(step, donate_argnums=1, out_shardings=(None, (pool,) * model.num_layers))
  table = (i32(slots, pages_per_seq), i32(slots), i32(slots + 1), i32(1))
  hbm = hbm_gib * GIB
  out: dict[str, Any] = {
    "chips": tp,
    "slots": slots,
    "pages": pages,
    "page_size": page_size,
    "pages_per_seq": pages_per_seq,
    "kv_heads_per_chip": heads // tp if heads % tp == 0 else heads,
    "kv_repeat": repeat,
    "kv_cache_gib_per_chip": round(argument_bytes(kv) / GIB, 3),
    "prefill_tokens": prefill_tokens,
    "hbm_gib_per_chip": hbm_gib,
  }
  out["decode"] = compile_report(fn, (params, kv, i32(slots), i32(slots), *table), hbm)
  n = prefill_tokens
  out["prefill"] = compile_report(fn, (params, kv, i32(n), i32(n), *table), hbm)
  return out


def compile_engine_decode(
  model: ModelConfig,
  engine_cfg: Any,
  *,
  slice_name: str,
  window: int,
  mode: str = "greedy",
) -> dict[str, Any]:
  """Compiles the engine's own decode step (`engine_steps.GENERATE`: every slot one token, what
  the driver dispatches) for one serving replica on the named slice, tensor parallel over its
  chips, with the decode state `Engine.init_decode_state` would build there (`engine_cfg`, an
  `EngineConfig`: with kv_layout "paged" and paged_attention "auto" or "ragged", the ragged
  kernel reads the pools in place). `window` is the attended length (a prefill bucket). Returns
  the per-chip `memory_report` + compile_s, whether the Pallas kernel is in the program, and the
  pools' KV heads per chip."""
  from asearcher_jax.serving import engine as engine_lib
  from asearcher_jax.serving import engine_steps
  from asearcher_jax.serving import mesh as serving_mesh

  s = tpu_slice(slice_name)
  devices = slice_devices(s)
  tp = len(devices)
  m = sharding_lib.make_mesh(data=1, fsdp=1, tensor=tp, devices=devices)
  rules = serving_mesh.engine_rules(model, tp)
  graphdef, params = steps.abstract_params(model, mesh=m, rules=rules)
  rep = NamedSharding(m, PartitionSpec())
  version = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
  versioned = engine_steps.VersionedParams(state=params, version=version)
  make, shardings = engine_lib.decode_state_program(model, engine_cfg, m)
  state = jax.tree.map(
    lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), jax.eval_shape(make),
    shardings,
  )  # fmt: skip
  t0 = time.perf_counter()
  lowered = engine_steps.GENERATE.lower(graphdef, window, mode, versioned, state)
  report = memory_report(lowered.compile(), s.hbm_gib * GIB)
  pool = state.cache.kv[0] if engine_cfg.kv_layout == "paged" else state.cache.k[0]
  per_chip = pool.sharding.shard_shape(pool.shape)[2]
  return {
    "topology": s.name,
    "chips": tp,
    "paged_attention": getattr(state.cache, "attention", None),
    "kernel_in_program": "tpu_custom_call" in lowered.as_text(),
    "kv_repeat": ragged_paged.kv_repeat(model, tp),
    "kv_heads_per_chip": per_chip // 2 if engine_cfg.kv_layout == "paged" else per_chip,
    **report,
    "compile_s": round(time.perf_counter() - t0, 2),
  }


def engine_compiler(hbm_bytes: float) -> Any:
  """The compile step of an ahead-of-time engine (`serving.engine_aot.Compiler`): the program
  compiled and its per-chip `memory_report`, or None and `out_of_memory_report` when the TPU
  compiler refuses it for memory."""

  def compile_(lowered: Any, args: Sequence[Any]) -> tuple[Any, dict[str, Any]]:
    try:
      compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      return None, out_of_memory_report(str(e), args, hbm_bytes)
    finally:
      # jax keeps every program's jaxpr, MLIR module and executable in caches keyed on the
      # jit's traced jaxpr, which lives as long as the jit: a whole warm-up of a 7B replica
      # (~50 programs) held them all at once, past this host's 24 GB. Each program is traced
      # afresh instead; the caller keeps only the report and the output shardings.
      jax.clear_caches()
    return compiled, memory_report(compiled, hbm_bytes)

  return compile_


def largest_programs(cfg: Any) -> Any:
  """An `EngineConfig` whose warm-up compiles only the largest programs of each step: the
  longest prefill bucket at every admission width its token cap allows, the longest suffix over
  the longest window, every slot's decode. Memory follows these (the weights and pools are every program's
  arguments); a fit check compiles them in minutes where a whole warm-up takes an hour."""
  return dataclasses.replace(
    cfg, prefill_buckets=(cfg.max_seq_len,), suffix_buckets=(), decode_rows=()
  )


def engine_arguments_gib(
  model: ModelConfig, engine_cfg: Any, devices: Sequence
) -> dict[str, float]:
  """Per-chip GiB of what every engine program takes as arguments on `devices` (the weights in
  the engine's shardings and the decode state: the KV cache or page pools), without compiling:
  a replica whose arguments alone exceed the chip is refused in a second."""
  from asearcher_jax.serving import engine as engine_lib
  from asearcher_jax.serving import mesh as serving_mesh

  m = serving_mesh.make_engine_mesh(engine_cfg.mesh, devices=devices)
  rules = serving_mesh.engine_rules(model, m.shape["tensor"])
  _, params = steps.abstract_params(model, mesh=m, rules=rules)
  make, shardings = engine_lib.decode_state_program(model, engine_cfg, m)
  state = jax.tree.map(
    lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), jax.eval_shape(make),
    shardings,
  )  # fmt: skip
  pool = state.cache.kv[0] if engine_cfg.kv_layout == "paged" else state.cache.k[0]
  heads = pool.sharding.shard_shape(pool.shape)[2]
  return {
    "chips": m.shape["tensor"],
    # KV heads each chip keeps (a paged pool stores keys and values of a head side by side)
    "kv_heads_per_chip": heads // 2 if engine_cfg.kv_layout == "paged" else heads,
    "weights_gib": round(argument_bytes(params) / GIB, 3),
    "decode_state_gib": round(argument_bytes(state) / GIB, 3),
  }


def learner_arguments_gib(
  model: ModelConfig,
  *,
  devices: Sequence,
  optimizer: steps.OptimizerConfig = steps.OptimizerConfig(),
  precision: steps.PrecisionConfig = steps.PrecisionConfig(),
  mesh: sharding_lib.MeshConfig = sharding_lib.MeshConfig(),
  rules: Mapping = sharding_lib.DEFAULT_RULES,
) -> dict[str, Any]:
  """Per-chip GiB of the learner's train state (master weights and optimizer moments in their
  shardings) on `devices`, without compiling: the floor under every train step."""
  m = mesh.build(devices=list(devices))
  _, params = steps.abstract_params(
    model, mesh=m, rules=rules, master_dtype=precision.master_dtype,
    stacked=steps.trains_stacked(model),
  )  # fmt: skip
  state = steps.abstract_train_state(params, steps.make_optimizer(optimizer))
  return {"mesh": dict(m.shape), "train_state_gib": round(argument_bytes(state) / GIB, 3)}
