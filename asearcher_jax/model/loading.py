"""The policy and its tokenizer, as every program that owns one starts from them.

A Hugging Face checkpoint (weights straight into their shardings via `hf_io`), or a random model of a
given config that is written nowhere (smoke runs, tests). The tokenizer follows the checkpoint when it
ships one, else the packaged Qwen2 vocabulary.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from flax import nnx
from jax.sharding import Mesh

from asearcher_jax.model import hf_io, presets, transformer
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyConfig:
  """Which policy a program loads (the arguments of `load_policy`, bindable from gin)."""

  # A Hugging Face Qwen2/Qwen3 checkpoint directory; None: a random `model` policy.
  model_dir: str | None = None
  # Architecture of the random policy; None: the qwen2-tiny preset.
  model: ModelConfig | None = None
  # Tokenizer files; None: model_dir's when it has them, else the packaged Qwen2 vocabulary.
  tokenizer_dir: str | None = None
  # Init seed of the random policy.
  seed: int = 0


def load_policy(
  model_dir: str | None,
  model: ModelConfig | None,
  tokenizer_dir: str | None,
  seed: int = 0,
  *,
  mesh: Mesh | None = None,
) -> tuple[transformer.Transformer, Tokenizer, str]:
  """(model, tokenizer, description): a HF checkpoint, or a random model of `model` (default
  qwen2-tiny) that is written nowhere. The tokenizer comes from `tokenizer_dir`, else from
  `model_dir` when it holds tokenizer files, else the packaged Qwen2 vocabulary. With `mesh`, a
  checkpoint's tensors are read straight into their shardings on it (each process reads only
  its own slices); a random model starts on this process's first device either way."""
  if model_dir is not None:
    policy, cfg = hf_io.load(model_dir, mesh=mesh)
    what = f"{model_dir} ({cfg.model_type}, {cfg.num_layers} layers)"
  else:
    cfg = model or presets.model_config(name="qwen2-tiny")
    policy = transformer.Transformer(cfg, rngs=nnx.Rngs(seed))
    what = f"a random {cfg.model_type} policy ({cfg.num_params() / 1e6:.1f}M params)"
  tok_dir = tokenizer_dir
  if tok_dir is None and model_dir is not None:
    has = any((Path(model_dir) / f).is_file() for f in ("tokenizer.json", "vocab.json"))
    tok_dir = model_dir if has else None
  tokenizer = Tokenizer.from_dir(tok_dir) if tok_dir else Tokenizer.qwen2()
  return policy, tokenizer, what
