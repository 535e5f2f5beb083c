"""Parity with transformers' own Qwen2/Qwen3 (a reference implementation no one here wrote)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax.numpy as jnp

from asearcher_jax.model import hf_io
from tests.model.hf_fixtures import torch_logits, write_tiny_hf

IDS = np.array(
  [[3, 17, 42, 8, 96, 1, 55, 23, 0, 64, 12, 7], [5, 5, 9, 88, 31, 2, 40, 76, 61, 14, 3, 90]]
)


@pytest.mark.slow
@pytest.mark.parametrize(
  "model_type,kw",
  [
    ("qwen2", {}),
    ("qwen2", {"tie_word_embeddings": True}),
    ("qwen3", {}),
    ("qwen3", {"tie_word_embeddings": True}),
    ("qwen2", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
  ],
)
def test_logits_match_transformers(tmp_path, model_type, kw):
  path, ref = write_tiny_hf(tmp_path, model_type, **kw)
  model, cfg = hf_io.load(path)
  assert cfg.model_type == model_type
  assert cfg.tie_word_embeddings == kw.get("tie_word_embeddings", False)
  ours = np.asarray(model(jnp.asarray(IDS)))
  want = torch_logits(ref, IDS)
  assert ours.shape == want.shape
  np.testing.assert_allclose(ours, want, atol=1e-4, rtol=0)
  # Dense attention in 3 query blocks of 4, and flash in blocks of 4, compute the same logits.
  for overrides in ({"attention": "dense", "attention_block": 4}, {"attention": "flash",
                                                                   "flash_block": 4}):  # fmt: skip
    blocked, _ = hf_io.load(path, config_overrides=overrides)
    np.testing.assert_allclose(np.asarray(blocked(jnp.asarray(IDS))), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_save_roundtrip_loads_in_transformers(tmp_path, model_type):
  import transformers

  path, ref = write_tiny_hf(tmp_path, model_type, seed=1)
  model, _ = hf_io.load(path)
  out = hf_io.save(model, tmp_path / "ours")
  back = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
  np.testing.assert_allclose(torch_logits(back, IDS), torch_logits(ref, IDS), atol=1e-5, rtol=0)
  again, _ = hf_io.load(out)
  np.testing.assert_allclose(
    np.asarray(again(jnp.asarray(IDS))), np.asarray(model(jnp.asarray(IDS))), atol=1e-6
  )


def test_sharded_save_writes_index_and_reloads(tmp_path):
  path, ref = write_tiny_hf(tmp_path, "qwen2", seed=2)
  model, _ = hf_io.load(path)
  out = hf_io.save(model, tmp_path / "sharded", max_shard_bytes=20_000)
  shards = sorted(p.name for p in out.glob("*.safetensors"))
  assert len(shards) > 2 and (out / hf_io.INDEX_FILE).is_file()
  again, _ = hf_io.load(out)
  np.testing.assert_allclose(np.asarray(again(jnp.asarray(IDS))), torch_logits(ref, IDS), atol=1e-4)
