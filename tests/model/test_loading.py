"""A Hugging Face checkpoint computes as the program is configured to (model/loading.py): its
config.json gives the architecture and dtypes, the configured model the remat, scan and
attention that `asearcher compile` and the launch rehearsal compile with."""

from __future__ import annotations

import logging

from flax import nnx

from asearcher_jax.model import hf_io, loading, presets, transformer


def _checkpoint(tmp_path):
  cfg = presets.model_config(name="qwen2-tiny")
  hf_io.save(transformer.Transformer(cfg, rngs=nnx.Rngs(0)), tmp_path / "ckpt")
  return cfg, str(tmp_path / "ckpt")


def test_the_configured_remat_and_attention_reach_a_loaded_checkpoint(tmp_path):
  cfg, ckpt = _checkpoint(tmp_path)
  alone = loading.resolve_config(ckpt, None)
  assert alone.remat_policy == "dots_saveable"  # config.json says nothing of it: the default
  knobs = cfg.replace(remat_policy="full", attention="dense", logits_chunk=64, scan_layers=False)
  resolved = loading.resolve_config(ckpt, knobs)
  assert (resolved.remat_policy, resolved.attention, resolved.logits_chunk) == ("full", "dense", 64)
  assert not resolved.scan_layers
  assert resolved.num_layers == cfg.num_layers and resolved.dtype == alone.dtype
  policy, _, _ = loading.load_policy(ckpt, knobs, None)
  assert policy.cfg == resolved  # what load_policy builds is what the rehearsal compiles


def test_a_checkpoint_of_another_architecture_wins_and_is_logged(tmp_path, caplog):
  _, ckpt = _checkpoint(tmp_path)
  other = presets.model_config(name="qwen2.5-7b", remat_policy="full")
  with caplog.at_level(logging.INFO, logger=loading.__name__):
    resolved = loading.resolve_config(ckpt, other)
  assert resolved.hidden_size != other.hidden_size and resolved.remat_policy == "full"
  assert "is not the configured model's architecture (vocab_size" in caplog.text
