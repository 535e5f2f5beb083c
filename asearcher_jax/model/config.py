"""Model configuration for the Qwen2 / Qwen2.5 / Qwen3 decoder family, and its config.json mapping.

One frozen dataclass describes every supported size. `from_hf_config` reads a Hugging Face
`config.json` dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`) and
rejects what the decoder does not implement with an error naming the field, rather than loading
weights into a model that silently computes something else.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from asearcher_jax.errors import UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear")
# What the backward pass keeps of each decoder block (transformer.REMAT_POLICIES maps the names
# onto jax.checkpoint_policies): "none" keeps everything (no remat), "full" only the block's input,
# "dots" the outputs of the weight matmuls (MaxText's "minimal"), "dots_saveable" every matmul
# output, attention scores included.
REMAT_POLICIES = ("none", "full", "dots", "dots_saveable")
DType = Literal["float32", "bfloat16"]
# ModelConfig.attention: "auto" resolves per platform (model/attention.py, resolve_attention).
ATTENTION_CHOICES = ("auto", "dense", "flash", "splash")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Shape and numerics of one decoder.

  Attributes:
    model_type: "qwen2" (Qwen2, Qwen2.5, QwQ) or "qwen3"; decides the config.json layout.
    vocab_size: rows of the embedding (may exceed the tokenizer's size; Qwen pads to 151936).
    hidden_size: model width D.
    intermediate_size: SwiGLU hidden width.
    num_layers: decoder blocks.
    num_heads: query heads H.
    num_kv_heads: key/value heads K (GQA); must divide num_heads.
    head_dim: per-head width; None means hidden_size // num_heads (Qwen2); Qwen3 sets it.
    rope_theta: RoPE base frequency.
    rope_scaling_factor: linear position-interpolation factor; 1.0 means no scaling.
    rms_norm_eps: epsilon inside every RMSNorm.
    qkv_bias: q/k/v projections carry a bias (Qwen2 yes, Qwen3 no).
    qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
    tie_word_embeddings: the output projection reuses the input embedding.
    max_position_embeddings: longest context the checkpoint was trained for (informational; the
      KV cache size is chosen by the engine).
    param_dtype: dtype the parameters are stored and updated in.
    dtype: dtype of activations and matmul inputs; softmax and norms always run in float32.
    remat_policy: what the backward pass keeps of each decoder block, one of REMAT_POLICIES
      ("none": no rematerialisation; "full": recompute the whole block, the least memory). The
      default keeps every matmul output and recomputes the elementwise ops: under the scan each
      kept buffer is stacked over layers, and stacking all of them ("none") cost ~12 % of the
      step on XLA:CPU (docs/design_notes.md).
    scan_layers: run the training/scoring path's blocks under one `jax.lax.scan` (compile time
      independent of depth), the learner then keeping the layers stacked (`steps.train_form`);
      False unrolls a Python loop (the reference). Serving always loops.
    logits_chunk: tokens per row whose [rows, chunk, vocab] fp32 logits are live at once in
      `transformer.score` (and so in every loss built on it); each chunk is recomputed in the
      backward pass. 0, or a row no longer than it, computes the whole [rows, T, vocab] at once.
    attention_block: query block size of causal attention on packed batches; blocks skip keys
      after their end. 0 (or a length not divisible by it) computes the full score matrix.
    attention: kernel of packed training/scoring attention: "dense" (the reference; memory
      quadratic in T), "flash" (blockwise online softmax, custom VJP, any backend; linear),
      "splash" (the Pallas TPU kernel), or "auto": splash on TPU, flash elsewhere (on CPU it
      also trains faster than dense at 1-2k-token rows: docs/measurements.md), resolved by `jax.default_backend()` unless resolved beforehand
      (`attention.resolve_attention(cfg.attention, "tpu")` for an AOT compile). The serving
      path (`Transformer.extend`) is unaffected.
    flash_block: query and key block of "flash" (T is padded up to a multiple; a shorter row is
      one block); 256 trains fastest on CPU at 1-2k-token rows (128 and 512 are slower).
    attention_interpret: run the splash kernel in Pallas interpret mode (CPU tests; slow).
  """

  model_type: str = "qwen2"
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int | None = None
  rope_theta: float = 1_000_000.0
  rope_scaling_factor: float = 1.0
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = True
  qk_norm: bool = False
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 32768
  param_dtype: DType = "float32"
  dtype: DType = "float32"
  remat_policy: str = "dots_saveable"
  scan_layers: bool = True
  logits_chunk: int = 1024
  attention_block: int = 128
  attention: str = "auto"
  flash_block: int = 256
  attention_interpret: bool = False

  def __post_init__(self):
    if self.model_type not in SUPPORTED_MODEL_TYPES:
      raise UnsupportedModelError(
        f"model_type {self.model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})"
      )
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
      if getattr(self, name) <= 0:
        raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
    if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
      raise ValueError(
        f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads} (GQA)"
      )
    if self.head_dim is None and self.hidden_size % self.num_heads:
      raise ValueError("hidden_size must be divisible by num_heads when head_dim is not given")
    if self.attention not in ATTENTION_CHOICES:
      raise ValueError(
        f"ModelConfig.attention must be one of {ATTENTION_CHOICES}, got {self.attention!r}"
      )
    if self.flash_block <= 0:
      raise ValueError(f"ModelConfig.flash_block must be positive, got {self.flash_block}")
    if self.rope_scaling_factor < 1.0:
      raise ValueError(f"rope_scaling_factor must be >= 1, got {self.rope_scaling_factor}")
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(
        f"ModelConfig.remat_policy {self.remat_policy!r} is not one of {', '.join(REMAT_POLICIES)}"
      )
    if self.logits_chunk < 0:
      raise ValueError(f"ModelConfig.logits_chunk must be >= 0, got {self.logits_chunk}")

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

  def replace(self, **changes: Any) -> ModelConfig:
    return dataclasses.replace(self, **changes)

  def num_params(self) -> int:
    """Parameter count (embeddings counted once when tied)."""
    d, hd = self.hidden_size, self.resolved_head_dim
    q, kv = self.num_heads * hd, self.num_kv_heads * hd
    attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0)
    attn += 2 * hd if self.qk_norm else 0
    layer = attn + 3 * d * self.intermediate_size + 2 * d
    emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
    return self.num_layers * layer + emb + d

  def matmul_flops_per_token(self, seq_len: int) -> float:
    """Forward FLOPs per token: 2 per weight MAC plus causal attention scores and values."""
    d, hd = self.hidden_size, self.resolved_head_dim
    q, kv = self.num_heads * hd, self.num_kv_heads * hd
    dense = d * q + 2 * d * kv + q * d + 3 * d * self.intermediate_size
    per_layer = 2 * dense + 2 * 2 * q * (seq_len / 2)  # QK^T and AV over ~T/2 keys on average
    return self.num_layers * per_layer + 2 * d * self.vocab_size


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, float]:
  """Returns (theta, linear factor) from either transformers 4.x or 5.x config layouts."""
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or {}
  merged = {**scaling, **params}
  theta = float(merged.get("rope_theta", hf.get("rope_theta", 10000.0)))
  rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
  if rope_type not in SUPPORTED_ROPE_TYPES:
    raise UnsupportedModelError(
      f"rope scaling type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
    )
  factor = float(merged.get("factor", 1.0)) if rope_type == "linear" else 1.0
  return theta, factor


def from_hf_config(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
  """Builds a ModelConfig from a Hugging Face config.json dict; `overrides` win (e.g. dtypes)."""
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    archs = hf.get("architectures")
    raise UnsupportedModelError(
      f"config.json model_type={model_type!r} (architectures={archs}) is not supported; "
      f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise UnsupportedModelError(f"config.json hidden_act={act!r} is not supported (only 'silu')")
  if hf.get("use_sliding_window"):
    raise UnsupportedModelError("config.json use_sliding_window=true is not supported")
  layer_types = hf.get("layer_types") or []
  if any(t != "full_attention" for t in layer_types):
    raise UnsupportedModelError(f"config.json layer_types {set(layer_types)} are not supported")
  theta, factor = _rope_from_hf(hf)
  dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
  kwargs: dict[str, Any] = dict(
    model_type=model_type,
    vocab_size=int(hf["vocab_size"]),
    hidden_size=int(hf["hidden_size"]),
    intermediate_size=int(hf["intermediate_size"]),
    num_layers=int(hf["num_hidden_layers"]),
    num_heads=int(hf["num_attention_heads"]),
    num_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
    head_dim=hf.get("head_dim"),
    rope_theta=theta,
    rope_scaling_factor=factor,
    rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
    qk_norm=model_type == "qwen3",
    tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
    param_dtype="bfloat16" if dtype == "bfloat16" else "float32",
    dtype="bfloat16" if dtype == "bfloat16" else "float32",
  )
  if model_type == "qwen2" and hf.get("head_dim") is not None:
    # Qwen2 always uses hidden/heads; transformers writes it back sometimes. Keep it if consistent.
    if int(hf["head_dim"]) != int(hf["hidden_size"]) // int(hf["num_attention_heads"]):
      raise UnsupportedModelError("qwen2 config with head_dim != hidden_size/num_heads")
    kwargs["head_dim"] = None
  kwargs.update(overrides)
  return ModelConfig(**kwargs)


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  """The config.json that transformers' Qwen2/Qwen3 classes load into the same model."""
  arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[cfg.model_type]
  rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
  if cfg.rope_scaling_factor != 1.0:
    rope = {"rope_type": "linear", "rope_theta": cfg.rope_theta, "factor": cfg.rope_scaling_factor}
  out: dict[str, Any] = {
    "architectures": [arch],
    "model_type": cfg.model_type,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.hidden_size,
    "intermediate_size": cfg.intermediate_size,
    "num_hidden_layers": cfg.num_layers,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "hidden_act": "silu",
    "max_position_embeddings": cfg.max_position_embeddings,
    "rms_norm_eps": cfg.rms_norm_eps,
    "rope_theta": cfg.rope_theta,
    "rope_parameters": rope,
    "tie_word_embeddings": cfg.tie_word_embeddings,
    "use_sliding_window": False,
    "attention_dropout": 0.0,
    "dtype": cfg.param_dtype,
    "torch_dtype": cfg.param_dtype,
  }
  if cfg.rope_scaling_factor != 1.0:
    out["rope_scaling"] = {"type": "linear", "factor": cfg.rope_scaling_factor}
  if cfg.model_type == "qwen3":
    out["head_dim"] = cfg.resolved_head_dim
    out["attention_bias"] = cfg.qkv_bias
  return out
