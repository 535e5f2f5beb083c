"""`asearcher demo`: the foundation end to end on one machine, in about a minute.

A smoke test of the foundation (the main job is `asearcher quickstart`). It exercises every
piece the later stages build on: a Qwen-architecture policy written and re-read as a Hugging
Face checkpoint, the real Qwen2 tokenizer and chat format, a device mesh, packed scoring, prefill + decode against the KV cache,
a few jitted AdamW steps that visibly fit the demo texts, and an Orbax checkpoint round trip.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asearcher_jax.checkpoint import CheckpointConfig, Checkpointer, abstract_like
from asearcher_jax.metric_writer import MetricWriter
from asearcher_jax.model import hf_io, presets, steps, transformer
from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.model.kv_cache import KVCache
from asearcher_jax.model.packing import pack, unpack
from asearcher_jax.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_CHATS = (
  ("Who designed the Eiffel Tower?", "<think>I should search.</think>\n<search>Eiffel Tower designer</search>"),
  ("When was the University of Oxford founded?", "<answer>around 1096</answer>"),
  ("What is the capital of Australia?", "<think>Canberra, not Sydney.</think>\n<answer>Canberra</answer>"),
)  # fmt: skip


def _encode(tok: Tokenizer, question: str, response: str) -> dict[str, np.ndarray]:
  prompt = tok.encode_chat([{"role": "user", "content": question}])
  answer = [*tok.encode(response), tok.eos_id]
  ids = np.asarray(prompt + answer, np.int32)
  mask = np.zeros(len(ids), np.float32)
  mask[len(prompt) :] = 1.0  # train on the assistant's tokens only
  return {"tokens": ids, "loss_mask": mask}


def _greedy(
  model: transformer.Transformer, prompt: Sequence[int], n: int, max_len: int
) -> list[int]:
  cache = KVCache.init(model.cfg, batch=1, max_len=max_len)
  extend = nnx.jit(lambda m, t, s, c: m.extend(t, s, c))
  logits, cache = extend(model, jnp.asarray([prompt]), jnp.zeros(1, jnp.int32), cache)
  out = [int(jnp.argmax(logits[0, -1]))]
  for i in range(n - 1):
    start = jnp.asarray([len(prompt) + i], jnp.int32)
    logits, cache = extend(model, jnp.asarray([[out[-1]]]), start, cache)
    out.append(int(jnp.argmax(logits[0, -1])))
  return out


def run(
  *,
  model: ModelConfig | None = None,
  model_dir: str | None = None,
  tokenizer_dir: str | None = None,
  workdir: str = "runs/demo",
  chats: Sequence[tuple[str, str]] = DEFAULT_CHATS,
  train_steps: int = 30,
  learning_rate: float = 3e-3,
  row_len: int = 128,
  generate_tokens: int = 12,
  seed: int = 0,
) -> dict:
  """Runs the demo; returns (and prints as the last line) a JSON summary.

  Args:
    model: architecture of a randomly initialised policy (default: the qwen2-tiny preset).
    model_dir: a local Hugging Face Qwen2/Qwen3 checkpoint to load instead of a random model.
    tokenizer_dir: tokenizer files (tokenizer.json or vocab.json + merges.txt); default: the
      packaged Qwen2 vocabulary.
    workdir: where the HF export, the Orbax checkpoints and metrics go.
    chats: (question, response) pairs to score and fit.
    train_steps: AdamW steps on the chats (loss on response tokens only).
    learning_rate: peak AdamW learning rate.
    row_len: packed row length.
    generate_tokens: greedy tokens decoded after training, through the KV cache.
    seed: parameter init seed.
  """
  t0 = time.time()
  work = Path(workdir)
  tok = Tokenizer.from_dir(tokenizer_dir) if tokenizer_dir else Tokenizer.qwen2()
  mesh = sharding_lib.make_mesh(fsdp=-1)
  print(
    f"[demo] devices={jax.device_count()} mesh={dict(mesh.shape)} tokenizer vocab={tok.vocab_size}"
  )

  # 1. Policy: load a user checkpoint, or write a random one as HF safetensors and load it back.
  if model_dir is None:
    cfg = model or presets.model_config(name="qwen2-tiny")
    init = transformer.Transformer(cfg, rngs=nnx.Rngs(seed))
    model_dir = str(hf_io.save(init, work / "hf_model"))
    print(
      f"[demo] wrote a random {cfg.model_type} checkpoint ({cfg.num_params() / 1e6:.1f}M params) to {model_dir}"
    )
  policy, cfg = hf_io.load(model_dir, mesh=mesh)
  graphdef, params = nnx.split(policy)
  print(f"[demo] loaded {model_dir}: {cfg.num_layers} layers, hidden {cfg.hidden_size}")

  # 2. Packed scoring of the chats (prompt + response per segment).
  seqs = [_encode(tok, q, r) for q, r in chats]
  shards = mesh.shape["data"] * mesh.shape["fsdp"]  # the batch dim is split over these
  rows = len(pack(seqs, row_len=row_len)[0]["tokens"])
  batch_np, placement = pack(
    seqs, row_len=row_len, num_rows=-(-rows // shards) * shards, pad_id=tok.pad_id
  )
  batch = jax.device_put(
    {k: jnp.asarray(v) for k, v in batch_np.items()}, sharding_lib.batch_sharding(mesh)
  )
  score = steps.compile_score_step(graphdef, params, mesh=mesh)

  def response_nll() -> list[float]:
    lp = np.asarray(score(params, batch, 1.0))
    per_seq = unpack(lp, placement)
    masks = unpack(batch_np["loss_mask"], placement)
    return [float(-(x * m).sum() / m.sum()) for x, m in zip(per_seq, masks, strict=True)]

  before = response_nll()
  print(f"[demo] response NLL per chat before training: {np.round(before, 3).tolist()}")

  # 3. Jitted, sharded AdamW steps; metrics to TensorBoard + JSONL.
  opt = steps.make_optimizer(
    steps.OptimizerConfig(learning_rate=learning_rate, warmup_steps=3, weight_decay=0.0)
  )
  state = steps.init_train_state(params, opt)
  train = steps.compile_train_step(graphdef, opt, steps.nll_loss, state, mesh=mesh)
  writer = MetricWriter(work / "metrics")
  for i in range(train_steps):
    state, metrics = train(state, batch)
    writer.write(i + 1, {"sft/loss": metrics["loss"], "sft/grad_norm": metrics["grad_norm"]})
  writer.close()
  params = state.params
  after = response_nll()
  print(f"[demo] response NLL per chat after {train_steps} steps: {np.round(after, 3).tolist()}")

  # 4. Orbax round trip of the train state and a JSON item (the demo starts its checkpoints fresh
  # so that it can be run again in the same workdir).
  shutil.rmtree(work / "checkpoints", ignore_errors=True)
  with Checkpointer(CheckpointConfig(directory=str(work / "checkpoints"), max_to_keep=2)) as ckpt:
    ckpt.save(train_steps, {"train_state": state, "meta": {"version": train_steps}}, force=True)
    ckpt.wait()
    step, items = ckpt.restore({"train_state": abstract_like(state), "meta": None})
  same = all(
    bool(jnp.array_equal(a, b))
    for a, b in zip(jax.tree.leaves(items["train_state"]), jax.tree.leaves(state), strict=True)
  )
  print(f"[demo] orbax checkpoint step {step} restored identically: {same}")

  # 5. Greedy decoding through prefill + KV cache with the trained policy.
  trained = nnx.merge(graphdef, params)
  prompt = tok.encode_chat([{"role": "user", "content": chats[-1][0]}])
  gen = _greedy(trained, prompt, generate_tokens, max_len=len(prompt) + generate_tokens + 1)
  text = tok.decode(gen)
  print(f"[demo] greedy continuation of {chats[-1][0]!r}: {text!r}")

  summary = {
    "model_dir": model_dir,
    "params_m": round(cfg.num_params() / 1e6, 2),
    "nll_before": round(float(np.mean(before)), 4),
    "nll_after": round(float(np.mean(after)), 4),
    "checkpoint_restored": same,
    "generated": text,
    "seconds": round(time.time() - t0, 1),
  }
  print(json.dumps(summary))
  return summary
