"""Named model sizes: the published Qwen architectures and tiny CPU sizes.

gin files under `gin/models/` select one by name (`presets.model_config.name = "qwen2.5-7b"`), so
the numbers live in one place. The published shapes are copied from the models' config.json files.
"""

from __future__ import annotations

from typing import Any

from asearcher_jax.model.config import ModelConfig

_QWEN_VOCAB = 151936  # Qwen2/2.5 small and Qwen3 embedding rows (tokenizer has 151,646 + padding)
_QWEN_VOCAB_LARGE = 152064  # Qwen2.5 7B and up, QwQ

PRESETS: dict[str, dict[str, Any]] = {
  "qwen2.5-0.5b": dict(
    vocab_size=_QWEN_VOCAB,
    hidden_size=896,
    intermediate_size=4864,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    tie_word_embeddings=True,
  ),
  "qwen2.5-1.5b": dict(
    vocab_size=_QWEN_VOCAB,
    hidden_size=1536,
    intermediate_size=8960,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    tie_word_embeddings=True,
  ),
  "qwen2.5-7b": dict(
    vocab_size=_QWEN_VOCAB_LARGE,
    hidden_size=3584,
    intermediate_size=18944,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    max_position_embeddings=131072,
  ),
  "qwen2.5-14b": dict(
    vocab_size=_QWEN_VOCAB_LARGE,
    hidden_size=5120,
    intermediate_size=13824,
    num_layers=48,
    num_heads=40,
    num_kv_heads=8,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
  ),
  "qwen2.5-32b": dict(
    vocab_size=_QWEN_VOCAB_LARGE,
    hidden_size=5120,
    intermediate_size=27648,
    num_layers=64,
    num_heads=40,
    num_kv_heads=8,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
  ),
  "qwq-32b": dict(
    vocab_size=_QWEN_VOCAB_LARGE,
    hidden_size=5120,
    intermediate_size=27648,
    num_layers=64,
    num_heads=40,
    num_kv_heads=8,
    rms_norm_eps=1e-5,
    max_position_embeddings=40960,
  ),
  "qwen3-0.6b": dict(
    model_type="qwen3",
    vocab_size=_QWEN_VOCAB,
    hidden_size=1024,
    intermediate_size=3072,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    qkv_bias=False,
    qk_norm=True,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
  ),
  "qwen3-8b": dict(
    model_type="qwen3",
    vocab_size=_QWEN_VOCAB,
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    qkv_bias=False,
    qk_norm=True,
    max_position_embeddings=40960,
  ),
  # Tiny CPU sizes. "qwen2-tiny" keeps the real Qwen vocabulary so it runs with the real tokenizer.
  "qwen2-tiny": dict(
    vocab_size=_QWEN_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
  ),
  "qwen3-tiny": dict(
    model_type="qwen3",
    vocab_size=_QWEN_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    qkv_bias=False,
    qk_norm=True,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
  ),
  # ~2.4M parameters for SFT/RL from scratch on a synthetic world; vocab_size is a placeholder that
  # `asearcher sft` replaces with the world tokenizer's size (rounded up).
  "synthwiki-2m": dict(
    vocab_size=4096,
    hidden_size=192,
    intermediate_size=512,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    tie_word_embeddings=True,
    rope_theta=10000.0,
    max_position_embeddings=2048,
  ),
  # ~28M parameters with an 8k vocabulary (a world-sized tokenizer): the CPU benchmark size.
  "bench-30m": dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
  ),
}


def model_config(*, name: str, **overrides: Any) -> ModelConfig:
  """Returns the named preset; `overrides` replace fields (e.g. param_dtype, remat)."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
  return ModelConfig(**{**PRESETS[name], **overrides})
