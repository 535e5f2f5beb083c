"""Pure step functions (score, loss, train) and their jitted, mesh-sharded forms.

The functions take `(graphdef, params)` instead of a stateful module so that jit sees only arrays;
`compile_*` wraps them with explicit in/out shardings and donates the train state, so a step
updates parameters and optimizer state in place on every device.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.model.transformer import (
  Transformer,
  is_stacked,
  score,
  score_and_entropy,
  stack_params,
  unstack_params,
)

Batch = Mapping[str, jax.Array]  # tokens, positions, segment_ids [B, T] (+ loss_mask, ...)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
  """AdamW with warmup + cosine decay and global-norm clipping.

  Attributes:
    learning_rate: peak learning rate after warmup.
    warmup_steps: linear warmup from 0; 0 disables warmup.
    total_steps: steps of the cosine decay; None keeps the peak rate constant after warmup.
    end_lr_ratio: final rate as a fraction of the peak (cosine only).
    b1: Adam first-moment decay.
    b2: Adam second-moment decay.
    eps: Adam epsilon.
    weight_decay: decoupled weight decay on matrices (norm scales and biases are not decayed).
    grad_clip: clip gradients to this global norm; None disables clipping.
  """

  learning_rate: float = 1e-6
  warmup_steps: int = 0
  total_steps: int | None = None
  end_lr_ratio: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.01
  grad_clip: float | None = 1.0


def _decayed(params: Any) -> Any:
  """Weight decay on matrices only (not norms or biases), counting a stacked layer's leaf by
  the rank of one layer's slice (`Transformer.stack` adds a leading layer axis)."""

  def one(path, x) -> bool:
    stacked = any(getattr(k, "key", None) == "stacked_layers" for k in path)
    return x.ndim - int(stacked) >= 2

  return jax.tree_util.tree_map_with_path(one, params)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  if cfg.total_steps:
    schedule = optax.warmup_cosine_decay_schedule(
      0.0, cfg.learning_rate, max(cfg.warmup_steps, 0), max(cfg.total_steps, cfg.warmup_steps + 1),
      end_value=cfg.learning_rate * cfg.end_lr_ratio,
    )  # fmt: skip
  elif cfg.warmup_steps:
    schedule = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
  else:
    schedule = cfg.learning_rate
  parts = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip else []
  parts.append(
    optax.adamw(
      schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
      mask=_decayed,
    )
  )  # fmt: skip
  return optax.chain(*parts)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
  """Mixed precision: what the optimizer updates vs what the forward pass computes in.

  A bf16 checkpoint trained in pure bf16 loses most updates at RL learning rates: a weight of
  magnitude ~0.02 has a bf16 spacing of ~1e-4, so an Adam step of ~1e-6 rounds back to the same
  value. The learner therefore keeps master parameters (and, through them, Adam's moments) in
  `master_dtype`, while matmuls run in the model config's `dtype` (bf16 on accelerators); the
  engine gets a copy cast back to the dtype each parameter was loaded in.
  """

  # Dtype of the master parameters and optimizer moments; None keeps each parameter's own.
  master_dtype: str | None = "float32"


def cast_floating(tree: Any, dtype: str | None) -> Any:
  """`tree` with every floating-point leaf cast to `dtype`; None returns it unchanged."""
  if dtype is None:
    return tree
  dt = jnp.dtype(dtype)
  return jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: nnx.State
  opt_state: optax.OptState


def train_state_shardings(
  params: nnx.State, optimizer: optax.GradientTransformation
) -> TrainState | None:
  """Shardings of the train state over `params`' mesh (None when no parameter is on a mesh):
  each parameter's own, Adam's moments those of their parameters (`optax.tree_map_params`),
  scalars (step, Adam's count) replicated. A jitted `optimizer.init` alone leaves XLA free to
  place the moments, and it replicated every one of them on every chip (measured over fsdp=4:
  two fp32 copies of the whole model per chip). `params` may be arrays or ShapeDtypeStructs."""
  mesh_sharding = next(
    (x.sharding for x in jax.tree.leaves(params) if isinstance(x.sharding, NamedSharding)), None
  )
  if mesh_sharding is None:
    return None
  replicated = NamedSharding(mesh_sharding.mesh, PartitionSpec())
  own = jax.tree.map(
    lambda x: x.sharding if isinstance(x.sharding, NamedSharding) else replicated, params
  )
  opt_state = optax.tree_map_params(
    optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, params), own,
    transform_non_params=lambda _: replicated,
  )  # fmt: skip
  return TrainState(step=replicated, params=own, opt_state=opt_state)


def init_train_state(params: nnx.State, optimizer: optax.GradientTransformation) -> TrainState:
  """The step counter and optimizer state for `params`, placed per `train_state_shardings`."""
  shardings = train_state_shardings(params, optimizer)
  if shardings is None:
    return TrainState(
      step=jnp.zeros((), jnp.int32), params=params, opt_state=jax.jit(optimizer.init)(params)
    )
  opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
  params = jax.tree.map(
    lambda x, s: x if x.sharding == s else sharding_lib.put(x, s), params, shardings.params
  )
  step = sharding_lib.put(jnp.zeros((), jnp.int32), shardings.step)
  return TrainState(step=step, params=params, opt_state=opt_state)


def abstract_train_state(params: nnx.State, optimizer: optax.GradientTransformation) -> TrainState:
  """The train state `init_train_state` would build, as ShapeDtypeStructs with the same
  shardings: what an ahead-of-time compile takes, with no memory allocated. `params` are
  ShapeDtypeStructs (with shardings for a mesh, see `abstract_params`)."""
  abstract = jax.eval_shape(
    lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=optimizer.init(p)),
    params,
  )
  shardings = train_state_shardings(params, optimizer)
  if shardings is None:
    return abstract
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings
  )


def abstract_params(
  cfg: ModelConfig,
  *,
  mesh: Mesh | None = None,
  rules: Mapping = sharding_lib.DEFAULT_RULES,
  master_dtype: str | None = None,
  stacked: bool = False,
) -> tuple[nnx.GraphDef, nnx.State]:
  """The model's graphdef and its parameters as ShapeDtypeStructs (`jax.eval_shape` of the
  init: no weights exist), floating ones in `master_dtype` (None: their own), each with the
  sharding `sharding.param_shardings` gives it over `mesh`; `stacked` gives the learner's form
  (`train_form`)."""

  def build() -> Transformer:
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    if stacked:
      model.stack()
    return model

  graphdef, params = nnx.split(nnx.eval_shape(build))
  dt = None if master_dtype is None else jnp.dtype(master_dtype)

  def dtype(x):
    return dt if dt is not None and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype

  if mesh is None:
    return graphdef, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype(x)), params)
  shardings = sharding_lib.param_shardings(params, mesh, rules)
  return graphdef, jax.tree.map(
    lambda s, var: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype(x), sharding=s), var),
    shardings, params,
  )  # fmt: skip


def trains_stacked(cfg: ModelConfig) -> bool:
  """Whether the learner keeps this model's layers stacked: under `scan_layers` (see
  `Transformer`). The one place that decides it (`train_form`, and the AOT compile's
  `abstract_params(stacked=...)`)."""
  return cfg.scan_layers


def train_form(
  graphdef: nnx.GraphDef,
  params: nnx.State,
  *,
  mesh: Mesh | None = None,
  rules: Mapping = sharding_lib.DEFAULT_RULES,
) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef, params) as the learner keeps them: stacked when `trains_stacked`, each leaf on
  its `param_shardings` over `mesh`. The caller's list-form arrays are left intact (they may be
  the engine's first weights); the stacked copy is built in one jitted call."""
  if is_stacked(params) or not trains_stacked(nnx.merge(graphdef, params).cfg):
    return graphdef, params
  out = {}

  def stack(p: nnx.State) -> nnx.State:
    out["graphdef"], stacked = stack_params(graphdef, p)
    return stacked

  shardings = None
  if mesh is not None:
    shardings = sharding_lib.param_shardings(jax.eval_shape(stack, params), mesh, rules)
  stacked = jax.jit(stack, out_shardings=shardings)(params)
  return out["graphdef"], stacked


def list_form(graphdef: nnx.GraphDef, params: nnx.State) -> nnx.State:
  """`params` with one module per layer (the inverse of `train_form`; new buffers when they
  were stacked, the same ones otherwise): what the engine, hf_io and exports read."""
  if not is_stacked(params):
    return params
  return _unstack_jit(graphdef, params)


@functools.partial(jax.jit, static_argnums=0)
def _unstack_jit(graphdef: nnx.GraphDef, params: nnx.State) -> nnx.State:
  return unstack_params(graphdef, params)[1]


def score_batch(
  graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, temperature: float = 1.0
) -> jax.Array:
  """Per-token logprobs [B, T] of a packed batch (see transformer.score for alignment)."""
  model: Transformer = nnx.merge(graphdef, params)
  return score(model, batch["tokens"], batch["positions"], batch["segment_ids"], temperature)


def score_batch_and_entropy(
  graphdef: nnx.GraphDef, params: nnx.State, batch: Batch, temperature: float = 1.0
) -> tuple[jax.Array, jax.Array]:
  """Per-token logprobs and sampling-distribution entropies [B, T] from one forward pass (see
  transformer.score_and_entropy); the entropy carries no gradient."""
  model: Transformer = nnx.merge(graphdef, params)
  return score_and_entropy(
    model, batch["tokens"], batch["positions"], batch["segment_ids"], temperature
  )


def nll_loss(
  graphdef: nnx.GraphDef, params: nnx.State, batch: Batch
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Token-level mean negative log-likelihood over tokens with loss_mask = 1 (SFT, benchmarks)."""
  lp = score_batch(graphdef, params, batch)
  mask = batch["loss_mask"].astype(jnp.float32)
  n = jnp.maximum(mask.sum(), 1.0)
  loss = -(lp * mask).sum() / n
  return loss, {"loss": loss, "tokens": mask.sum()}


LossFn = Callable[[nnx.GraphDef, nnx.State, Batch], tuple[jax.Array, dict[str, jax.Array]]]


def train_step(
  graphdef: nnx.GraphDef,
  optimizer: optax.GradientTransformation,
  loss_fn: LossFn,
  state: TrainState,
  batch: Batch,
  micro_rows: int | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer update on one batch.

  micro_rows: rows per forward/backward pass. A batch with more rows is cut into micro-batches
  of this many (rows strided across the batch, so each spans every data shard), run one after
  another in a scan, and their gradients summed with weights (loss tokens of the micro-batch) /
  (loss tokens of the batch): for a token-level-mean loss over `loss_mask` this is exactly the
  whole batch's gradient, while XLA holds one micro-batch's activations at a time (measured on
  XLA:CPU: ~630 MB of temporaries per 2,048-token row of the PPO step).
  """

  def grad_fn(b: Batch):
    fn = jax.value_and_grad(lambda p: loss_fn(graphdef, p, b), has_aux=True)
    (_, metrics), grads = fn(state.params)
    return grads, metrics

  rows = batch["loss_mask"].shape[0]
  if micro_rows is None or rows <= micro_rows:
    grads, metrics = grad_fn(batch)
  else:
    grads, metrics = _accumulated_grads(grad_fn, state.params, batch, rows, micro_rows)
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {**metrics, "grad_norm": optax.tree.norm(grads)}
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def _accumulated_grads(grad_fn, params: nnx.State, batch: Batch, rows: int, micro_rows: int):
  """Gradient and metrics of `batch` from micro-batches of `micro_rows` rows (see train_step)."""
  if rows % micro_rows:
    raise ValueError(f"{rows} rows do not split into micro-batches of {micro_rows}")
  m = rows // micro_rows
  # Row j of micro-batch i is batch row j * m + i: strided, so every micro-batch spans the shards.
  micro = jax.tree.map(lambda x: x.reshape(micro_rows, m, *x.shape[1:]).swapaxes(0, 1), batch)
  counts = (micro["loss_mask"] > 0).sum(axis=(1, 2)).astype(jnp.float32)
  weights = counts / jnp.maximum(counts.sum(), 1.0)

  def body(acc, xs):
    b, w = xs
    grads, metrics = grad_fn(b)
    return jax.tree.map(lambda a, g: a + w * g, acc, grads), metrics

  zeros = jax.tree.map(jnp.zeros_like, params)
  grads, per_micro = jax.lax.scan(body, zeros, (micro, weights))
  return grads, combine_micro_metrics(per_micro, weights)


def combine_micro_metrics(
  per_micro: dict[str, jax.Array], weights: jax.Array
) -> dict[str, jax.Array]:
  """Per-micro-batch metrics [M] -> one value each: token counts summed, maxima maximised,
  token-level means weighted by each micro-batch's share of the loss tokens."""
  out = {}
  for k, v in per_micro.items():
    if k.endswith("tokens"):
      out[k] = v.sum()
    elif k.endswith("_max"):
      out[k] = v.max()
    else:
      out[k] = (v * weights).sum()
  return out


def _with_activation_sharding(fn, mesh: Mesh | None, rules: Mapping):
  if mesh is None:
    return fn

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with sharding_lib.activation_sharding(mesh, rules):
      return fn(*args, **kwargs)

  return wrapped


def shardings_of(tree: Any) -> Any:
  return jax.tree.map(lambda x: x.sharding, tree)


def compile_train_step(
  graphdef: nnx.GraphDef,
  optimizer: optax.GradientTransformation,
  loss_fn: LossFn,
  state: TrainState,
  *,
  mesh: Mesh | None = None,
  rules: Mapping = sharding_lib.DEFAULT_RULES,
  micro_rows: int | None = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
  """Jitted train step: state shardings taken from `state`, batch sharded over data x fsdp,
  metrics replicated; the input state is donated. micro_rows: see `train_step`."""
  fn = _with_activation_sharding(
    functools.partial(train_step, graphdef, optimizer, loss_fn, micro_rows=micro_rows),
    mesh,
    rules,
  )
  if mesh is None:
    return jax.jit(fn, donate_argnums=0)
  state_sh = shardings_of(state)
  batch_sh = sharding_lib.batch_sharding(mesh)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.jit(
    fn, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, replicated), donate_argnums=0
  )


def compile_score_step(
  graphdef: nnx.GraphDef,
  params: nnx.State,
  *,
  mesh: Mesh | None = None,
  rules: Mapping = sharding_lib.DEFAULT_RULES,
) -> Callable[[nnx.State, Batch, float], jax.Array]:
  """Jitted scorer (params, batch, temperature) -> logprobs [B, T]; temperature is static."""
  fn = _with_activation_sharding(functools.partial(score_batch, graphdef), mesh, rules)
  if mesh is None:
    return jax.jit(fn, static_argnums=2)
  batch_sh = sharding_lib.batch_sharding(mesh)
  return jax.jit(
    fn, in_shardings=(shardings_of(params), batch_sh), out_shardings=batch_sh, static_argnums=2
  )
