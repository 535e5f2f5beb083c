"""Memory per chip of a run's two meshes, before paying for them: the trainer (FSDP over its
chips) and one serving replica (tensor-parallel over its chips).

Trainer, per chip (weights, moments and gradients FSDP-sharded over `chips`):
  params      master weights in `master_dtype` (fp32: `steps.PrecisionConfig`)
  optimizer   AdamW's two moments, in the master dtype
  compute     a copy of the weights in the compute dtype when it differs (bf16 matmuls)
  grads       the gradients, in the master dtype (the optimizer's own temporaries reuse the
              activations' memory once the backward pass is done)
  activations per live decoder block of one micro-batch (`micro_rows` rows of `row_len` tokens
              per data shard, a chip each at tensor = 1: PPOConfig.micro_rows counts so): its dense intermediates (x, norms, q/k/v, attention output, the three
              SwiGLU [tokens, I] buffers) and `score_copies` fp32 copies of the causal attention
              scores of every query block under dense attention (flash / splash keep only a
              per-row logsumexp per head: linear in the row); with remat on an accelerator, the
              block inputs of every layer plus one live block
  logits      `logit_copies` fp32 [tokens, vocab] buffers (logits, log-softmax, gradient) of one
              `ModelConfig.logits_chunk` of each row (the whole row when it is no longer)
Serving, per chip: the weights in the param dtype, the KV cache (slots x context x layers x 2 x
kv_heads x head_dim), and the decode step's logits, all divided over the replica's chips.

Coefficients: logit_copies = 2.0, dense 1.0 and score_copies = 2.4 solve the compiled memory
analyses of `steps.compile_train_step` on XLA:CPU at three sizes (2026-11-25: hidden 64/256/512,
vocab 4k/8k, 2 x 512 tokens); benchmarks/plan_check.py checks the formula on three other sizes.
XLA:CPU keeps every block's working set live even with remat (measured: the peak grows with
the layer count as without it), so `live_blocks=None` (all) is the CPU figure; recipes set 1 for
TPU, where remat bounds it -- an assumption no run here has measured.
"""

from __future__ import annotations

import dataclasses
import math

from asearcher_jax.model.config import ModelConfig

GB = 1e9
_BYTES = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChipSpec:
  """One TPU generation's per-chip figures, as the Cloud TPU documentation states them."""

  name: str
  hbm_gb: float  # HBM per chip
  bf16_tflops: float  # peak dense bf16
  hbm_gbps: float  # HBM bandwidth


# https://cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e (system architecture tables).
CHIPS: dict[str, ChipSpec] = {
  c.name: c
  for c in (
    ChipSpec(name="v4", hbm_gb=32.0, bf16_tflops=275.0, hbm_gbps=1228.0),
    ChipSpec(name="v5e", hbm_gb=16.0, bf16_tflops=197.0, hbm_gbps=819.0),
    ChipSpec(name="v5p", hbm_gb=95.0, bf16_tflops=459.0, hbm_gbps=2765.0),
    ChipSpec(name="v6e", hbm_gb=32.0, bf16_tflops=918.0, hbm_gbps=1640.0),
  )
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerShape:
  """What the trainer mesh holds and computes per step."""

  # Chips the trainer's FSDP mesh spans.
  chips: int = 1
  # Tokens per packed row (PPOConfig.row_len) and rows per data shard per forward/backward pass
  # (PPOConfig.micro_rows, which counts per shard; the whole minibatch's share when it is None).
  row_len: int = 4096
  micro_rows: int = 1
  # Dtype of the master weights and Adam's moments (steps.PrecisionConfig.master_dtype).
  master_dtype: str = "float32"
  # Decoder blocks whose working set is live at the peak: None = all of them (XLA:CPU, also
  # without remat); 1 = remat's bound (the block inputs of every layer are kept besides).
  live_blocks: int | None = None
  # [tokens, vocab] fp32 buffers of the loss, and fp32 copies of the attention scores per block.
  logit_copies: float = 2.0
  score_copies: float = 2.4


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServingShape:
  """One serving replica: its chips and its engine's cache."""

  # Chips the replica's weights and KV cache are split over (tensor parallel).
  chips: int = 1
  # EngineConfig.max_slots and max_seq_len.
  slots: int = 32
  context: int = 32768
  # Dtype of the KV cache.
  kv_dtype: str = "bfloat16"


def _b(dtype: str) -> int:
  if dtype not in _BYTES:
    raise ValueError(f"unknown dtype {dtype!r} (float32 or bfloat16)")
  return _BYTES[dtype]


def causal_score_entries(row_len: int, block: int) -> int:
  """Query x key entries of causal attention over one row in query blocks of `block`
  (attention.attend_causal: block i sees the keys up to its end)."""
  if block <= 0 or row_len <= block or row_len % block:
    return row_len * row_len
  n = row_len // block
  return block * block * n * (n + 1) // 2


def score_entries(model: ModelConfig, row_len: int) -> int:
  """fp32 attention-score entries per head and row the backward pass keeps: the causal query
  blocks' scores under dense attention, one logsumexp per query otherwise (flash, splash; "auto"
  plans for an accelerator, where it is splash)."""
  if model.attention == "dense":
    return causal_score_entries(row_len, model.attention_block)
  return row_len


def trainer_memory(model: ModelConfig, shape: TrainerShape) -> dict[str, float]:
  """Bytes per chip of the trainer, by part, and their total."""
  p = model.num_params()
  master = _b(shape.master_dtype)
  act = _b(model.dtype)
  c = shape.chips
  d, hd, inter = model.hidden_size, model.resolved_head_dim, model.intermediate_size
  q, kv = model.num_heads * hd, model.num_kv_heads * hd
  rows = shape.micro_rows
  tokens = rows * shape.row_len
  scores = rows * model.num_heads * score_entries(model, shape.row_len)
  chunk = model.logits_chunk
  logit_tokens = rows * (chunk if 0 < chunk < shape.row_len else shape.row_len)
  block = (
    tokens * (6 * d + q + 2 * kv) * 4 + 3 * tokens * inter * 4 + shape.score_copies * scores * 4
  )
  if shape.live_blocks is None:
    layers = block * model.num_layers
  else:
    layers = tokens * d * act * model.num_layers + block * shape.live_blocks
  parts = {
    "params": p * master / c,
    "optimizer": 2 * p * master / c,
    "compute_copy": p * act / c if act != master else 0.0,
    "grads": p * master / c,
    "activations": layers,
    "logits": shape.logit_copies * logit_tokens * model.vocab_size * 4,
  }
  parts["total"] = sum(parts.values())
  return parts


def serving_memory(model: ModelConfig, shape: ServingShape) -> dict[str, float]:
  """Bytes per chip of one serving replica, by part, and their total."""
  c = shape.chips
  kv_per_token = model.num_layers * 2 * model.num_kv_heads * model.resolved_head_dim
  parts = {
    "params": model.num_params() * _b(model.param_dtype) / c,
    "kv_cache": shape.slots * shape.context * kv_per_token * _b(shape.kv_dtype) / c,
    "logits": shape.slots * model.vocab_size * 4 / c,
  }
  parts["total"] = sum(parts.values())
  return parts


def fits(total_bytes: float, headroom: float = 0.9) -> dict[str, bool]:
  """Whether `total_bytes` per chip fits each generation's HBM, leaving 1 - headroom for XLA's
  own buffers and fragmentation."""
  return {name: total_bytes <= headroom * chip.hbm_gb * GB for name, chip in CHIPS.items()}


def train_step_s(model: ModelConfig, tokens: int, chips: int, chip: str, mfu: float = 0.4,
                 forwards: int = 4) -> float:  # fmt: skip
  """Seconds per training step of `tokens` on `chips`: `forwards` forward-equivalents per token
  (forward + backward 3, remat +1; the decoupled loss's prox pass rides on the step's own
  forward) at `mfu` of the chips' peak."""
  flops = forwards * tokens * model.matmul_flops_per_token(4096)
  return flops / (chips * CHIPS[chip].bf16_tflops * 1e12 * mfu)


def decode_token_s(model: ModelConfig, chips: int, chip: str, efficiency: float = 0.6) -> float:
  """Seconds per decode step of one replica: memory-bound, the weights read once per step."""
  return (
    model.num_params() * _b(model.param_dtype) / (chips * CHIPS[chip].hbm_gbps * 1e9 * efficiency)
  )


def gb(x: float) -> float:
  return math.floor(x / GB * 100 + 0.5) / 100
