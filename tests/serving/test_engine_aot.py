"""The engine compiled ahead of time (serving/engine_aot.py): its warm-up compiles exactly the
programs the real engine's warm-up compiles, on the same mesh, with the same outputs' layout."""

from __future__ import annotations

import collections
import dataclasses

import jax
import pytest
from flax import nnx

from asearcher_jax.model import presets, transformer
from asearcher_jax.serving import engine as engine_lib
from asearcher_jax.serving import engine_steps
from asearcher_jax.serving.engine_aot import AbstractArray, AotEngine
from asearcher_jax.serving.mesh import ServingMeshConfig
from asearcher_jax.tokenizer import Tokenizer

STEPS = [
  getattr(engine_steps, n) for n in dir(engine_steps)
  if n.isupper() and hasattr(getattr(engine_steps, n), "_cache_size")
]  # fmt: skip


def _compile(lowered, args):
  return lowered.compile(), {"fits": True, "total_gib": 0.0}


def _cfg(kv_layout: str) -> engine_lib.EngineConfig:
  return engine_lib.EngineConfig(
    max_slots=4, max_seq_len=128, prefill_buckets=(32, 64), suffix_buckets=(16,),
    decode_rows=(2,), kv_layout=kv_layout, page_size=16, mesh=ServingMeshConfig(tensor=2),
  )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("kv_layout", ["paged", "fixed"])
def test_aot_warmup_compiles_exactly_the_programs_the_real_warmup_compiles(kv_layout):
  """Counted per step: the programs a real warm-up adds to each jitted step's cache equal the
  programs the AOT engine compiled for it (on 2 of the 8 fake devices, tensor parallel)."""
  model = presets.model_config(name="qwen2-tiny")
  cfg = _cfg(kv_layout)
  jax.clear_caches()
  before = {s: s._cache_size() for s in STEPS}
  eng = engine_lib.Engine.from_model(
    transformer.Transformer(model, rngs=nnx.Rngs(0)), Tokenizer.qwen2(), cfg
  )
  eng.warmup(modes=("sample",), jetstream=False)
  warmed = collections.Counter()
  for s in STEPS:
    if s._cache_size() > before[s]:
      warmed[s.__name__.lstrip("_").upper()] = s._cache_size() - before[s]
  aot = AotEngine(model, Tokenizer.qwen2(), cfg, devices=jax.devices()[:2], compiler=_compile)
  aot.warmup(modes=("sample",), jetstream=False)
  compiled = collections.Counter(p.step for p in aot.programs)
  assert compiled == warmed and sum(compiled.values()) > 10
  assert aot.programs_dispatched == len(aot.programs)
  # The decode state keeps the real engine's placement through every compiled step.
  state = aot.init_decode_state()
  real = eng.init_decode_state()
  pool = (lambda c: c.kv[0]) if kv_layout == "paged" else (lambda c: c.k[0])
  assert pool(state.cache).sharding.spec == pool(real.cache).sharding.spec
  assert isinstance(pool(state.cache), AbstractArray)


def test_jetstream_programs_are_warmed_only_for_the_grpc_server():
  """Without gRPC no request ever reaches JetStream's prefill/insert: a warm-up without it
  compiles neither, and one with it compiles one of each per bucket."""
  model = presets.model_config(name="qwen2-tiny")
  cfg = dataclasses.replace(_cfg("fixed"), prefill_buckets=(), suffix_buckets=(), decode_rows=())

  def steps_of(jetstream: bool) -> collections.Counter:
    aot = AotEngine(model, Tokenizer.qwen2(), cfg, devices=jax.devices()[:2], compiler=_compile)
    aot.warmup(modes=("greedy",), chunks=(1,), extend=False, jetstream=jetstream)
    return collections.Counter(p.step for p in aot.programs)

  without, with_grpc = steps_of(False), steps_of(True)
  assert "PREFILL" not in without and "INSERT" not in without
  assert with_grpc["PREFILL"] == with_grpc["INSERT"] == len(cfg.buckets)


def test_a_refused_program_is_reported_and_the_warmup_goes_on():
  """A program the compiler refuses is one report with its error, not an exception: the rest of
  the warm-up is still compiled and counted."""
  model = presets.model_config(name="qwen2-tiny")
  cfg = dataclasses.replace(_cfg("fixed"), prefill_buckets=(), suffix_buckets=(), decode_rows=())

  calls = []

  def refuse_every_other(lowered, args):
    calls.append(1)
    if len(calls) % 2 == 0:
      raise RuntimeError("RESOURCE_EXHAUSTED: pretend\nmore")
    return lowered.compile(), {"fits": True}

  aot = AotEngine(
    model, Tokenizer.qwen2(), cfg, devices=jax.devices()[:2], compiler=refuse_every_other
  )
  aot.warmup(modes=("greedy",), chunks=(1,), extend=False, jetstream=False)
  failed = [p for p in aot.programs if "error" in p.report]
  assert failed and all(p.report["fits"] is False for p in failed)
  assert all(p.report["error"] == "RuntimeError: RESOURCE_EXHAUSTED: pretend" for p in failed)
  assert len(aot.programs) == aot.programs_dispatched > len(failed)


@pytest.mark.slow  # > 10 s: the fast tier stays under 5 minutes
def test_ragged_paged_attention_compiles_one_window_where_gather_compiles_each_bucket():
  """Ragged attention reads each sequence over its own length, so a window changes nothing in
  its program: decode and suffix steps compile once, not once per prefill bucket."""
  model = presets.model_config(name="qwen2-tiny")

  def counts(attention: str) -> collections.Counter:
    cfg = dataclasses.replace(_cfg("paged"), paged_attention=attention)
    aot = AotEngine(model, Tokenizer.qwen2(), cfg, devices=jax.devices()[:2], compiler=_compile)
    aot.warmup(modes=("sample",), chunks=(1,), jetstream=False)
    return collections.Counter(p.step for p in aot.programs)

  cfg = _cfg("paged")
  gather, ragged = counts("gather"), counts("ragged_reference")
  decode = ("GENERATE", "GENERATE_ROWS")
  assert sum(ragged[s] for s in decode) == len(cfg.row_buckets)
  assert sum(gather[s] for s in decode) == len(cfg.row_buckets) * len(cfg.buckets)
  assert ragged["EXTEND_PAGED"] == len(cfg.extend_buckets) < gather["EXTEND_PAGED"]
  assert ragged["PREFILL_MANY"] == gather["PREFILL_MANY"] == len(cfg.buckets)
