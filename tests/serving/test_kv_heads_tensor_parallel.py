"""KV heads duplicated to the tensor-parallel degree (serving/mesh.py, ragged_paged.kv_repeat): on
8 fake CPU devices a model with 2 KV heads keeps a paged cache of 8 (each head 4 times), split so
every device holds one head's keys and values, and decodes the same greedy tokens as on one."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from asearcher_jax.model import ragged_paged, transformer
from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.serving import mesh as mesh_lib
from tests.model.test_model import small_cfg
from tests.model.test_ragged_paged import PROMPTS, paged_run

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")


def test_cache_heads_follow_the_chips():
  cfg = small_cfg("qwen3", num_heads=8, num_kv_heads=2)
  assert ragged_paged.kv_repeat(cfg, 8) == 4 and mesh_lib.cache_kv_heads(cfg, 8) == 8
  assert ragged_paged.kv_repeat(cfg, 2) == 1 and mesh_lib.cache_kv_heads(cfg, 2) == 2
  assert mesh_lib.cache_kv_heads(cfg, 3) == 2  # 3 chips neither divide nor are divided by 2 heads
  assert mesh_lib.engine_rules(cfg, 8)[mesh_lib.CACHE_HEADS] == "tensor"
  assert mesh_lib.engine_rules(cfg, 8)["kv_heads"] is None  # the projections stay replicated
  # 8 query heads over 16 chips do not split: the cache then stays whole on each
  assert mesh_lib.engine_rules(cfg, 16)[mesh_lib.CACHE_HEADS] is None


@pytest.mark.slow  # ~7 s
def test_duplicated_kv_heads_split_over_tp_with_the_same_greedy_tokens():
  cfg = small_cfg("qwen3", num_heads=8, num_kv_heads=2, vocab_size=128)
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  want, one = paged_run(model, PROMPTS, steps=6)
  tp = 8
  mesh = mesh_lib.make_engine_mesh(mesh_lib.ServingMeshConfig(tensor=tp))
  rules = mesh_lib.engine_rules(cfg, tp)
  heads = 2 * mesh_lib.cache_kv_heads(cfg, tp)  # k and v interleaved
  shape = (one[0].shape[0], one[0].shape[1], heads, cfg.resolved_head_dim)
  spec = sharding_lib.logical_to_spec((None, None, mesh_lib.CACHE_HEADS, None), shape, mesh, rules)
  got, pools = paged_run(model, PROMPTS, steps=6, repeat=ragged_paged.kv_repeat(cfg, tp),
                         layout=(mesh, rules, NamedSharding(mesh, spec)))  # fmt: skip
  np.testing.assert_array_equal(got, want)
  shards = pools[0].addressable_shards
  assert len(shards) == tp and {s.data.shape[2] for s in shards} == {heads // tp}  # one head
  # each device's copy is the head its query heads read: device d holds model head d // 4
  k_of = np.asarray(pools[0])[:, :, 0::2]
  k_one = np.asarray(one[0])[:, :, 0::2]
  for d in range(tp):
    np.testing.assert_allclose(k_of[:, :, d], k_one[:, :, d // 4], atol=1e-6)
