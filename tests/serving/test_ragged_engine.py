"""The engine's paged cache read by the ragged paged attention program (EngineConfig.paged_attention):
on CPU its pure-JAX stand-in runs the exact inputs the TPU kernel gets, and must give the fixed-slot
engine's tokens, logprobs and versions; on 4 fake devices a model with 2 KV heads keeps each head
twice in the pools, one head per device; and the engine's own decode step compiles for a v5p slice
with the kernel in it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asearcher_jax import tpu_env
from asearcher_jax.model import transformer
from asearcher_jax.model.kv_cache import PagedKVCache
from asearcher_jax.serving import engine_steps as steps
from asearcher_jax.serving.engine import EngineConfig
from asearcher_jax.serving.mesh import ServingMeshConfig
from asearcher_jax.serving.types import SamplingParams
from tests.model.test_model import small_cfg
from tests.serving.conftest import tiny_model
from tests.serving.test_paged_driver import assert_no_leak, assert_same, run

PROMPTS = [list(range(5, 5 + n)) for n in (3, 9, 14, 6)]  # 1 to 4 pages of 4
LENGTHS = [10, 7, 12, 9]


def test_a_paged_attention_mistake_is_one_line():
  with pytest.raises(ValueError, match="paged_attention must be auto, gather, ragged or"):
    EngineConfig(kv_layout="paged", paged_attention="splash")
  with pytest.raises(ValueError, match="paged attention must be one of"):
    PagedKVCache.init(small_cfg(), slots=1, num_pages=3, page_size=4, pages_per_seq=2,
                      attention="dense")  # fmt: skip


@pytest.mark.slow  # ~13 s; the fast tier keeps the model-level check (tests/model/test_paged_kv.py)
@pytest.mark.parametrize("decode_steps", [1, 4])
async def test_ragged_program_gives_the_fixed_engines_tokens(make_driver, decode_steps):
  model = tiny_model(seed=5)
  samplings = [SamplingParams(temperature=t, seed=i) for i, t in enumerate((0.0, 0.9, 0.0, 1.0))]
  fixed = make_driver(model, layout="fixed", decode_steps=decode_steps)
  ragged = make_driver(model, layout="paged", decode_steps=decode_steps,
                       paged_attention="ragged_reference")  # fmt: skip
  assert ragged.engine.paged_attention == "ragged_reference"
  assert make_driver(model, layout="paged").engine.paged_attention == "gather"  # auto, on CPU
  want = await run(fixed, PROMPTS, samplings, LENGTHS)
  got = await run(ragged, PROMPTS, samplings, LENGTHS)
  assert_same(got, want)
  assert len(set(want[0].tokens)) > 2, "a degenerate reference proves little"
  # A second turn continues an episode over its earlier pages (a suffix prefill, ragged too).
  turn = [PROMPTS[1] + got[1].tokens + [11, 12]]
  assert_same(
    await run(ragged, turn, samplings[1:2], [6]), await run(fixed, turn, samplings[1:2], [6])
  )
  assert_no_leak(ragged)


@pytest.mark.slow
@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices")
@pytest.mark.parametrize("attention", ["gather", "ragged_reference"])
async def test_kv_heads_repeat_to_the_chips_one_head_per_device(make_driver, attention):
  """2 KV heads on 4 devices: the pools hold each head twice (4 heads, k and v interleaved: 8),
  split so each device keeps 2 of them -- one head's keys and values -- and decode exactly what
  one device decodes."""
  cfg = small_cfg("qwen3", vocab_size=128, num_heads=4, num_kv_heads=2, tie_word_embeddings=False)
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(2))
  greedy = [SamplingParams(temperature=0.0)] * len(PROMPTS)
  one = make_driver(model, layout="fixed")
  tp = make_driver(model, layout="paged", paged_attention=attention,
                   mesh=ServingMeshConfig(tensor=4))  # fmt: skip
  want = await run(one, PROMPTS, greedy, LENGTHS)
  got = await run(tp, PROMPTS, greedy, LENGTHS)
  assert_same(got, want)
  pool = tp._table.state.cache.kv[0]
  assert pool.shape[2] == 8
  shards = pool.addressable_shards
  assert len(shards) == 4 and {s.data.shape[2] for s in shards} == {2}
  # Device d holds model head d // 2: its keys equal the other copy of the same head.
  k = np.asarray(pool)[:, :, 0::2]
  np.testing.assert_array_equal(k[:, :, 0], k[:, :, 1])
  np.testing.assert_array_equal(k[:, :, 2], k[:, :, 3])


needs_libtpu = pytest.mark.skipif(not tpu_env.libtpu_installed(), reason="libtpu not installed")


@pytest.mark.slow
@needs_libtpu
def test_the_engines_decode_step_compiles_for_v5p_with_the_ragged_kernel():
  """The engine's own multi-slot decode step (engine_steps.GENERATE, what the driver dispatches)
  over a paged cache with attention "ragged", lowered for the 4 chips of a v5p-8 by libtpu on
  this host: the Pallas kernel is in the program, the pools stay split by heads (no chip holds
  another's), and it compiles."""
  from asearcher_jax.rl import aot

  cfg = small_cfg("qwen3", vocab_size=512, num_heads=8, num_kv_heads=2, head_dim=128,
                  hidden_size=256, intermediate_size=512, dtype="bfloat16",
                  param_dtype="bfloat16", tie_word_embeddings=False)  # fmt: skip
  ecfg = EngineConfig(max_slots=8, max_seq_len=256, page_size=16, num_pages=65,
                      kv_layout="paged", paged_attention="ragged")  # fmt: skip
  report = aot.compile_engine_decode(cfg, ecfg, slice_name="v5p-8", window=128)
  assert report["kernel_in_program"]
  assert report["kv_repeat"] == 2 and report["kv_heads_per_chip"] == 1  # 4 copies over 4 chips
  assert report["fits"] and report["total_gib"] > 0
  # The gather reference compiles for the same slice without the kernel.
  gather = aot.compile_engine_decode(
    cfg, EngineConfig(**{**ecfg.__dict__, "paged_attention": "gather"}), slice_name="v5p-8",
    window=128,
  )  # fmt: skip
  assert not gather["kernel_in_program"] and gather["fits"]


def _engine(layout: str, attention: str = "auto", *, slots: int = 2, **kw):
  from asearcher_jax.serving.engine import Engine
  from asearcher_jax.tokenizer import Tokenizer

  kw = {"max_seq_len": 64, "prefill_buckets": (16, 32), "suffix_buckets": (8,), "decode_rows": (),
        "page_size": 4, **kw}  # fmt: skip
  cfg = EngineConfig(max_slots=slots, kv_layout=layout, paged_attention=attention, **kw)
  return Engine.from_model(tiny_model(seed=7), Tokenizer.qwen2(), cfg)


def _map_pages(eng, state, slots, pages: int | None = None):
  """Slot s (the i-th of `slots`) owns pages 1 + i * pages_per_seq onwards: `pages` of them (a
  whole context by default), the rest of its table the null page."""
  if not eng.paged:
    return state
  n = eng.cfg.pages_per_seq
  table = np.zeros((eng.cfg.max_slots, n), np.int32)
  for i, slot in enumerate(slots):
    table[slot, : pages or n] = np.arange(1 + i * n, 1 + i * n + (pages or n))
  return eng.set_page_table(state, table)


@pytest.mark.parametrize("step", ["every_slot", "rows"])
def test_idle_slots_attend_nothing_on_the_ragged_path(monkeypatch, step):
  """A decode step with one live slot (slot 2) among idle ones: the ragged program hands the
  kernel the live slot as its only sequence (num_seqs 1, its length, its pages) and every idle
  slot after it with length 0 and no pages, so an idle slot costs the kernel nothing. (It once
  handed each idle slot the whole context, then one position of it.)"""
  from asearcher_jax.model import ragged_paged

  eng = _engine("paged", "ragged_reference", slots=4)
  params = eng.load_params()
  state = _map_pages(eng, eng.init_decode_state(), [2, 0, 1, 3])  # idle slots map pages too
  greedy = SamplingParams(temperature=0.0)
  prefix = eng.prefill_many(params=params, prompts=[[5, 6, 7, 8, 9]], samplings=[greedy],
                            seeds=[0])  # fmt: skip
  state = eng.insert_many(prefix, state, [2])
  seen = []
  attention = ragged_paged.attention

  def record(q, pool, lengths, table, cu, num, **kwargs):  # what the kernel gets, at run time
    jax.debug.callback(lambda *a: seen.append([np.asarray(x) for x in a]), lengths, table, num)
    return attention(q, pool, lengths, table, cu, num, **kwargs)

  monkeypatch.setattr(ragged_paged, "attention", record)
  if step == "every_slot":
    jax.jit(functools.partial(steps._generate, eng._graphdef, 64, "greedy"))(params, state)
  else:  # a step over two rows: slot 2 live, slot 0 padding the step
    rows, live = jnp.asarray([0, 2]), jnp.asarray([False, True])
    fn = functools.partial(steps._generate_rows, eng._graphdef, 64, "greedy")
    jax.jit(fn)(params, state, rows, live)  # a new function: traced anew, through `record`
  jax.effects_barrier()
  assert len(seen) == eng.model_cfg.num_layers
  n_rows = 4 if step == "every_slot" else 2
  for lengths, table, num in seen:
    assert list(num) == [1]
    assert list(lengths) == [6] + [0] * (n_rows - 1)  # 5 cached + the fed token; idle: nothing
    np.testing.assert_array_equal(table[0, :16], np.arange(1, 17))  # slot 2's own pages
    assert not table[1:].any()  # idle rows map the null page only


@pytest.mark.parametrize("attention", ["gather", "ragged_reference"])
def test_a_suffix_padded_past_the_context_limit_continues_as_the_fixed_engine(attention):
  """A continuation turn whose cached context nearly fills the window: 60 tokens cached, a
  3-token suffix padded to a bucket of 8 at start 60, so the padded bucket runs 4 positions past
  max_seq_len (64). Its first token and logprob, and the tokens decoded after it (which read the
  suffix's keys from its pages), must be the fixed engine's, whose plan moves the start back."""
  greedy = SamplingParams(temperature=0.0)
  prompt = list(np.random.default_rng(0).integers(1, 100, 60))
  suffix = [7, 9, 11]
  got = {}
  for name, eng in (("fixed", _engine("fixed")), (attention, _engine("paged", attention))):
    params = eng.load_params()
    state = _map_pages(eng, eng.init_decode_state(), [1])
    prefix = eng.prefill_many(params=params, prompts=[prompt], samplings=[greedy], seeds=[0])
    state = eng.insert_many(prefix, state, [1])
    state = eng.release(state, 1)  # parked: the turn's tools ran
    start, bucket, window = eng.extend_plan(60, 63)  # fixed: start moves back to 56
    if eng.paged:
      assert (start, bucket) == (60, 8)  # the padded bucket ends at 68 > 64
    full = prompt + suffix
    state, tok, lp, _, _ = eng.extend_slot(params, state, 1, full[start:], start, sampling=greedy,
                                           bucket=bucket, window=window)  # fmt: skip
    tokens, logprobs = [int(tok)], [float(lp)]
    state, result = eng.generate(params, state, max_length=64, mode="greedy")
    tokens.append(int(result.data[1, 0]))
    logprobs.append(float(steps.result_logprobs(result)[1]))
    got[name] = tokens, logprobs
  assert got[attention][0] == got["fixed"][0]
  np.testing.assert_allclose(got[attention][1], got["fixed"][1], atol=1e-5)


@pytest.mark.slow  # > 10 s: the fast tier stays under 5 minutes
@pytest.mark.parametrize("attention", ["gather", "ragged_reference"])
def test_live_slots_decode_as_the_fixed_engine_whatever_idle_slots_pages_hold(attention):
  """Slots 1 and 3 decode, slot 0 is parked and slot 2 is free, its table still mapping pages
  that now hold anything (here NaN: freed pages, or pages another sequence owns). Over a step of
  every slot, a step of a few rows and a multi-step call, the live slots' tokens, logprobs and
  versions are the fixed engine's: an idle slot reads no page, so nothing it could read reaches
  a live slot (it once read its first page, and its NaN reached every slot through the null page
  its writes go to)."""
  samplings = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=3)]
  prompts = [list(range(5, 14)), list(range(20, 32))]  # one bucket (16)
  got = {}
  kw = {"slots": 4, "decode_rows": (2,), "decode_steps_per_call": 3}
  for name, eng in (
    ("fixed", _engine("fixed", **kw)),
    (attention, _engine("paged", attention, **kw)),
  ):
    params = eng.load_params()
    state = _map_pages(eng, eng.init_decode_state(), [0, 1, 2, 3], pages=10)  # 40 positions
    prefix = eng.prefill_many(params=params, prompts=[[40, 41, 42], *prompts],
                              samplings=[samplings[0], *samplings], seeds=[0, 1, 2])  # fmt: skip
    state = eng.release(eng.insert_many(prefix, state, [0, 1, 3]), 0)
    if eng.paged:  # slot 2 is free; the pages its table maps hold NaN
      free = eng.cfg.pages_per_seq * 2 + 1 + np.arange(10)
      kv = tuple(p.at[free].set(jnp.nan) for p in state.cache.kv)
      state = state.replace(cache=state.cache.replace(kv=kv))
    out = []
    state, result = eng.generate(params, state, max_length=32, mode="truncate")  # every slot
    out.append(np.asarray(result.data)[[1, 3]])
    state, result = eng.generate(params, state, max_length=32, mode="truncate", live=[1, 3])
    out.append(np.asarray(result.data)[[1, 3]])
    state, chunk, rows = eng.generate_chunk(params, state, [1, 3], [3, 3], [(), ()],
                                            max_length=40, mode="truncate")  # fmt: skip
    out.extend(np.asarray(chunk)[:, np.searchsorted(rows, [1, 3])])
    got[name] = out
  for g, w in zip(got[attention], got["fixed"], strict=True):
    cols = [steps.TOKEN, steps.VALID, steps.LENGTH, steps.VERSION]
    np.testing.assert_array_equal(g[:, cols], w[:, cols])
    lp = g[:, steps.LOGPROB].astype(np.int32).view(np.float32)
    want = w[:, steps.LOGPROB].astype(np.int32).view(np.float32)
    np.testing.assert_allclose(lp, want, atol=1e-5)
