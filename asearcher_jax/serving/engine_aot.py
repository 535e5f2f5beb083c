"""The engine compiled ahead of time: every program a serving replica warms up, for a slice that
is not there.

`AotEngine` is an `Engine` whose weights and decode state are abstract (shapes, dtypes and the
shardings the real engine would give them on the slice's mesh) and whose `_run` lowers and
compiles each step it is handed instead of running it, returning abstract outputs with the
compiled program's output shardings. `AotEngine.warmup` is therefore `Engine.warmup` itself:
the same loops, the same host-side padding and planning, the same static arguments; what it
compiles is exactly what a server compiles before it announces itself, no more and no fewer.
Each distinct program (step, static arguments, argument shapes and shardings) is compiled once
and reported (`ProgramReport`): per-chip memory, whether it fits, compile seconds.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asearcher_jax.model.config import ModelConfig
from asearcher_jax.model.transformer import Transformer
from asearcher_jax.serving import engine as engine_lib
from asearcher_jax.serving.engine_steps import DecodeState, VersionedParams
from asearcher_jax.serving.mesh import make_engine_mesh
from asearcher_jax.tokenizer import Tokenizer

# (lowered program, its abstract arguments) -> (compiled program or None when the compiler
# refused it for memory, the per-chip report: at least "total_gib", "fits" and "compile_s").
Compiler = Callable[[Any, Sequence[Any]], tuple[Any, dict[str, Any]]]


class AbstractArray(jax.ShapeDtypeStruct):
  """An abstract output that host code may index on its leading axis (`tok[0]`), as it does
  a real one; the result has no placement (nothing consumes it on a device)."""

  def __getitem__(self, index: int) -> AbstractArray:
    if not isinstance(index, int) or not self.shape:
      raise TypeError(f"an abstract array is indexed by one int on its leading axis, got {index!r}")
    return AbstractArray(self.shape[1:], self.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgramReport:
  """One compiled program of the engine."""

  # The step's name (engine_steps: PREFILL_MANY, EXTEND_PAGED, GENERATE, ...).
  step: str
  # Its static arguments (window, sampling mode, ...), as text.
  statics: str
  # The compiler's per-chip report (rl/aot.py `memory_report` + compile_s, or its refusal).
  report: dict[str, Any]


def _abstract(x: Any, default_sharding: jax.sharding.Sharding) -> Any:
  """A concrete argument as the abstract one a compile takes: host values (small scalars and
  tables the engine builds per call) replicated, as jit places uncommitted inputs."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return x
  if isinstance(x, jax.Array | np.ndarray):
    return AbstractArray(x.shape, x.dtype, sharding=default_sharding)
  return x


def _key(x: Any) -> Any:
  if isinstance(x, jax.ShapeDtypeStruct):
    spec = getattr(x.sharding, "spec", None)
    return ("array", x.shape, str(x.dtype), str(spec))
  try:
    hash(x)
  except TypeError:
    return ("object", id(x))
  return x


class AotEngine(engine_lib.Engine):
  """An engine of abstract weights on `devices` (a TPU slice's, `rl/aot.slice_devices`) that
  compiles what it is asked to run; `programs` lists each distinct program once."""

  def __init__(
    self,
    model_cfg: ModelConfig,
    tokenizer: Tokenizer,
    cfg: engine_lib.EngineConfig,
    *,
    devices: Sequence[Any],
    compiler: Compiler,
  ):
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0))))
    self._compiler = compiler
    self._compiled: dict[Any, Any] = {}
    self.programs: list[ProgramReport] = []
    mesh = make_engine_mesh(cfg.mesh, devices=devices)
    super().__init__(model_cfg, graphdef, params, tokenizer, cfg, mesh=mesh)

  @property
  def programs_dispatched(self) -> int:
    """Distinct programs the engine was asked to run (each compiled once, failed or not)."""
    return len(self._compiled)

  def versioned(self, params: nnx.State, version: int) -> VersionedParams:
    def place(sharding, var):  # shardings are a prefix of the params' tree (nnx Variables)
      return jax.tree.map(lambda a: AbstractArray(a.shape, a.dtype, sharding=sharding), var)

    state = jax.tree.map(place, self.param_shardings, params)
    return VersionedParams(
      state=state, version=AbstractArray((), jnp.int32, sharding=self._replicated)
    )

  def init_decode_state(self, *args, **kwargs) -> DecodeState:
    make, shardings = engine_lib.decode_state_program(self.model_cfg, self.cfg, self._mesh)
    return jax.tree.map(
      lambda a, s: AbstractArray(a.shape, a.dtype, sharding=s), jax.eval_shape(make), shardings
    )

  def _run(self, step: Callable, *args, **kwargs):
    args = jax.tree.map(lambda x: _abstract(x, self._replicated), args)
    leaves, treedef = jax.tree.flatten((args, kwargs))
    key = (step, treedef, tuple(_key(x) for x in leaves))
    if key not in self._compiled:
      self._compiled[key] = self._compile(step, args, kwargs)
    return self._compiled[key]

  def _compile(self, step: Any, args: tuple, kwargs: dict) -> Any:
    t0 = time.perf_counter()
    lowered = step.lower(*args, **kwargs)
    try:
      compiled, report = self._compiler(lowered, args)
    except Exception as e:  # reported, not raised: the rest of the warm-up is still compiled
      message = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
      compiled, report = None, {"error": f"{type(e).__name__}: {message}", "fits": False}
    report = {**report, "compile_s": round(time.perf_counter() - t0, 2)}
    statics = [a for a in args if isinstance(a, int | str)] + sorted(kwargs.items())
    name = getattr(step, "__name__", str(step)).lstrip("_").upper()
    self.programs.append(ProgramReport(step=name, statics=repr(statics), report=report))
    infos = jax.tree.leaves(lowered.out_info)
    if compiled is not None:
      shardings = jax.tree.leaves(compiled.output_shardings)
    else:  # refused: outputs placed like an input of their shape (a donated state), else replicated
      by_shape = {(x.shape, x.dtype): x.sharding for x in jax.tree.leaves(args)
                  if isinstance(x, jax.ShapeDtypeStruct)}  # fmt: skip
      shardings = [by_shape.get((i.shape, i.dtype), self._replicated) for i in infos]
    outs = [
      AbstractArray(i.shape, i.dtype, sharding=s) for i, s in zip(infos, shardings, strict=True)
    ]
    return jax.tree.unflatten(jax.tree.structure(lowered.out_info), outs)
