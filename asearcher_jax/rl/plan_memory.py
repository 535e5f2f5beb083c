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
Serving, per chip: the weights in the param dtype, the KV cache, and the decode step's logits,
divided over the replica's chips. The cache is either fixed (slots x context positions reserved)
or paged (`ServingShape.pages` pages of `page_size` positions, shared by whichever sequences
are live); its KV heads are split over the chips, or duplicated up to the chip count where the
chips outnumber them (each chip holds one head's copy: serving/mesh.py).

Serving speed (what the paged engine does, rl/plan_memory.py's second half):
  live        sequences decoding at once: the slots (fixed), or the page budget over the pages
              a live sequence holds on average (paged). A sequence of final length L grows
              through its life, so the live population holds E[L^2] / (2 E[L]) positions each
              (length-biased: long sequences stay live longer), plus half a page of tail;
              L is a log-normal capped at the context (`LengthDistribution`).
  decode step the weights read once plus every live sequence's keys and values, over the HBM
              bandwidth, or the step's matmuls over the FLOP rate, whichever is longer (a
              roofline), plus a per-call overhead (dispatch, the host copy of the tokens).
  prefill     compute-bound: 2 x parameters FLOPs a token; a group's shared prompt is
              prefilled once for its n samples (prefix sharing). Chunks of prefill ride in the
              decode steps (ragged batches), so they add their FLOPs to the step.
`serving_rates` turns these into plan_sim's per-token and per-call seconds for a given number
of episodes in flight (beyond the live capacity they wait their turn).

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
import statistics

from asearcher_jax.model.config import ModelConfig

GB = 1e9
_BYTES = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChipSpec:
  """One accelerator's per-chip figures, as its maker's documentation states them (a TPU
  generation, or an NVIDIA GPU: one GPU is a "chip" here)."""

  name: str
  hbm_gb: float  # HBM per chip
  bf16_tflops: float  # peak dense bf16
  hbm_gbps: float  # HBM bandwidth


# https://cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e (system architecture tables); NVIDIA's
# H100 SXM5 and H200 SXM datasheets (dense bf16 without sparsity: 989 TFLOPS; HBM3 80 GB at
# 3.35 TB/s, HBM3e 141 GB at 4.8 TB/s), for one 8-GPU host (docs/gpu.md).
CHIPS: dict[str, ChipSpec] = {
  c.name: c
  for c in (
    ChipSpec(name="v4", hbm_gb=32.0, bf16_tflops=275.0, hbm_gbps=1228.0),
    ChipSpec(name="v5e", hbm_gb=16.0, bf16_tflops=197.0, hbm_gbps=819.0),
    ChipSpec(name="v5p", hbm_gb=95.0, bf16_tflops=459.0, hbm_gbps=2765.0),
    ChipSpec(name="v6e", hbm_gb=32.0, bf16_tflops=918.0, hbm_gbps=1640.0),
    ChipSpec(name="h100", hbm_gb=80.0, bf16_tflops=989.0, hbm_gbps=3350.0),
    ChipSpec(name="h200", hbm_gb=141.0, bf16_tflops=989.0, hbm_gbps=4800.0),
  )
}

# Other spellings of a chip: gcloud's accelerator-type prefix ("v5litepod-16" is 16 v5e chips)
# and NVIDIA's upper case; `chip_name` maps them onto CHIPS.
CHIP_ALIASES = {"v5litepod": "v5e"}


def chip_name(name: str) -> str:
  """The CHIPS name of a chip spelled any accepted way ('v5litepod' -> 'v5e', 'H100' ->
  'h100'); an unknown name is returned as given (lower case)."""
  name = name.strip().lower()
  return CHIP_ALIASES.get(name, name)


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
  # Pages of the paged cache per replica (each `page_size` positions of every layer); None: the
  # fixed cache (slots x context reserved). Paged, `slots` is the most sequences decoding at once
  # (the page table's rows). The TPU kernel keeps the [slots, context / page_size] int32 page
  # table in SMEM (1 MiB on v5p): 512 slots x 32k need pages of 128 (64 overflowed it).
  pages: int | None = None
  page_size: int = 128
  # Serving replicas generating for the trainer (each one this shape).
  replicas: int = 1
  # Tokens of a group's prompt (shared by its n samples: prefilled and held once) and of each
  # tool result appended to an episode (prefilled per search).
  prompt_tokens: int = 1024
  tool_tokens: int = 512
  # A group's samples share their prompt's pages and prefill (prefix sharing); False: each
  # sample prefills it again (the fixed-slot engine).
  share_prompt: bool = True
  # Fraction of the chip's HBM bandwidth and bf16 peak a decode step reaches, and the seconds
  # each engine call adds (dispatch, host copy).
  bandwidth_efficiency: float = 0.6
  flops_efficiency: float = 0.4
  call_overhead_s: float = 0.002
  # A weight update re-prefills every live sequence under the new weights before decoding goes
  # on (DriverConfig.kv_on_update "recompute", AReaL's); False: "keep" (no re-prefill).
  reprefill_on_update: bool = True
  # Positions a free slot's decode row attends (paged): 0, the engine since 2026-12-04; the
  # context, the engine before (a free slot sat at the cache's last position and read it all).
  idle_slot_context: int = 0

  def __post_init__(self):
    if self.pages is not None and self.pages <= 0:
      raise ValueError(f"ServingShape.pages must be positive or None, got {self.pages}")
    if self.page_size <= 0:
      raise ValueError(f"ServingShape.page_size must be positive, got {self.page_size}")
    if self.replicas <= 0:
      raise ValueError(f"ServingShape.replicas must be positive, got {self.replicas}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LengthDistribution:
  """Tokens a trajectory holds in the KV cache when it ends (prompt, every turn, every tool
  result): a log-normal fit, capped at the engine's context."""

  # The median (exp of the underlying normal's mean) and that normal's standard deviation.
  median: float = 6000.0
  sigma: float = 0.8
  # Longest trajectory (EngineConfig.max_seq_len): longer draws end there.
  cap: float = 32768.0

  def __post_init__(self):
    if self.median <= 0 or self.sigma < 0 or self.cap <= 0:
      raise ValueError(
        f"LengthDistribution needs median > 0, sigma >= 0, cap > 0; got {self.median}, "
        f"{self.sigma}, {self.cap}"
      )


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


def kv_heads_per_chip(model: ModelConfig, chips: int) -> int:
  """KV heads each chip of a tensor-parallel replica holds: its share when they divide by the
  chips, one (its own copy) when the chips outnumber them (serving/mesh.py duplicates them),
  all of them otherwise (replicated)."""
  k = model.num_kv_heads
  if chips >= k and chips % k == 0:
    return 1
  return k // chips if k % chips == 0 else k


def kv_bytes_per_token(model: ModelConfig, chips: int, dtype: str = "bfloat16") -> float:
  """Bytes of keys and values one cached position takes on each chip of the replica."""
  heads = kv_heads_per_chip(model, chips)
  return model.num_layers * 2 * heads * model.resolved_head_dim * _b(dtype)


def serving_memory(model: ModelConfig, shape: ServingShape) -> dict[str, float]:
  """Bytes per chip of one serving replica, by part, and their total."""
  c = shape.chips
  positions = shape.slots * shape.context if shape.pages is None else shape.pages * shape.page_size
  parts = {
    "params": model.num_params() * _b(model.param_dtype) / c,
    "kv_cache": positions * kv_bytes_per_token(model, c, shape.kv_dtype),
    "logits": shape.slots * model.vocab_size * 4 / c,
  }
  parts["total"] = sum(parts.values())
  return parts


def _capped_moment(dist: LengthDistribution, k: int) -> float:
  """E[min(L, cap)^k] of the log-normal L: the closed form of the truncated moments."""
  mu, s = math.log(dist.median), dist.sigma
  c = math.log(dist.cap)
  if s == 0:
    return min(dist.median, dist.cap) ** k
  phi = statistics.NormalDist().cdf
  below = math.exp(k * mu + k * k * s * s / 2) * phi((c - mu - k * s * s) / s)
  return below + dist.cap**k * (1 - phi((c - mu) / s))


def mean_length(dist: LengthDistribution) -> float:
  """Mean final length of a trajectory (tokens)."""
  return _capped_moment(dist, 1)


def live_context(dist: LengthDistribution) -> float:
  """Mean positions a live sequence holds: E[L^2] / (2 E[L]) (a sequence grows from 0 to L over
  a life as long as L, so at a random moment the live ones are length-biased, half-way)."""
  return _capped_moment(dist, 2) / (2 * _capped_moment(dist, 1))


def live_sequences(shape: ServingShape, dist: LengthDistribution) -> float:
  """Sequences one replica decodes at once: its slots (fixed cache), or its pages over the pages
  a live sequence holds on average (half a page of tail each), at most its slots (paged)."""
  if shape.pages is None:
    return float(shape.slots)
  per_sequence = live_context(dist) / shape.page_size + 0.5
  return min(float(shape.slots), shape.pages / per_sequence)


def pages_for(live: int, dist: LengthDistribution, page_size: int) -> int:
  """Pages a replica needs for `live` sequences on average (the inverse of live_sequences)."""
  return math.ceil(live * (live_context(dist) / page_size + 0.5))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rates:
  """What one replica moves and computes per second, and what each call costs."""

  # Bytes per second read from HBM (every chip of the replica together, at its efficiency).
  bytes_s: float
  # FLOP per second of the matmuls (every chip together, at its efficiency).
  flops_s: float
  # Seconds each engine call adds besides (dispatch, the host copy of the tokens).
  call_overhead_s: float = 0.0
  # Bytes per second the attention reads cached keys and values at; None: `bytes_s` (a kernel
  # that streams the pages once, as ragged paged attention does on TPU). XLA:CPU's attention
  # transposes the keys and values first, so it reads them at its own rate.
  kv_bytes_s: float | None = None


def chip_rates(shape: ServingShape, chip: str) -> Rates:
  """A replica's rates from its chips' documented peaks (CHIPS) and the shape's efficiencies."""
  spec = CHIPS[chip]
  return Rates(
    bytes_s=shape.chips * spec.hbm_gbps * 1e9 * shape.bandwidth_efficiency,
    flops_s=shape.chips * spec.bf16_tflops * 1e12 * shape.flops_efficiency,
    call_overhead_s=shape.call_overhead_s,
  )


def decode_step_s(
  model: ModelConfig,
  *,
  batch: float,
  context: float,
  rates: Rates,
  chips: int = 1,
  weight_dtype: str | None = None,
  kv_dtype: str | None = None,
  prefill_tokens: float = 0.0,
  idle_positions: float = 0.0,
) -> float:
  """Seconds of one decode step of `batch` sequences holding `context` positions each (plus
  `prefill_tokens` of prefill riding in the same ragged batch): the weights and every live
  key and value read once, or the matmul FLOPs, whichever takes longer, plus the call's
  overhead. chips: the replica's tensor-parallel degree (the KV heads each chip holds).
  idle_positions: positions the step's free slots read besides (ServingShape.idle_slot_context
  each)."""
  weights = model.num_params() * _b(weight_dtype or model.param_dtype)
  per_token = kv_bytes_per_token(model, chips, kv_dtype or model.dtype) * chips
  kv = (batch * context + idle_positions) * per_token
  tokens = batch + prefill_tokens
  q = model.num_heads * model.resolved_head_dim
  flops = 2 * model.num_params() * tokens + 4 * model.num_layers * q * batch * context
  read_s = weights / rates.bytes_s + kv / (rates.kv_bytes_s or rates.bytes_s)
  return max(read_s, flops / rates.flops_s) + rates.call_overhead_s


def prefill_s(model: ModelConfig, tokens: float, rates: Rates) -> float:
  """Seconds to prefill `tokens` on their own: compute-bound, 2 FLOPs per parameter a token."""
  return 2 * model.num_params() * tokens / rates.flops_s + rates.call_overhead_s


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


def length_quantile(dist: LengthDistribution, q: float) -> float:
  """The q-quantile of the capped log-normal length."""
  z = statistics.NormalDist().inv_cdf(min(max(q, 1e-9), 1 - 1e-9))
  return min(dist.cap, dist.median * math.exp(dist.sigma * z))


def serving_rates(
  model: ModelConfig,
  shape: ServingShape,
  dist: LengthDistribution,
  rates: Rates,
  *,
  in_flight: float,
  calls_per_episode: float,
  tokens_per_call: float,
  searches_per_episode: float,
  group_size: int,
  update_interval_s: float | None = None,
) -> dict[str, float]:
  """Per-token and per-call seconds of one episode when `in_flight` episodes share the
  replicas (plan_sim.Workload's decode_token_s and call_overhead_s), and what they come from.

  Each replica decodes min(its share, its live capacity) sequences a step; episodes beyond the
  capacity wait their turn (their tokens come capacity / share as often). The paged engine reads
  each live sequence's own positions; the fixed one reads every slot over the window of the
  longest (the 1 - 1 / (batch + 1) quantile of the length). Prefill tokens (the prompt, once a
  group when shared, and each tool result) ride in the decode steps in proportion to the
  tokens generated; a call waits for its own prefill besides.

  update_interval_s: seconds between two weight updates while episodes are in flight (async RL:
  a train step); each one re-prefills every live sequence (`reprefill_on_update`) while
  decoding waits, so tokens come 1 / (1 - that share of the interval) slower. None: no update
  lands mid-episode (synchronous RL)."""
  share = in_flight / shape.replicas
  capacity = live_sequences(shape, dist)
  batch = max(min(share, capacity), 1.0)
  if shape.pages is None:
    context = length_quantile(dist, 1 - 1 / (batch + 1))
  else:
    context = live_context(dist)
  prompt = shape.prompt_tokens / group_size if shape.share_prompt else shape.prompt_tokens
  prefill_per_episode = prompt + searches_per_episode * shape.tool_tokens
  generated = calls_per_episode * tokens_per_call
  idle = max(shape.slots - batch, 0.0) * shape.idle_slot_context if shape.pages else 0.0
  step = decode_step_s(
    model, batch=batch, context=context, rates=rates, chips=shape.chips,
    kv_dtype=shape.kv_dtype, prefill_tokens=batch * prefill_per_episode / generated,
    idle_positions=idle,
  )  # fmt: skip
  reprefill = 0.0
  if update_interval_s and shape.reprefill_on_update:
    reprefill = prefill_s(model, batch * context, rates)
  stall = min(reprefill / update_interval_s, 0.9) if update_interval_s else 0.0
  return {
    "live_capacity": capacity,
    "decode_batch": batch,
    "context": context,
    "step_s": step,
    "reprefill_s": reprefill,
    "reprefill_stall_frac": stall,
    "decode_token_s": step * max(1.0, share / capacity) / (1.0 - stall),
    "call_overhead_s": prefill_s(model, prefill_per_episode / calls_per_episode, rates),
    "prefill_tokens_per_episode": prefill_per_episode,
  }
