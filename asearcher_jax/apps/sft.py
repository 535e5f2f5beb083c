"""`asearcher sft`: supervised fine-tuning of a policy on expert trajectories (JSONL).

A keyword-only function of nested frozen configs that gin binds (`gin/runs/sft.gin`). It resolves
the tokenizer and the policy (`model.loading.PolicyConfig`: a Hugging Face checkpoint or a
ModelConfig; else the `ScratchModel` preset, its vocabulary sized to the tokenizer), reads and
splits the trajectories, trains with `SFTTrainer` (resuming
from `out_dir` when it holds a checkpoint), and writes:
  out_dir/model/            HF model dir (config.json, model.safetensors, tokenizer files)
  out_dir/checkpoints/      Orbax checkpoints (resume)
  out_dir/metrics/          TensorBoard + metrics.jsonl
  out_dir/sft_summary.json  command, seed, data sha256, counts, time, final losses/accuracies
  out_dir/model_card.md     the same, for people
The JSON summary is also printed as the last line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from asearcher_jax.apps import invocation
from asearcher_jax.errors import AsearcherError
from asearcher_jax.model import hf_io, presets, steps
from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.model.loading import PolicyConfig
from asearcher_jax.model.transformer import Transformer
from asearcher_jax.sft import data as data_lib
from asearcher_jax.sft import export as export_lib
from asearcher_jax.sft.sft import SFTConfig, SFTTrainer
from asearcher_jax.tokenizer import PACKAGED_QWEN2, Tokenizer

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "vocab.json")


class SFTDataError(AsearcherError):
  """The trajectories cannot be trained on (missing, empty, or ids outside the vocabulary)."""


def resolve_tokenizer_dir(tokenizer_dir: str | None, model_dir: str | None) -> Path:
  """tokenizer_dir, else model_dir when it holds tokenizer files, else the packaged Qwen2 one."""
  if tokenizer_dir is not None:
    return Path(tokenizer_dir)
  if model_dir is not None and any((Path(model_dir) / f).is_file() for f in _TOKENIZER_FILES):
    return Path(model_dir)
  return PACKAGED_QWEN2


def resolve_model_config(
  model: str | ModelConfig, tokenizer_vocab: int, *, vocab_multiple: int = 64
) -> ModelConfig:
  """A preset name gets vocab_size = the tokenizer's size rounded up to vocab_multiple; a
  ModelConfig is used as is but must cover the tokenizer."""
  if isinstance(model, str):
    size = -(-tokenizer_vocab // vocab_multiple) * vocab_multiple
    return presets.model_config(name=model, vocab_size=size)
  if model.vocab_size < tokenizer_vocab:
    raise SFTDataError(
      f"model vocab_size={model.vocab_size} is smaller than the tokenizer's {tokenizer_vocab}"
    )
  return model


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScratchModel:
  """The from-scratch architecture, used when the policy names neither a checkpoint nor a
  ModelConfig: a preset whose vocabulary is sized to the tokenizer the trajectories were
  written with (a world tokenizer of a few thousand ids, not Qwen2's ~150k)."""

  # A `model.presets` name; its vocab_size becomes the tokenizer's.
  preset: str = "synthwiki-2m"
  # The tokenizer's size is rounded up to a multiple of this (aligned embedding rows).
  vocab_multiple: int = 64


def sft(
  *,
  trajectories: str | Sequence[str],
  out_dir: str = "runs/sft",
  policy: PolicyConfig = PolicyConfig(),
  scratch: ScratchModel = ScratchModel(),
  config: SFTConfig | None = None,
  optimizer: steps.OptimizerConfig | None = None,
  mesh: sharding_lib.MeshConfig = sharding_lib.MeshConfig(),
  precision: steps.PrecisionConfig = steps.PrecisionConfig(),
  export_dtype: str | None = None,
  name: str | None = None,
) -> int:
  """Trains to `config.steps` (resuming from out_dir), exports, summarises; returns 0.

  Args:
    trajectories: JSONL file(s) of `Trajectory.to_json()` lines (.gz allowed).
    out_dir: run directory (see the module docstring for its layout).
    policy: the start: `model_dir` (a Hugging Face checkpoint), else a random `model`
      (ModelConfig, checked to cover the tokenizer), else the `scratch` preset, initialised
      with `seed`; `tokenizer_dir` is the tokenizer the trajectories were written with (default:
      model_dir's, else the packaged Qwen2 vocabulary).
    scratch: the preset of a from-scratch policy and how its vocabulary is rounded.
    config: steps, batch shape, eval/log/checkpoint cadence, data seed; None: SFTConfig().
    optimizer: AdamW settings; None: `sft.default_optimizer(config.steps)`.
    mesh: the (data, fsdp, tensor) mesh over every process's devices (default: all on fsdp).
    precision: the master dtype of parameters and Adam's moments (fp32 by default; the forward
      runs in the model config's dtype).
    export_dtype: dtype of the exported weights (None: each parameter's dtype as loaded).
    name: the model card's title.
  """
  train_sft(
    trajectories=trajectories, out_dir=out_dir, policy=policy, scratch=scratch, config=config,
    optimizer=optimizer, mesh=mesh, precision=precision, export_dtype=export_dtype, name=name,
  )  # fmt: skip
  return 0


def train_sft(
  *,
  trajectories: str | Sequence[str],
  out_dir: str,
  policy: PolicyConfig,
  scratch: ScratchModel,
  config: SFTConfig | None,
  optimizer: steps.OptimizerConfig | None,
  mesh: sharding_lib.MeshConfig,
  precision: steps.PrecisionConfig,
  export_dtype: str | None,
  name: str | None,
) -> dict[str, Any] | None:
  """The SFT run of `sft` (see its arguments), shared by `asearcher sft` and the pipelines' SFT
  stages (`warm_start.SFTStage.run`), so that no program calls another's entry point. Returns
  the summary it wrote (None on a process other than the lead)."""
  t0 = time.time()
  config = config or SFTConfig()
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  model_dir, init_seed = policy.model_dir, policy.seed
  tok_dir = resolve_tokenizer_dir(policy.tokenizer_dir, model_dir)
  tokenizer = Tokenizer.from_dir(tok_dir)
  device_mesh = mesh.build()
  lead = jax.process_index() == 0

  # data: read, hash, split by trajectory, sequences
  paths = [trajectories] if isinstance(trajectories, str) else list(trajectories)
  files = {str(p): data_lib.file_sha256(p) for p in paths if Path(p).is_file()}
  try:
    trajs = data_lib.load_trajectories(paths)
  except (FileNotFoundError, ValueError) as e:
    raise SFTDataError(str(e)) from e
  if not trajs:
    raise SFTDataError(f"no trajectories in {paths}")
  data_sha = hashlib.sha256("".join(files.values()).encode()).hexdigest()
  per_traj, stats = data_lib.to_sequences(
    trajs, row_len=config.row_len, long_sequences=config.long_sequences,
    min_score=config.min_score,
  )  # fmt: skip
  train_idx, eval_idx = data_lib.split_eval(len(trajs), config.eval_fraction, config.seed)
  train_seqs = [s for i in train_idx for s in per_traj[i]]
  eval_seqs = [s for i in eval_idx for s in per_traj[i]]
  if not train_seqs:
    raise SFTDataError(f"no training sequence with a generated token in {paths}")

  # policy
  if model_dir is not None:
    net, cfg = hf_io.load(model_dir)
    init = f"{model_dir}"
  else:
    model = policy.model or scratch.preset
    cfg = resolve_model_config(model, tokenizer.vocab_size, vocab_multiple=scratch.vocab_multiple)
    net = Transformer(cfg, rngs=nnx.Rngs(init_seed))
    init = f"random (seed {init_seed}, {model if isinstance(model, str) else 'ModelConfig'})"
  max_id = max(int(s["tokens"].max()) for s in train_seqs + eval_seqs)
  if max_id >= cfg.vocab_size:
    raise SFTDataError(
      f"trajectory token id {max_id} >= model vocab_size {cfg.vocab_size}: the trajectories "
      f"were not written with this tokenizer ({tok_dir})"
    )
  if config.row_len > cfg.max_position_embeddings:
    log.warning("row_len %d > max_position_embeddings %d", config.row_len,
                cfg.max_position_embeddings)  # fmt: skip
  print(
    f"[sft{'' if lead else f' process {jax.process_index()}'}] {stats.trajectories} trajectories -> {len(train_seqs)} train / {len(eval_seqs)} eval "
    f"sequences, {stats.loss_tokens} loss tokens; policy {init}, "
    f"{cfg.num_params() / 1e6:.2f}M params; mesh {dict(device_mesh.shape)}",
    flush=True,
  )
  graphdef, params = nnx.split(net)
  trainer = SFTTrainer(
    graphdef, params, config=config, train_seqs=train_seqs, eval_seqs=eval_seqs,
    optimizer=optimizer, out_dir=out, pad_id=tokenizer.pad_id, mesh=device_mesh,
    meta={"data_sha256": data_sha}, precision=precision,
  )  # fmt: skip
  try:
    result = trainer.train()
    # Every process takes part (tensors held across processes are gathered); process 0 writes.
    model_path = export_lib.export_model(
      graphdef, trainer.export_params(), out / "model", tokenizer_dir=tok_dir, dtype=export_dtype
    )
  finally:
    trainer.close()
  if not lead:
    return None

  summary = {
    "name": name or f"sft-{cfg.model_type}-{cfg.num_params() / 1e6:.1f}m",
    "command": invocation.command("asearcher sft (called from Python)"),
    "model_dir": str(model_path),
    "init": init,
    "seed": config.seed,
    "init_seed": init_seed,
    "model": {"params": cfg.num_params(), **dataclasses.asdict(cfg)},
    "config": dataclasses.asdict(config),
    "optimizer": dataclasses.asdict(optimizer) if optimizer else "default",
    "tokenizer_dir": str(tok_dir),
    "mesh": dict(device_mesh.shape),
    "data": {
      "files": files,
      "data_sha256": data_sha,
      "train_trajectories": len(train_idx),
      "eval_trajectories": len(eval_idx),
      **dataclasses.asdict(stats),
    },
    "start_step": result.start_step,
    "step": result.step,
    "train_seconds": round(result.train_seconds, 2),
    "train_tokens": result.train_tokens,
    "tokens_per_s": round(result.train_tokens / max(result.train_seconds, 1e-9), 1),
    "final": result.final,
    "seconds": round(time.time() - t0, 1),
  }
  export_lib.write_summary(out, summary)
  print(json.dumps({k: summary[k] for k in ("model_dir", "step", "final", "seconds")}), flush=True)
  return summary
