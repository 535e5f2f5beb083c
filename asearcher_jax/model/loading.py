"""The policy and its tokenizer, as every program that owns one starts from them.

A Hugging Face checkpoint (weights straight into their shardings via `hf_io`), or a random model of a
given config that is written nowhere (smoke runs, tests), initialised in place on its mesh when the
caller gives a layout. The tokenizer follows the checkpoint when it
ships one, else the packaged Qwen2 vocabulary.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
from flax import nnx
from jax.sharding import Mesh

from asearcher_jax import storage
from asearcher_jax.model import hf_io, presets, transformer
from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model.config import ModelConfig, from_hf_config
from asearcher_jax.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# How a model computes, not what it is: a checkpoint's config.json says nothing of these, so a
# program that loads one takes them from its configured `model` (the recipe's POLICY), the same
# values `asearcher compile` and the launch rehearsal compile with. (Dtypes stay config.json's:
# a default fp32 preset must not double a bf16 checkpoint.)
COMPUTE_FIELDS = (
  "remat_policy", "scan_layers", "logits_chunk", "attention_block", "attention", "flash_block",
  "attention_interpret",
)  # fmt: skip
# What config.json fixes: a configured `model` that disagrees on one of these describes another
# model (logged: a run's default preset beside a user's checkpoint is the common, harmless case).
ARCHITECTURE_FIELDS = (
  "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
  "num_kv_heads", "resolved_head_dim", "rope_theta", "rope_scaling_factor", "rms_norm_eps",
  "qkv_bias", "qk_norm", "tie_word_embeddings",
)  # fmt: skip


def compute_overrides(model: ModelConfig | None) -> dict[str, object]:
  """The compute knobs of a configured model, to apply over a checkpoint's config.json."""
  return {} if model is None else {f: getattr(model, f) for f in COMPUTE_FIELDS}


def resolve_config(model_dir: str | None, model: ModelConfig | None) -> ModelConfig:
  """The config a program computes with: `model` (default qwen2-tiny) without a checkpoint;
  with one, its config.json's architecture and dtypes and `model`'s compute knobs
  (COMPUTE_FIELDS). Where `model`'s architecture differs from config.json's, the first field
  that differs is logged (config.json's wins)."""
  if model_dir is None:
    return model or presets.model_config(name="qwen2-tiny")
  model_dir = storage.local_copy(model_dir, what="model_dir")
  cfg = from_hf_config(hf_io.read_config(model_dir), **compute_overrides(model))
  differs = [f for f in ARCHITECTURE_FIELDS if model and getattr(model, f) != getattr(cfg, f)]
  if differs:
    f = differs[0]
    log.info(
      "%s/config.json is not the configured model's architecture (%s %r vs %r): config.json's "
      "is used, with the configured remat, scan and attention", model_dir, f,
      getattr(cfg, f), getattr(model, f),
    )  # fmt: skip
  return cfg


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyConfig:
  """Which policy a program loads (the arguments of `load_policy`, bindable from gin)."""

  # A Hugging Face Qwen2/Qwen3 checkpoint directory; None: a random `model` policy.
  model_dir: str | None = None
  # Architecture of the random policy; None: the qwen2-tiny preset. With model_dir, how the
  # checkpoint's architecture computes (`resolve_config`: remat, scan, attention, dtypes), its
  # architecture checked against config.json.
  model: ModelConfig | None = None
  # Tokenizer files; None: model_dir's when it has them, else the packaged Qwen2 vocabulary.
  tokenizer_dir: str | None = None
  # Init seed of the random policy.
  seed: int = 0


# The mesh and logical-axis rules a policy of a given architecture is placed on (the rules may
# depend on it: e.g. heads are split only when their count divides by the tensor axis).
Layout = Callable[[ModelConfig], tuple[Mesh, Mapping]]


def load_policy(
  model_dir: str | None,
  model: ModelConfig | None,
  tokenizer_dir: str | None,
  seed: int = 0,
  *,
  layout: Layout | None = None,
) -> tuple[transformer.Transformer, Tokenizer, str]:
  """(model, tokenizer, description): a HF checkpoint (computing as `resolve_config` says), or a
  random model of `model` (default qwen2-tiny) that is written nowhere. layout: where the weights go; each device reads or
  initialises only its own shards, so no device ever holds the whole model (None: device 0). The
  tokenizer comes from `tokenizer_dir`, else from `model_dir` when it holds tokenizer files, else
  the packaged Qwen2 vocabulary. A gs:// model_dir is read from the local cache
  (`storage.local_copy`: safetensors are memory-mapped from local files)."""
  if model_dir is not None:
    model_dir = storage.local_copy(model_dir, what="model_dir")
    mesh, rules = None, sharding_lib.DEFAULT_RULES
    cfg = resolve_config(model_dir, model)
    if layout is not None:
      mesh, rules = layout(cfg)
    policy, cfg = hf_io.load(
      model_dir, mesh=mesh, rules=rules, config_overrides=compute_overrides(model)
    )
    what = f"{model_dir} ({cfg.model_type}, {cfg.num_layers} layers)"
  else:
    cfg = resolve_config(None, model)
    if layout is None:
      policy = transformer.Transformer(cfg, rngs=nnx.Rngs(seed))
    else:
      policy = init_sharded(cfg, seed, *layout(cfg))
    what = f"a random {cfg.model_type} policy ({cfg.num_params() / 1e6:.1f}M params)"
  tok_dir = storage.local_copy(tokenizer_dir, what="tokenizer_dir") if tokenizer_dir else None
  if tok_dir is None and model_dir is not None:
    has = any((Path(model_dir) / f).is_file() for f in ("tokenizer.json", "vocab.json"))
    tok_dir = model_dir if has else None
  tokenizer = Tokenizer.from_dir(tok_dir) if tok_dir else Tokenizer.qwen2()
  return policy, tokenizer, what


def init_sharded(
  cfg: ModelConfig, seed: int, mesh: Mesh, rules: Mapping
) -> transformer.Transformer:
  """A random model of `cfg` initialised by one jitted call whose outputs are the parameters'
  shardings: each device computes only its shards. Values equal eager init's up to float rounding
  (XLA fuses the normal sampler's arithmetic differently: <= 1 ulp, measured)."""

  def init() -> nnx.State:
    return nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(seed)))[1]

  graphdef, abstract = nnx.split(
    nnx.eval_shape(lambda: transformer.Transformer(cfg, rngs=nnx.Rngs(seed)))
  )
  shardings = sharding_lib.param_shardings(abstract, mesh, rules)
  return nnx.merge(graphdef, jax.jit(init, out_shardings=shardings)())
