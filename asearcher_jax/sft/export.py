"""The artefacts of an SFT run: a Hugging Face model directory, a JSON summary, a model card.

The model directory is what `hf_io.load`, the engine and `asearcher train` (`commands.train.model_dir`) start
from: config.json + safetensors (`hf_io.save`) plus a copy of the tokenizer files, so the
directory is self-contained (`model.loading.load_policy` takes the tokenizer from it).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from asearcher_jax.model import hf_io
from asearcher_jax.model.transformer import Transformer

# Files of a model directory that a tokenizer directory must not overwrite.
_MODEL_FILES = ("config.json", hf_io.INDEX_FILE)


def copy_tokenizer(tokenizer_dir: str | Path, model_dir: str | Path) -> list[str]:
  """Copies every plain file of the tokenizer directory except model files; returns the names."""
  copied = []
  for f in sorted(Path(tokenizer_dir).iterdir()):
    if f.is_file() and f.name not in _MODEL_FILES and f.suffix != ".safetensors":
      shutil.copy2(f, Path(model_dir) / f.name)
      copied.append(f.name)
  return copied


def export_model(
  graphdef: nnx.GraphDef,
  params: nnx.State,
  out_dir: str | Path,
  *,
  tokenizer_dir: str | Path,
  dtype: str | None = None,
) -> Path:
  """Writes the HF model directory (weights, config.json, tokenizer files); returns its path.
  In a multi-process program every process calls it (tensors sharded across processes are
  gathered); only process 0 writes."""
  model: Transformer = nnx.merge(graphdef, params)
  out = hf_io.save(model, out_dir, dtype=dtype)
  if jax.process_index() == 0:
    copy_tokenizer(tokenizer_dir, out)
  return out


def _fmt(x: Any) -> str:
  return f"{x:.4f}" if isinstance(x, float) else str(x)


def write_summary(out_dir: str | Path, summary: Mapping[str, Any]) -> tuple[Path, Path]:
  """Writes sft_summary.json and model_card.md into out_dir."""
  out = Path(out_dir)
  (out / "sft_summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
  final = summary.get("final", {})
  data = summary.get("data", {})
  model = summary.get("model", {})
  lines = [
    f"# {summary.get('name', 'SFT policy')}",
    "",
    "A Qwen-architecture policy trained by supervised fine-tuning on agent trajectories "
    "(loss on the generated tokens only).",
    "",
    "## Use",
    "",
    "```",
    f"asearcher train --gin_param='commands.train.model_dir=\"{summary.get('model_dir')}\"'",
    "```",
    "",
    "## Training",
    "",
    "| | |",
    "|---|---|",
    f"| command | `{summary.get('command')}` |",
    f"| init | {summary.get('init')} |",
    f"| parameters | {model.get('params', '?')} ({model.get('hidden_size')} hidden, "
    f"{model.get('num_layers')} layers, vocab {model.get('vocab_size')}) |",
    f"| seed | {summary.get('seed')} |",
    *[f"| data | `{p}` sha256 `{h}` |" for p, h in data.get("files", {}).items()],
    f"| trajectories | {data.get('trajectories')} (train {data.get('train_trajectories')}, "
    f"eval {data.get('eval_trajectories')}) |",
    f"| sequences / tokens / loss tokens | {data.get('sequences')} / {data.get('tokens')} / "
    f"{data.get('loss_tokens')} |",
    f"| steps | {summary.get('step')} (resumed from {summary.get('start_step')}) |",
    f"| training time | {summary.get('train_seconds')} s "
    f"({summary.get('tokens_per_s')} tokens/s incl. compilation) |",
    "",
    "## Results (generated tokens only)",
    "",
    "| metric | value |",
    "|---|---|",
    *[f"| {k} | {_fmt(v)} |" for k, v in final.items()],
    "",
  ]
  (out / "model_card.md").write_text("\n".join(lines))
  return out / "sft_summary.json", out / "model_card.md"
