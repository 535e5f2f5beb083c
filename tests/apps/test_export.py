"""`asearcher export`: a checkpoint's parameters, exactly, as a Hugging Face model directory that
loads back (ours and transformers' names and layouts), from a real quickstart run and from a
hand-made train state; every mistake is one line naming what to fix."""

from __future__ import annotations

import json
import shutil

import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx, traverse_util
from safetensors.numpy import load_file

from asearcher_jax.apps import export as export_lib
from asearcher_jax.apps.train import POLICY_CONFIG
from asearcher_jax.checkpoint import CheckpointConfig, Checkpointer
from asearcher_jax.errors import AsearcherError
from asearcher_jax.model import hf_io, presets
from asearcher_jax.model.config import to_hf_config
from asearcher_jax.model.steps import init_train_state
from asearcher_jax.model.transformer import Transformer
from asearcher_jax.tokenizer import Tokenizer


def _checkpoint_params(train_state_dir) -> dict[tuple, np.ndarray]:
  """An independent read: the whole train state restored without a target (nested dicts); a
  learner's stacked layers (leading layer axis under "stacked_layers") cut into layers here."""
  raw = ocp.StandardCheckpointer().restore(train_state_dir.resolve())
  flat = traverse_util.flatten_dict(raw["params"])
  assert all(p[-1] == "value" for p in flat)
  out = {}
  for p, v in flat.items():
    path = tuple(int(k) if k.isdigit() else k for k in p[:-1])
    if path[0] == "stacked_layers":
      for i, layer in enumerate(np.asarray(v)):
        out[("layers", i, *path[1:])] = layer
    else:
      out[path] = np.asarray(v)
  return out


def _assert_exported(out, params: dict[tuple, np.ndarray], dtype=np.float32) -> None:
  tensors = load_file(str(out / "model.safetensors"))
  assert len(tensors) == len(params)
  for path, value in params.items():
    name, transpose = hf_io.hf_name(path)
    assert tensors[name].dtype == dtype, name
    want = (value.T if transpose else value).astype(dtype)
    np.testing.assert_array_equal(tensors[name], want, err_msg=name)


@pytest.mark.slow
def test_export_of_the_quickstart_run_is_its_newest_checkpoint(tiny_run, tmp_path):
  rl = tiny_run / "quickstart" / "rl"
  # The run wrote the policy's config when it started (what the export needs besides weights).
  assert json.loads((rl / POLICY_CONFIG).read_text())["model_type"] == "qwen2"
  out = tmp_path / "hf"
  # The quickstart's root is accepted: its rl/ holds the checkpoints.
  assert export_lib.export(run_dir=str(tiny_run / "quickstart"), out_dir=str(out)) == 0
  steps = sorted(int(p.name) for p in (rl / "checkpoints").iterdir() if p.name.isdigit())
  record = json.loads((out / export_lib.EXPORTED_FROM).read_text())
  assert record["step"] == record["version"] == steps[-1] >= 1
  params = _checkpoint_params(rl / "checkpoints" / str(steps[-1]) / "train_state")
  _assert_exported(out, params)
  # It loads as a model directory, speaks the run's tokenizer, and is not the warm start: RL
  # moved the weights.
  model, cfg = hf_io.load(out)
  assert cfg == model.cfg and Tokenizer.from_dir(out).vocab_size <= cfg.vocab_size  # padded
  assert (out / "tokenizer.json").read_bytes() == (rl / "tokenizer" / "tokenizer.json").read_bytes()
  warm = json.loads((tiny_run / "quickstart" / "report" / "summary.json").read_text())["warm_start"]
  before = load_file(str(hf_io.Path(warm) / "model.safetensors"))
  after = load_file(str(out / "model.safetensors"))
  assert before.keys() == after.keys()
  assert any(not np.array_equal(before[k], after[k]) for k in after)


@pytest.fixture
def hand_made_run(tmp_path):
  """A run directory as `asearcher train` leaves it: a train state (parameters and Adam's
  state) at steps 3 and 5, the tokenizer, the policy config."""
  cfg = presets.model_config(name="qwen3-tiny", vocab_size=256)
  run = tmp_path / "run"
  Tokenizer.qwen2().save(run / "tokenizer")
  (run / POLICY_CONFIG).write_text(json.dumps(to_hf_config(cfg)))
  with Checkpointer(CheckpointConfig(directory=str(run / "checkpoints"), async_save=False)) as ck:
    for step in (3, 5):
      _, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(step)))
      ck.save(step, {"train_state": init_train_state(params, optax.adam(1e-3)),
                     "meta": {"version": step}}, force=True)  # fmt: skip
  return run, cfg


@pytest.mark.slow
def test_export_any_step_in_any_dtype_and_each_mistake_is_one_line(hand_made_run, tmp_path):
  run, cfg = hand_made_run
  assert export_lib.export(run_dir=str(run), step=3) == 0  # default place: run/export/step_3
  _assert_exported(run / "export" / "step_3", _checkpoint_params(run / "checkpoints/3/train_state"))
  out = tmp_path / "bf16"
  assert export_lib.main([str(run), str(out), "--dtype", "bfloat16"]) == 0  # newest: 5
  assert json.loads((out / export_lib.EXPORTED_FROM).read_text())["step"] == 5
  _, loaded_cfg = hf_io.load(out)
  assert loaded_cfg.param_dtype == "bfloat16"
  _assert_exported(out, _checkpoint_params(run / "checkpoints/5/train_state"), np.dtype("bfloat16"))

  assert export_lib.main([str(run), str(out), "--step", "3"]) == 0  # over an earlier export
  assert json.loads((out / export_lib.EXPORTED_FROM).read_text())["step"] == 3
  with pytest.raises(AsearcherError, match="not an earlier export"):  # a model of the user's
    export_lib.export(run_dir=str(run), out_dir=str(run / "tokenizer"))
  assert (run / "tokenizer" / "tokenizer.json").is_file()  # untouched
  a_file = run / "tokenizer" / "tokenizer.json"
  for where in (a_file, a_file / "hf"):  # a file, or a directory under one
    with pytest.raises(AsearcherError, match=r"tokenizer\.json' is a file, so .* nothing was"):
      export_lib.export(run_dir=str(run), out_dir=str(where))
  assert export_lib.main([str(run), str(a_file)]) == 2  # the command: one line, exit 2
  bad_out = tmp_path / "bad_dtype"
  assert export_lib.main([str(run), str(bad_out), "--dtype", "bfloat17"]) == 2
  assert not bad_out.exists()  # refused before the checkpoint is read or anything written
  assert a_file.is_file() and json.loads(a_file.read_text())  # untouched
  with pytest.raises(AsearcherError, match=r"no checkpoint for step 4 .* it has \[3, 5\]"):
    export_lib.export(run_dir=str(run), step=4)
  with pytest.raises(AsearcherError, match="not an RL run"):
    export_lib.export(run_dir=str(tmp_path / "nowhere"))
  # A run older than policy_config.json names the model it started from.
  (run / POLICY_CONFIG).write_text('{"model_type": "qwen2"}')  # torn or hand-edited
  with pytest.raises(AsearcherError, match=r"policy_config.json: not a model config .*vocab_size"):
    export_lib.export(run_dir=str(run))
  (run / POLICY_CONFIG).unlink()
  with pytest.raises(AsearcherError, match=r"set export\.model_dir"):
    export_lib.export(run_dir=str(run))
  same = tmp_path / "same_model"
  hf_io.save(Transformer(cfg, rngs=nnx.Rngs(0)), same)
  assert export_lib.export(run_dir=str(run), out_dir=str(tmp_path / "via_model_dir"),
                           model_dir=str(same)) == 0  # fmt: skip
  _assert_exported(
    tmp_path / "via_model_dir", _checkpoint_params(run / "checkpoints/5/train_state")
  )
  other = tmp_path / "other_model"
  hf_io.save(Transformer(cfg.replace(hidden_size=32), rngs=nnx.Rngs(0)), other)
  with pytest.raises(
    AsearcherError, match=r"embed_tokens has shape \(256, 64\), the policy config says \(256, 32\)"
  ):
    export_lib.export(run_dir=str(run), model_dir=str(other))
  shutil.rmtree(run / "tokenizer")
  with pytest.raises(AsearcherError, match="no tokenizer"):
    export_lib.export(run_dir=str(run), model_dir=str(same))
