"""Tokenizer: Hugging Face `tokenizers` for Qwen-family BPE, the ChatML chat format, stop tokens.

Loads `tokenizer.json` when the directory has one, else builds the Qwen2 byte-level BPE from
`vocab.json` + `merges.txt` (the pre-tokenizer regex and normaliser Qwen2 ships). The chat format
is written out here rather than rendered from a Jinja template: agents build contexts by
concatenating token ids, so the exact bytes of every role header must be fixed and testable.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from asearcher_jax.errors import TokenizerError

# Qwen2's pre-tokenization pattern (from its tokenizer.json): digits split one by one.
QWEN2_PATTERN = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
  r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
DEFAULT_SYSTEM = "You are a helpful assistant."
PACKAGED_QWEN2 = Path(__file__).resolve().parent / "assets" / "tokenizers" / "qwen2"


def _build_bpe(vocab_path: Path, merges_path: Path) -> HFTokenizer:
  try:
    vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
    lines = merges_path.read_text(encoding="utf-8").splitlines()
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise TokenizerError(f"cannot read tokenizer files in {vocab_path.parent}: {e}") from e
  merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
  if any(len(m) != 2 for m in merges):
    raise TokenizerError(f"{merges_path} has malformed merge lines (want 'a b' per line)")
  tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False))
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence(
    [
      pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ]
  )
  tok.decoder = decoders.ByteLevel()
  return tok


def _added_tokens(tok_dir: Path) -> dict[str, int]:
  """Special tokens from added_tokens.json or tokenizer_config.json's added_tokens_decoder."""
  out: dict[str, int] = {}
  cfg = tok_dir / "tokenizer_config.json"
  if cfg.is_file():
    decoder = json.loads(cfg.read_text()).get("added_tokens_decoder") or {}
    out.update({v["content"]: int(k) for k, v in decoder.items()})
  added = tok_dir / "added_tokens.json"
  if added.is_file():
    out.update({k: int(v) for k, v in json.loads(added.read_text()).items()})
  return out


class Tokenizer:
  """Encode/decode text and chats; knows the special and stop tokens."""

  def __init__(self, tok: HFTokenizer, *, eos_token: str = IM_END, pad_token: str = ENDOFTEXT):
    self._tok = tok
    self.eos_token = eos_token
    self.eos_id = self._require_id(eos_token)
    self.pad_id = self._require_id(pad_token)
    self.im_start_id = tok.token_to_id(IM_START)
    self.im_end_id = tok.token_to_id(IM_END)
    self.endoftext_id = tok.token_to_id(ENDOFTEXT)

  @classmethod
  def from_dir(cls, path: str | Path) -> Tokenizer:
    """From tokenizer.json, or vocab.json + merges.txt (+ added_tokens.json/tokenizer_config)."""
    tok_dir = Path(path)
    if not tok_dir.is_dir():
      raise TokenizerError(f"tokenizer directory {str(tok_dir)!r} does not exist")
    if (tok_dir / "tokenizer.json").is_file():
      try:
        tok = HFTokenizer.from_file(str(tok_dir / "tokenizer.json"))
      except Exception as e:  # the Rust library raises a bare Exception
        raise TokenizerError(f"cannot parse {tok_dir / 'tokenizer.json'}: {e}") from e
    else:
      missing = [f for f in ("vocab.json", "merges.txt") if not (tok_dir / f).is_file()]
      if missing:
        raise TokenizerError(
          f"tokenizer directory {str(tok_dir)!r} has no tokenizer.json and is missing "
          f"{' and '.join(missing)}"
        )
      tok = _build_bpe(tok_dir / "vocab.json", tok_dir / "merges.txt")
    specials = _added_tokens(tok_dir)
    _add_specials(tok, specials)
    eos, pad = IM_END, ENDOFTEXT
    cfg = tok_dir / "tokenizer_config.json"
    if cfg.is_file():
      conf = json.loads(cfg.read_text())
      eos = _token_text(conf.get("eos_token")) or eos
      pad = _token_text(conf.get("pad_token")) or pad
    return cls(tok, eos_token=eos, pad_token=pad)

  @classmethod
  def qwen2(cls) -> Tokenizer:
    """The Qwen2/Qwen2.5 vocabulary shipped with the package."""
    return cls.from_dir(PACKAGED_QWEN2)

  def _require_id(self, token: str) -> int:
    idx = self._tok.token_to_id(token)
    if idx is None:
      raise TokenizerError(f"special token {token!r} is not in the vocabulary")
    return idx

  @property
  def backend(self) -> HFTokenizer:
    return self._tok

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def stop_token_ids(self) -> tuple[int, ...]:
    """Tokens that end a generation: <|im_end|> and <|endoftext|> (when present)."""
    ids = {self.eos_id, self.im_end_id, self.endoftext_id}
    return tuple(sorted(i for i in ids if i is not None))

  def encode(self, text: str) -> list[int]:
    """Special-token strings in `text` become their single ids (as Qwen's tokenizer does)."""
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
    return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def id_to_token(self, idx: int) -> str | None:
    return self._tok.id_to_token(idx)

  def save(self, directory: str | Path) -> Path:
    """tokenizer.json + tokenizer_config.json (eos/pad), so `from_dir` rebuilds this tokenizer:
    a run directory keeps the vocabulary its token ids are in."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    self._tok.save(str(out / "tokenizer.json"))
    pad = self._tok.id_to_token(self.pad_id)
    conf = {"eos_token": self.eos_token, "pad_token": pad}
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2) + "\n")
    return out

  def format_chat(
    self,
    messages: Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool = True,
    default_system: str | None = DEFAULT_SYSTEM,
  ) -> str:
    """ChatML text: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then an opened
    assistant turn. A default system message is prepended when none is given (Qwen's template
    does the same); pass default_system=None to omit it."""
    parts = []
    if default_system is not None and (not messages or messages[0]["role"] != "system"):
      parts.append(f"{IM_START}system\n{default_system}{IM_END}\n")
    for m in messages:
      if m["role"] not in ("system", "user", "assistant", "tool"):
        raise ValueError(f"unknown chat role {m['role']!r}")
      parts.append(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n")
    if add_generation_prompt:
      parts.append(f"{IM_START}assistant\n")
    return "".join(parts)

  def encode_chat(self, messages: Sequence[Mapping[str, str]], **kwargs) -> list[int]:
    return self.encode(self.format_chat(messages, **kwargs))


def _token_text(value) -> str | None:
  if isinstance(value, dict):
    return value.get("content")
  return value


def _add_specials(tok: HFTokenizer, specials: Mapping[str, int]) -> None:
  from tokenizers import AddedToken

  for text, idx in sorted(specials.items(), key=lambda kv: kv[1]):
    have = tok.token_to_id(text)
    if have is not None:
      if have != idx:
        raise TokenizerError(f"special token {text!r} has id {have}, config says {idx}")
      continue
    if idx != tok.get_vocab_size(with_added_tokens=True):
      raise TokenizerError(f"special token {text!r} id {idx} is not the next free id")
    tok.add_special_tokens([AddedToken(text, special=True, normalized=False)])
