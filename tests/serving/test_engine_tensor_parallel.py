"""The engine on a tensor-parallel mesh (4 of 8 fake CPU devices) against the same engine on one
device: same greedy tokens, same logprobs, weights and KV cache really split, and weights handed to
it in any layout (host arrays, a learner's fsdp shards, a checkpoint) landing in its shardings."""

from __future__ import annotations

import asyncio
import math
import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from asearcher_jax.errors import AsearcherError
from asearcher_jax.model import hf_io, transformer
from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model.loading import load_policy
from asearcher_jax.serving import engine_steps
from asearcher_jax.serving.driver import Driver
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.serving.engine_steps import result_logprobs
from asearcher_jax.serving.mesh import ServingMeshConfig, engine_layout
from asearcher_jax.serving.types import SamplingParams
from tests.model.test_model import small_cfg

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")

PROMPTS = ([3, 17, 99, 4, 8], [120, 5], [7] * 11, [64, 1, 2, 3, 77, 90, 12, 33, 41])


def _cfg(num_kv_heads: int):
  # vocab and MLP width divide by 4, untied output head: every split of the layout is exercised.
  return small_cfg("qwen3", vocab_size=128, num_kv_heads=num_kv_heads, tie_word_embeddings=False)


def _engine(model, tokenizer, tensor: int) -> Engine:
  cfg = EngineConfig(max_slots=4, max_seq_len=64, prefill_buckets=(16, 32), decode_rows=(2,),
                     mesh=ServingMeshConfig(tensor=tensor))  # fmt: skip
  return Engine.from_model(model, tokenizer, cfg)


def _greedy_run(eng: Engine, steps: int = 12) -> tuple[np.ndarray, np.ndarray, object]:
  """Prefills PROMPTS into slots 0-3, decodes `steps` full steps then `steps` steps over two live
  rows (the gathered-rows path); returns tokens [S, 2*steps], logprobs, the final state."""
  params, state = eng.load_params(), eng.init_decode_state()
  greedy = SamplingParams(temperature=0.0)
  for slot, prompt in enumerate(PROMPTS):
    padded, n = eng.pad(prompt)
    state = eng.insert(eng.prefill(params=params, padded_tokens=padded, true_length=n,
                                   sampling=greedy), state, slot)  # fmt: skip
  toks, lps = [], []
  for i in range(2 * steps):
    live = None if i < steps else [1, 3]
    state, result = eng.generate(params, state, max_length=48, mode="greedy", live=live)
    data = np.asarray(result.data)
    toks.append(np.where(data[:, 1] > 0, data[:, 0], -1))
    lps.append(np.where(data[:, 1] > 0, result_logprobs(result), 0.0))
  return np.stack(toks, 1), np.stack(lps, 1), state


@pytest.mark.slow
@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_tensor_parallel_engine_matches_one_device(tokenizer, num_kv_heads):
  """num_kv_heads=4: the cache splits by KV head; 2 (< tensor): k/v and the cache replicate."""
  model = transformer.Transformer(_cfg(num_kv_heads), rngs=nnx.Rngs(3))
  want_tok, want_lp, _ = _greedy_run(_engine(model, tokenizer, 1))
  eng = _engine(model, tokenizer, 4)
  assert eng.mesh.shape["tensor"] == 4 and eng.mesh.size == 4
  attn = eng.load_params().state["layers"][0]["self_attn"]
  assert attn["q_proj"]["kernel"].get_value().sharding.spec == PartitionSpec(None, "tensor")
  assert attn["o_proj"]["kernel"].get_value().sharding.spec == PartitionSpec("tensor", None)
  down = eng.load_params().state["layers"][1]["mlp"]["down_proj"]["kernel"].get_value()
  assert down.sharding.spec == PartitionSpec("tensor", None)
  assert down.addressable_shards[0].data.shape == (48 // 4, 32)  # each chip holds a quarter
  got_tok, got_lp, state = _greedy_run(eng)

  assert len(set(want_tok[0].tolist())) > 2, "a degenerate reference proves little"
  np.testing.assert_array_equal(got_tok, want_tok)
  np.testing.assert_allclose(got_lp, want_lp, atol=1e-4)
  k = state.cache.k[0]
  heads = (num_kv_heads // 4) if num_kv_heads == 4 else num_kv_heads
  assert k.addressable_shards[0].data.shape == (4, 64, heads, 16)  # still split after decoding
  kv_spec = attn["k_proj"]["kernel"].get_value().sharding.spec
  assert kv_spec == (
    PartitionSpec(None, "tensor") if num_kv_heads == 4 else PartitionSpec(None, None)
  )


_COLLECTIVE = re.compile(
  r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)\("
)


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_a_sharded_decode_step_moves_activations_never_weights(tokenizer, num_kv_heads):
  """The compiled decode step of the tensor = 4 engine: every collective carries less data than
  the smallest split weight (Megatron's all-reduces of [slots, hidden] activations, small
  sampling reductions), so no chip ever gathers another chip's weights or cache."""
  eng = _engine(transformer.Transformer(_cfg(num_kv_heads), rngs=nnx.Rngs(0)), tokenizer, 4)
  params, state = eng.load_params(), eng.init_decode_state()
  hlo = engine_steps.GENERATE.lower(eng._graphdef, 64, "greedy", params, state).compile().as_text()
  sizes = []
  for line in hlo.splitlines():
    op = _COLLECTIVE.search(line)
    if op:
      shapes = re.findall(r"[a-z]+\d*\[([\d,]*)\]", line[: op.start()])
      sizes += [math.prod(int(d) for d in s.split(",") if d) for s in shapes]
  assert any(_COLLECTIVE.search(line) and "all-reduce" in line for line in hlo.splitlines())
  split = [v.get_value().size for _, v in nnx.to_flat_state(params.state)
           if "tensor" in str(v.get_value().sharding.spec)]  # fmt: skip
  assert sizes and max(sizes) < min(split), (max(sizes), min(split))
  # A prefix moved to this engine (JetStream's disaggregated transfer) keeps the cache's split.
  padded, n = eng.pad(PROMPTS[0])
  moved = jax.device_put(eng.prefill(params=params, padded_tokens=padded, true_length=n),
                         eng.get_prefix_destination_sharding())  # fmt: skip
  assert moved.cache.k[0].sharding.is_equivalent_to(state.cache.k[0].sharding, 4)


@pytest.mark.slow
async def test_weight_update_in_any_layout_lands_in_the_engine_shardings(tokenizer):
  """A weights store hands host arrays, an in-process learner its fsdp-sharded params: both are
  placed into the engine's shardings, and the tokens follow the new weights."""
  cfg = _cfg(4)
  eng = _engine(transformer.Transformer(cfg, rngs=nnx.Rngs(0)), tokenizer, 4)
  new = nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(9)))[1]
  host = jax.tree.map(np.asarray, new)
  learner_mesh = sharding_lib.make_mesh(data=1, fsdp=8, tensor=1)
  fsdp = jax.device_put(new, sharding_lib.param_shardings(new, learner_mesh))
  want = nnx.to_flat_state(eng.param_shardings)
  for params in (host, fsdp):
    got = eng.versioned(params, 5)
    assert int(got.version) == 5
    for (path, var), (_, sh) in zip(nnx.to_flat_state(got.state), want, strict=True):
      assert var.get_value().sharding.is_equivalent_to(sh, var.get_value().ndim), path

  ref = _engine(transformer.Transformer(cfg, rngs=nnx.Rngs(9)), tokenizer, 1)
  want_tok, want_lp, _ = _greedy_run(ref, steps=4)
  driver = Driver(eng)
  try:
    await asyncio.to_thread(driver.update_params, host, 5, 120)
    greedy = SamplingParams(temperature=0.0)
    res = await driver.generate(list(PROMPTS[0]), greedy, 4, stop_token_ids=(), timeout=120)
  finally:
    await asyncio.to_thread(driver.close)
  assert res.versions == [5] * 4
  # The driver's first token comes from prefill; the engine run's columns are the decode steps.
  assert res.tokens[1:] == want_tok[0, :3].tolist()
  np.testing.assert_allclose(res.logprobs[1:], want_lp[0, :3], atol=1e-4)


def test_a_checkpoint_loads_straight_into_the_engine_shardings(tmp_path, tokenizer):
  """Each device reads only its slice of every tensor: device 0 never holds a whole split weight."""
  cfg = _cfg(4)
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(1))
  hf_io.save(model, tmp_path / "ckpt")
  mesh_cfg = ServingMeshConfig(tensor=4)
  layout = lambda c: engine_layout(c, mesh_cfg)  # noqa: E731
  loaded, _, _ = load_policy(str(tmp_path / "ckpt"), None, None, layout=layout)
  eng = Engine.from_model(loaded, tokenizer, EngineConfig(max_slots=2, max_seq_len=32,
                                                          mesh=mesh_cfg))  # fmt: skip
  want = dict(nnx.to_flat_state(eng.param_shardings))
  ref = dict(nnx.to_flat_state(nnx.split(model)[1]))
  split = 0
  for path, var in nnx.to_flat_state(nnx.split(loaded)[1]):
    value = var.get_value()
    assert value.sharding.is_equivalent_to(want[path], value.ndim), path
    np.testing.assert_array_equal(np.asarray(value), np.asarray(ref[path].get_value()))
    if "tensor" in jax.tree.leaves(tuple(want[path].spec)):
      split += 1
      assert value.addressable_shards[0].data.size * 4 == value.size, path
  assert split == cfg.num_layers * 7 + 2  # q, k, v, o, gate, up, down per layer; embed, lm_head


def test_random_policy_initialises_in_place_with_eager_values():
  cfg = _cfg(2)
  layout = lambda c: engine_layout(c, ServingMeshConfig(tensor=4))  # noqa: E731
  sharded, _, _ = load_policy(None, cfg, None, seed=2, layout=layout)
  eager = transformer.Transformer(cfg, rngs=nnx.Rngs(2))
  kernel = sharded.layers[0].mlp.gate_proj.kernel.get_value()
  assert kernel.sharding.spec == PartitionSpec(None, "tensor")
  for a, b in zip(jax.tree.leaves(nnx.split(sharded)[1]), jax.tree.leaves(nnx.split(eager)[1]),
                  strict=True):  # fmt: skip
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-7)


def test_a_mesh_larger_than_the_devices_is_a_one_line_error(tokenizer):
  model = transformer.Transformer(_cfg(2), rngs=nnx.Rngs(0))
  with pytest.raises(AsearcherError, match=r"ServingMeshConfig\.tensor=16 needs 16 devices, 8"):
    _engine(model, tokenizer, 16)
  with pytest.raises(AsearcherError, match=r"ServingMeshConfig\.tensor must be"):
    ServingMeshConfig(tensor=0)
  with pytest.raises(ValueError, match="an engine mesh has axes"):
    Engine.from_model(
      model,
      tokenizer,
      mesh=sharding_lib.make_mesh(data=1, fsdp=2, tensor=2, devices=jax.devices()[:4]),
    )
