"""The two call paths agree: packed == unpacked scores, prefill + decode == full forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asearcher_jax.model import presets, transformer
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.model.kv_cache import KVCache


def small_cfg(model_type: str = "qwen2", **kw) -> ModelConfig:
  base = dict(
    vocab_size=101, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
    num_kv_heads=2, rope_theta=10000.0,
  )  # fmt: skip
  if model_type == "qwen3":
    base.update(model_type="qwen3", head_dim=16, qkv_bias=False, qk_norm=True)
  base.update(kw)
  return ModelConfig(**base)


def _model(cfg, seed=0):
  return transformer.Transformer(cfg, rngs=nnx.Rngs(seed))


# Jitted: run eagerly, every new sequence length compiles each operation on its own (seconds on
# CPU); jitted, a length is one compile.
_score = nnx.jit(transformer.score, static_argnums=4)
_forward = nnx.jit(lambda model, tokens, *packing: model(tokens, *packing))
_extend = nnx.jit(lambda model, *args, fresh=False: model.extend(*args, fresh=fresh),
                  static_argnames="fresh")  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_packed_scores_equal_unpacked(model_type):
  cfg = small_cfg(model_type)
  model = _model(cfg)
  rng = np.random.default_rng(0)
  seqs = [rng.integers(0, cfg.vocab_size, n) for n in (7, 5, 9, 3)]
  # Unpacked: each sequence alone.
  alone = [
    np.asarray(
      _score(model, jnp.asarray(s[None]), jnp.arange(len(s))[None], jnp.ones((1, len(s)), jnp.int32), 1.0)
    )[0]
    for s in seqs
  ]  # fmt: skip
  # Packed: two rows of 16 tokens, two sequences each, with trailing padding (segment 0).
  rows, pos, seg = (
    np.zeros((2, 16), np.int32),
    np.zeros((2, 16), np.int32),
    np.zeros((2, 16), np.int32),
  )
  layout = [(0, 0, 1), (0, 7, 2), (1, 0, 1), (1, 9, 2)]
  for (r, off, sid), s in zip(layout, seqs, strict=True):
    rows[r, off : off + len(s)] = s
    pos[r, off : off + len(s)] = np.arange(len(s))
    seg[r, off : off + len(s)] = sid
  packed = np.asarray(_score(model, jnp.asarray(rows), jnp.asarray(pos), jnp.asarray(seg), 1.0))
  for (r, off, _), s, want in zip(layout, seqs, alone, strict=True):
    np.testing.assert_allclose(packed[r, off : off + len(s)], want, atol=1e-5)
  assert (
    packed[0, 0] == 0.0 and packed[0, 7] == 0.0
  )  # first token of a segment: nothing predicts it
  assert np.all(packed[0, 12:] == 0.0)  # padding scores 0
  assert np.all(want[1:] < 0)


def test_score_temperature_matches_logsoftmax():
  cfg = small_cfg()
  model = _model(cfg)
  tok = jnp.asarray(np.arange(10)[None] % cfg.vocab_size)
  lp = _score(model, tok, jnp.arange(10)[None], jnp.ones((1, 10), jnp.int32), 0.7)
  logits = _forward(model, tok)[0, :-1] / 0.7
  want = jax.nn.log_softmax(logits)[jnp.arange(9), tok[0, 1:]]
  np.testing.assert_allclose(np.asarray(lp[0, 1:]), np.asarray(want), atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_prefill_then_decode_equals_full_forward(model_type):
  cfg = small_cfg(model_type)
  model = _model(cfg, seed=3)
  rng = np.random.default_rng(1)
  lens = np.array([5, 3])
  total = 9
  full = rng.integers(0, cfg.vocab_size, (2, total))
  want = np.stack([np.asarray(_forward(model, jnp.asarray(full[b : b + 1])))[0] for b in range(2)])
  cache = KVCache.init(cfg, batch=2, max_len=16)
  # Prefill a padded bucket of 6 tokens; row 1 only has 3 real tokens (rest is padding).
  prompt = np.zeros((2, 6), np.int64)
  for b in range(2):
    prompt[b, : lens[b]] = full[b, : lens[b]]
  logits, cache = _extend(model, jnp.asarray(prompt), jnp.zeros(2, jnp.int32), cache)
  for b in range(2):
    np.testing.assert_allclose(np.asarray(logits[b, : lens[b]]), want[b, : lens[b]], atol=1e-4)
  # Decode one token per row per step, each row at its own position (continuous batching).
  pos = lens.copy()
  step = jax.jit(lambda m, t, s, c: m.extend(t, s, c))
  while pos.max() < total:
    nxt = np.array([full[b, min(pos[b], total - 1)] for b in range(2)])[:, None]
    logits, cache = step(model, jnp.asarray(nxt), jnp.asarray(pos, jnp.int32), cache)
    for b in range(2):
      if pos[b] < total:
        np.testing.assert_allclose(np.asarray(logits[b, 0]), want[b, pos[b]], atol=1e-4)
    pos = np.minimum(pos + 1, total)


def test_presets_build_and_count_params():
  cfg = presets.model_config(name="qwen2.5-0.5b")
  assert 0.45e9 < cfg.num_params() < 0.55e9
  assert 7.0e9 < presets.model_config(name="qwen2.5-7b").num_params() < 8.0e9
  assert 31e9 < presets.model_config(name="qwq-32b").num_params() < 34e9
  assert 0.55e9 < presets.model_config(name="qwen3-0.6b").num_params() < 0.8e9
  tiny = presets.model_config(name="qwen2-tiny")
  model = _model(tiny)
  n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert n == tiny.num_params()
  with pytest.raises(ValueError, match="unknown model preset"):
    presets.model_config(name="gpt-5")


@pytest.mark.slow
def test_remat_gives_same_gradients():
  cfg = small_cfg()
  tok = jnp.asarray(np.arange(12)[None] % cfg.vocab_size)

  def loss(model):
    return -transformer.score(model, tok, jnp.arange(12)[None], jnp.ones((1, 12), jnp.int32)).sum()

  g1 = nnx.jit(nnx.grad(loss))(_model(cfg))
  g2 = nnx.jit(nnx.grad(loss))(_model(small_cfg(remat_policy="full")))
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.slow
def test_blocked_causal_attention_equals_full_matrix():
  rng = np.random.default_rng(5)
  tok = jnp.asarray(rng.integers(0, 101, (2, 16)))
  seg = jnp.asarray(np.r_[np.ones(6), 2 * np.ones(10)][None].repeat(2, 0), jnp.int32)
  pos = jnp.asarray(np.r_[np.arange(6), np.arange(10)][None].repeat(2, 0), jnp.int32)
  full = _forward(_model(small_cfg(attention="dense", attention_block=0), seed=4), tok, pos, seg)
  for block in (4, 8):  # 4 and 2 query blocks
    dense = small_cfg(attention="dense", attention_block=block)
    blocked = _forward(_model(dense, seed=4), tok, pos, seg)
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(full), atol=1e-5)


@pytest.mark.slow
def test_extend_in_query_blocks_equals_full_forward():
  """Prefill (fresh) and suffix prefills longer than attention_block run in query blocks; both
  must give the full forward's logits and the same cache."""
  rng = np.random.default_rng(6)
  tok = rng.integers(0, 101, (2, 16))
  want = np.asarray(_forward(_model(small_cfg(attention_block=0), seed=7), jnp.asarray(tok)))
  model = _model(small_cfg(attention_block=4), seed=7)
  cfg = model.cfg
  fresh, _ = _extend(
    model, jnp.asarray(tok[:, :12]), jnp.zeros(2, jnp.int32), KVCache.init(cfg, 2, 12), fresh=True
  )
  np.testing.assert_allclose(np.asarray(fresh), want[:, :12], atol=1e-4)
  # Rows at different offsets: prefix of 3 / 5 tokens, then a 10-token suffix (3 query blocks).
  cache = KVCache.init(cfg, batch=2, max_len=16)
  prefix = np.zeros((2, 5), np.int64)
  prefix[0, :3], prefix[1] = tok[0, :3], tok[1, :5]
  _, cache = _extend(model, jnp.asarray(prefix), jnp.zeros(2, jnp.int32), cache)
  suffix = np.stack([tok[0, 3:13], tok[1, 5:15]])
  got, _ = _extend(model, jnp.asarray(suffix), jnp.asarray([3, 5], jnp.int32), cache)
  np.testing.assert_allclose(np.asarray(got[0]), want[0, 3:13], atol=1e-4)
  np.testing.assert_allclose(np.asarray(got[1]), want[1, 5:15], atol=1e-4)
