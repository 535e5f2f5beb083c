"""SFT: loss on generated tokens only, packing-exact, learns, exports, resumes, runs as a command."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from asearcher_jax import main
from asearcher_jax.agent.trajectory import LLMCall, Trajectory
from asearcher_jax.model import hf_io, steps, transformer
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.sft import data as data_lib
from asearcher_jax.sft import sft
from asearcher_jax.tokenizer import Tokenizer

TEXTS = (
  ("Who wrote Hamlet?", "<search>Hamlet author</search>", "Shakespeare wrote it.",
   "<answer>William Shakespeare</answer>"),
  ("Capital of France?", "<search>France capital</search>", "Paris is the capital.",
   "<answer>Paris</answer>"),
  ("Largest planet?", "<search>largest planet</search>", "Jupiter is the largest.",
   "<answer>Jupiter</answer>"),
  ("Boiling point of water?", "<search>water boiling point</search>", "It boils at 100 C.",
   "<answer>100 C</answer>"),
)  # fmt: skip


def tiny_cfg(vocab_size: int, **kw) -> ModelConfig:
  base = dict(
    vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=512,
  )  # fmt: skip
  return ModelConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
  """A byte-level tokenizer with no merges (256 bytes + 3 ChatML specials = 259 ids)."""
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  hf = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  hf.decoder = decoders.ByteLevel()
  hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                         for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])  # fmt: skip
  d = tmp_path_factory.mktemp("tok")
  hf.save(str(d / "tokenizer.json"))
  return d


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
  return Tokenizer.from_dir(tok_dir)


def _call(index: int, input_ids, output_ids) -> LLMCall:
  out = np.asarray(output_ids, np.int32)
  return LLMCall(
    index=index, kind="act", input_ids=np.asarray(input_ids, np.int32), output_ids=out,
    logprobs=np.zeros(out.size, np.float32), versions=np.zeros(out.size, np.int32),
    stop_reason="stop", max_new_tokens=64,
  )  # fmt: skip


def make_trajectory(tok: Tokenizer, question: str, act: str, doc: str, answer: str) -> Trajectory:
  """Two calls merged into one sequence: prompt, act, tool result (not generated), answer."""
  prompt = tok.encode_chat([{"role": "user", "content": question}], default_system=None)
  out1 = [*tok.encode(act), tok.eos_id]
  ctx = prompt + out1 + tok.encode_chat([{"role": "user", "content": doc}], default_system=None)
  out2 = [*tok.encode(answer), tok.eos_id]
  calls = [_call(0, prompt, out1), _call(1, ctx, out2)]
  return Trajectory(agent="expert", question=question, calls=calls, finish_reason="answer")


@pytest.fixture(scope="module")
def trajs(tok) -> list[Trajectory]:
  return [make_trajectory(tok, *t) for t in TEXTS]


def _seqs(trajs, row_len=256):
  per, _ = data_lib.to_sequences(trajs, row_len=row_len)
  return [s for p in per for s in p]


def _params(cfg, seed=0):
  return nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(seed)))


def _batch(seqs, row_len, rows, pad_id=0):
  rows_idx = data_lib.pack_rows(seqs, row_len)
  return {k: jnp.asarray(v) for k, v in
          data_lib.build_batch(seqs, rows_idx, row_len, rows, pad_id).items()}  # fmt: skip


def test_sequences_mask_only_generated_tokens(tok, trajs):
  per, stats = data_lib.to_sequences(trajs, row_len=256)
  assert stats.sequences == len(trajs) and stats.dropped == 0
  s, t = per[0][0], trajs[0]
  n_prompt = t.calls[0].input_ids.size
  assert not s["loss_mask"][:n_prompt].any()
  assert s["loss_mask"].sum() == sum(c.output_ids.size for c in t.calls)
  _, short = data_lib.to_sequences(trajs, row_len=100, long_sequences="drop")
  assert short.sequences == 0 and short.dropped == len(trajs)


def test_loss_counts_only_loss_masked_targets(tok, trajs):
  cfg = tiny_cfg(tok.vocab_size)
  graphdef, params = _params(cfg)
  seq = dict(_seqs(trajs)[0])
  n = len(seq["tokens"])
  # a trailing non-generated tail (e.g. a tool result after the last generation)
  tail = np.asarray(tok.encode(" tool result tail"), np.int32)
  seq = {"tokens": np.concatenate([seq["tokens"], tail]),
         "loss_mask": np.concatenate([seq["loss_mask"], np.zeros(tail.size, np.float32)])}  # fmt: skip
  base = _batch([seq], 256, 1)
  loss_fn = jax.jit(lambda b: sft.sft_loss(graphdef, params, b)[0])
  loss = float(loss_fn(base))
  # the independent path: transformer.score + steps.nll_loss give the same mean
  nll = jax.jit(lambda b: steps.nll_loss(graphdef, params, b)[0])
  assert float(nll(base)) == pytest.approx(loss, abs=1e-6)

  def with_token(i, value):
    return float(loss_fn({**base, "tokens": base["tokens"].at[0, i].set(value)}))

  assert with_token(n + 3, 7) == loss  # a non-generated target: no effect
  gen = int(np.flatnonzero(seq["loss_mask"])[-1])
  assert abs(with_token(gen, (int(seq["tokens"][gen]) + 1) % 256) - loss) > 1e-4


def test_packed_loss_equals_unpacked(tok, trajs):
  cfg = tiny_cfg(tok.vocab_size)
  graphdef, params = _params(cfg, 1)
  seqs = _seqs(trajs)
  stats = jax.jit(lambda b: sft.masked_token_stats(graphdef, params, b))
  packed = stats(_batch(seqs, 512, 2))
  alone = [stats(_batch([s], 256, 1)) for s in seqs]
  nll = sum(float(a["nll"]) for a in alone)
  n = sum(float(a["tokens"]) for a in alone)
  assert float(packed["tokens"]) == n == sum(s["loss_mask"].sum() for s in seqs)
  assert float(packed["nll"]) / n == pytest.approx(nll / n, abs=1e-5)
  assert float(packed["correct"]) == sum(float(a["correct"]) for a in alone)


def _trainer(out_dir, tok, seqs, *, steps_=40, eval_seqs=(), layers=2, model_kw=None,
             lr=3e-3, precision=steps.PrecisionConfig(), **cfg_kw):  # fmt: skip
  cfg = tiny_cfg(tok.vocab_size, num_layers=layers, **(model_kw or {}))
  graphdef, params = _params(cfg)
  config = sft.SFTConfig(
    **{**dict(steps=steps_, row_len=256, rows_per_batch=2, eval_every=0, log_every=5,
              checkpoint_every=0, progress=False), **cfg_kw}
  )  # fmt: skip
  opt = steps.OptimizerConfig(learning_rate=lr, warmup_steps=2, weight_decay=0.0)
  return sft.SFTTrainer(graphdef, params, config=config, train_seqs=seqs, eval_seqs=eval_seqs,
                        optimizer=opt, out_dir=out_dir, pad_id=tok.pad_id,
                        precision=precision)  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tok, trajs):
  out = tmp_path_factory.mktemp("sft")
  seqs = _seqs(trajs)
  trainer = _trainer(out, tok, seqs, eval_seqs=seqs[:1], rows_per_batch=4)
  result = trainer.train()
  yield trainer, result, out
  trainer.close()


@pytest.mark.slow
def test_loss_falls_on_a_memorisable_set(trained):
  _, result, out = trained
  losses = [h["sft/loss"] for h in result.history if "sft/loss" in h]
  assert result.step == 40
  assert losses[-1] < 0.3 * losses[0], losses
  assert result.final["sft/accuracy"] > 0.6
  assert result.final["eval/loss"] < losses[0]  # the eval sequence is one of the train ones
  rows = [json.loads(x) for x in (out / "metrics" / "metrics.jsonl").read_text().splitlines()]
  assert any("sft/loss" in r for r in rows) and any("eval/loss" in r for r in rows)


@pytest.mark.slow
def test_export_reloads_with_identical_logprobs(trained, tok, tok_dir, trajs, tmp_path):
  from asearcher_jax.model.loading import load_policy
  from asearcher_jax.sft import export

  trainer, _, _ = trained
  path = export.export_model(trainer.graphdef, trainer.state.params, tmp_path / "model",
                             tokenizer_dir=tok_dir)  # fmt: skip
  assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
  loaded, cfg = hf_io.load(path)
  assert cfg.vocab_size == tok.vocab_size
  batch = _batch(_seqs(trajs), 512, 2)
  score = jax.jit(steps.score_batch, static_argnums=0)
  want = score(trainer.graphdef, trainer.state.params, batch)
  got = score(*nnx.split(loaded), batch)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
  # what `asearcher train --model_dir` does: weights and tokenizer from the one directory
  _, tokenizer, _ = load_policy(str(path), None, None)
  assert tokenizer.vocab_size == tok.vocab_size


@pytest.mark.slow
def test_resume_continues_from_the_checkpoint(tmp_path, tok, trajs):
  seqs = _seqs(trajs)
  full = _trainer(tmp_path / "a", tok, seqs, steps_=6, checkpoint_every=3, layers=1)
  full.train()
  interrupted = _trainer(tmp_path / "b", tok, seqs, steps_=6, checkpoint_every=3, layers=1)
  part = interrupted.train(until_step=5)  # "killed" after step 5: last checkpoint is step 3
  assert part.step == 5 and interrupted.checkpointer.all_steps() == [3]
  interrupted.close()
  resumed = _trainer(tmp_path / "b", tok, seqs, steps_=6, checkpoint_every=3, layers=1)
  result = resumed.train()
  assert result.start_step == 3 and result.step == 6
  for a, b in zip(jax.tree.leaves(full.state.params), jax.tree.leaves(resumed.state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  for t in (full, resumed):
    t.close()
  done = _trainer(tmp_path / "b", tok, seqs, steps_=6, checkpoint_every=3, layers=1)
  again = done.train()
  done.close()
  assert again.start_step == 6 and again.step == 6  # finished: nothing left to train


@pytest.mark.slow
def test_bf16_policy_trains_on_fp32_master_weights(tmp_path, tok, trajs):
  """A bf16 checkpoint at a small learning rate: pure bf16 (master_dtype=None, the old
  behaviour) rounds nearly every update away; the fp32 master copy keeps them, and the export
  is bf16 again (what was loaded)."""
  seqs, bf16 = _seqs(trajs), {"param_dtype": "bfloat16", "dtype": "bfloat16"}
  runs = {}
  for name, precision in (("mixed", steps.PrecisionConfig()),
                          ("pure", steps.PrecisionConfig(master_dtype=None))):  # fmt: skip
    t = _trainer(tmp_path / name, tok, seqs, steps_=3, layers=1, model_kw=bf16, lr=1e-5,
                 precision=precision)  # fmt: skip
    before = [np.asarray(x, np.float32) for x in jax.tree.leaves(t.export_params())]
    t.train()
    runs[name] = (before, t)
  before, mixed = runs["mixed"]
  assert {x.dtype for x in jax.tree.leaves(mixed.state.params)} == {jnp.dtype("float32")}
  assert {x.dtype for x in jax.tree.leaves(mixed.export_params())} == {jnp.dtype("bfloat16")}
  master = [np.asarray(x) for x in jax.tree.leaves(mixed.state.params)]
  moved = np.mean(np.concatenate([(m != b).ravel() for m, b in zip(master, before)]))
  pure_before, pure = runs["pure"]
  after = [np.asarray(x, np.float32) for x in jax.tree.leaves(pure.state.params)]
  moved_pure = np.mean(np.concatenate([(a != b).ravel() for a, b in zip(after, pure_before)]))
  assert moved > 0.9 and moved_pure < 0.2, (moved, moved_pure)
  for _, t in runs.values():
    t.close()


@pytest.fixture
def fresh_gin():
  """main.main parses gin config into the process-global registry: clear it around each call."""
  import gin

  gin.clear_config()
  yield
  gin.clear_config()


@pytest.mark.slow
def test_sft_command_end_to_end(tmp_path, tok, tok_dir, trajs, fresh_gin):
  data = tmp_path / "expert.jsonl"
  data.write_text("".join(json.dumps(t.to_json()) + "\n" for t in trajs * 2))
  out = tmp_path / "run"
  args = [
    "sft",
    f"--gin_param=TRAJECTORIES='{data}'",
    f"--gin_param=TOKENIZER_DIR='{tok_dir}'",
    f"--gin_param=commands.sft.out_dir='{out}'",
    "--gin_param=sharding.MeshConfig.fsdp=2",  # x tensor 4 over the 8 test devices
    "--gin_param=sharding.MeshConfig.tensor=-1",
    "--gin_param=sft.SFTConfig.steps=4",
    "--gin_param=sft.SFTConfig.row_len=256",
    "--gin_param=sft.SFTConfig.rows_per_batch=2",
    "--gin_param=sft.SFTConfig.eval_fraction=0.25",
    "--gin_param=sft.SFTConfig.checkpoint_every=2",
    "--gin_param=sft.SFTConfig.log_every=2",
    "--gin_param=sft.SFTConfig.progress=False",
    "--gin_param=steps.OptimizerConfig.warmup_steps=1",
    "--gin_param=steps.OptimizerConfig.total_steps=4",
  ]
  assert main.main(args) == 0
  summary = json.loads((out / "sft_summary.json").read_text())
  assert summary["step"] == 4 and summary["start_step"] == 0
  assert summary["data"]["files"][str(data)] == hashlib.sha256(data.read_bytes()).hexdigest()
  assert summary["data"]["trajectories"] == 8 and summary["data"]["eval_trajectories"] == 2
  assert summary["model"]["vocab_size"] == 320  # 259 tokenizer ids, rounded up to 64
  assert {"sft/loss", "sft/accuracy", "eval/loss", "eval/accuracy"} <= set(summary["final"])
  assert "sha256" in (out / "model_card.md").read_text()
  model_dir = out / "model"
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
    p.name for p in model_dir.iterdir()
  }
  _, cfg = hf_io.load(model_dir)
  assert cfg.hidden_size == 192 and cfg.num_layers == 4
  assert (out / "metrics" / "metrics.jsonl").is_file()
  assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit())[-1] == "4"


def test_sft_command_reports_bad_data(tmp_path, tok_dir, capsys, fresh_gin):
  args = ["sft", f"--gin_param=TRAJECTORIES='{tmp_path / 'missing.jsonl'}'",
          f"--gin_param=TOKENIZER_DIR='{tok_dir}'",
          f"--gin_param=commands.sft.out_dir='{tmp_path / 'run'}'"]  # fmt: skip
  assert main.main(args) == 1
  assert "does not exist" in capsys.readouterr().err


def test_config_validation():
  with pytest.raises(ValueError, match="long_sequences"):
    sft.SFTConfig(long_sequences="wrap")
  cfg = dataclasses.replace(sft.SFTConfig(), steps=3)
  assert sft.default_optimizer(cfg.steps).total_steps == 3
