"""Tokenizer against the real Qwen2 vocabulary, with transformers' Qwen2Tokenizer as reference."""

from __future__ import annotations

import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asearcher_jax.errors import TokenizerError
from asearcher_jax.tokenizer import PACKAGED_QWEN2, Tokenizer

TEXTS = [
  "Hello, world!",
  "The Eiffel Tower was completed in 1889; it's 330 m tall.",
  "  leading spaces\n\n\ttabs and\r\nwindows newlines   ",
  "你好，世界！日本語のテキスト。한국어 텍스트",
  "emoji 🤖🔍 and accents: café naïve Ærøskøbing",
  '<search>who directed Inception?</search>\n<information>Doc 1 (Title: "Inception") ...</information>',
  "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n",
  "code: def f(x):\n    return x**2  # ok",
]


@pytest.fixture(scope="module")
def tok():
  return Tokenizer.qwen2()


@pytest.fixture(scope="module")
def reference():
  transformers = pytest.importorskip("transformers")
  return transformers.AutoTokenizer.from_pretrained(str(PACKAGED_QWEN2))


def test_known_ids(tok):
  assert tok.encode("Hello, world!") == [9707, 11, 1879, 0]
  assert tok.encode("12345") == [16, 17, 18, 19, 20]  # digits split one by one
  assert (tok.im_start_id, tok.im_end_id, tok.endoftext_id) == (151644, 151645, 151643)
  assert tok.eos_id == 151645 and tok.pad_id == 151643
  assert tok.vocab_size == 151646
  assert tok.stop_token_ids == (151643, 151645)


@pytest.mark.parametrize("text", TEXTS)
def test_matches_transformers(tok, reference, text):
  assert tok.encode(text) == reference.encode(text, add_special_tokens=False)
  assert tok.decode(tok.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_roundtrip_and_reference_on_arbitrary_text(tok, reference, text):
  ids = tok.encode(text)
  assert ids == reference.encode(text, add_special_tokens=False)
  import unicodedata

  assert tok.decode(ids) == unicodedata.normalize("NFC", text)


def test_chat_format_matches_shipped_template(tok, reference):
  msgs = [{"role": "user", "content": "Who wrote Dune?"}]
  ours = tok.format_chat(msgs)
  assert ours == reference.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
  assert ours.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
  assert ours.endswith("<|im_start|>assistant\n")
  ids = tok.encode_chat(msgs)
  assert ids[0] == tok.im_start_id and ids.count(tok.im_end_id) == 2
  with_sys = tok.format_chat(
    [{"role": "system", "content": "S"}, *msgs], add_generation_prompt=False
  )
  assert (
    with_sys == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nWho wrote Dune?<|im_end|>\n"
  )


def test_tokenizer_json_path_equals_vocab_merges_path(tok, tmp_path):
  tok.backend.save(str(tmp_path / "tokenizer.json"))
  again = Tokenizer.from_dir(tmp_path)
  for text in TEXTS:
    assert again.encode(text) == tok.encode(text)


def test_missing_file_is_one_clear_error(tmp_path):
  shutil.copy(PACKAGED_QWEN2 / "vocab.json", tmp_path / "vocab.json")
  with pytest.raises(TokenizerError, match=r"missing merges\.txt"):
    Tokenizer.from_dir(tmp_path)
  with pytest.raises(TokenizerError, match="does not exist"):
    Tokenizer.from_dir(tmp_path / "nope")
  (tmp_path / "tokenizer.json").write_text("{not json")
  with pytest.raises(TokenizerError, match="cannot parse"):
    Tokenizer.from_dir(tmp_path)


def test_save_then_from_dir_is_the_same_tokenizer(tok, tmp_path):
  out = tok.save(tmp_path / "saved")
  back = Tokenizer.from_dir(out)
  text = "<|im_start|>user\nWho founded Kroril? 1949 ü<|im_end|>"
  assert back.encode(text) == tok.encode(text) and back.vocab_size == tok.vocab_size
  assert (back.eos_id, back.pad_id, back.stop_token_ids) == (
    tok.eos_id,
    tok.pad_id,
    tok.stop_token_ids,
  )
