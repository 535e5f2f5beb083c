"""A model's own chat template (tokenizer_config.json) renders as transformers renders it: the
shipped Qwen2.5 and QwQ-32B templates over the shipped Qwen2 vocabulary give the token ids of
`apply_chat_template` (offline, from the same files)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from asearcher_jax.tokenizer import PACKAGED_QWEN2, Tokenizer

MODELS = Path(__file__).resolve().parents[2] / "asearcher_jax" / "assets" / "models"
CHATS = [
  [{"role": "user", "content": "Who wrote The Remains of the Day?"}],
  [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Capital of Perú?"},
  ],
  [
    {"role": "user", "content": "When was the bridge built?"},
    {"role": "assistant", "content": "<think>\nsearch first\n</think>\n\n<search>bridge</search>"},
    {"role": "user", "content": "<information>1932</information>"},
  ],
  [
    {"role": "user", "content": "q"},
    {"role": "assistant", "content": "a"},
    {"role": "tool", "content": "r1"},
    {"role": "tool", "content": "r2"},
  ],
  [
    {"role": "user", "content": "q"},
    {"role": "assistant", "content": "<think>\nfirst\n</think>\n\n<search>a</search>"},
    {"role": "user", "content": "<information>b</information>"},
    {"role": "assistant", "content": "<think>\nsecond\n</think>\n\n<answer>b</answer>"},
  ],
]


def _model_dir(tmp_path: Path, model: str) -> Path:
  """The shipped Qwen2 vocabulary with the model's own tokenizer_config.json beside it."""
  out = tmp_path / model
  out.mkdir()
  for f in ("vocab.json", "merges.txt", "added_tokens.json"):
    shutil.copy(PACKAGED_QWEN2 / f, out / f)
  shutil.copy(MODELS / model / "tokenizer_config.json", out / "tokenizer_config.json")
  return out


@pytest.mark.parametrize("model", ["qwen2_5_7b_instruct", "qwq_32b"])
def test_the_models_chat_template_gives_transformers_token_ids(tmp_path, model):
  transformers = pytest.importorskip("transformers")
  d = _model_dir(tmp_path, model)
  ours = Tokenizer.from_dir(d)
  assert ours.chat_template is not None
  theirs = transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True)
  for chat in CHATS:
    want = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours.format_chat(chat) == want
    ids = theirs.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ours.encode_chat(chat) == list(ids)


def test_qwq_opens_its_thinking_and_qwen25_keeps_its_system_prompt(tmp_path):
  """What the hand-built ChatML got wrong for QwQ-32B: no default system prompt, and the
  assistant turn opened with <think>; Qwen2.5 keeps its own default system prompt."""
  user = [{"role": "user", "content": "q"}]
  qwq = Tokenizer.from_dir(_model_dir(tmp_path, "qwq_32b")).format_chat(user)
  assert qwq == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\n"
  qwen = Tokenizer.from_dir(_model_dir(tmp_path, "qwen2_5_7b_instruct")).format_chat(user)
  assert qwen.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
  # The packaged vocabulary is no model: ChatML, as the shipped warm starts were trained on.
  assert Tokenizer.qwen2().chat_template is None
  assert (
    Tokenizer.qwen2()
    .format_chat(user)
    .startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
  )


def test_qwq_strips_thinking_from_earlier_assistant_turns_only(tmp_path):
  """QwQ-32B's own template (llama.cpp's verbatim copy) keeps the last assistant turn whole and
  drops the thinking of earlier ones; a template that strips every turn renders other text."""
  tok = Tokenizer.from_dir(_model_dir(tmp_path, "qwq_32b"))
  text = tok.format_chat(CHATS[-1], add_generation_prompt=False)
  assert text == (
    "<|im_start|>user\nq<|im_end|>\n"
    "<|im_start|>assistant\n<search>a</search><|im_end|>\n"
    "<|im_start|>user\n<information>b</information><|im_end|>\n"
    "<|im_start|>assistant\n<think>\nsecond\n</think>\n\n<answer>b</answer><|im_end|>\n"
  )
