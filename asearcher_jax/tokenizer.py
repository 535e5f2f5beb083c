"""Tokenizer: Hugging Face `tokenizers` for Qwen-family BPE, the chat format, stop tokens.

Loads `tokenizer.json` when the directory has one, else builds the Qwen2 byte-level BPE from
`vocab.json` + `merges.txt` (the pre-tokenizer regex and normaliser Qwen2 ships). A model's
chat format is its own: where its tokenizer_config.json has a `chat_template`, a chat is rendered
by that Jinja template as transformers' `apply_chat_template` renders it (QwQ-32B's opens the
assistant turn with `<think>\n` and has no default system prompt; Qwen2.5's has one), so the
policy sees the prompt it was trained on. Without one (the packaged vocabulary, the tiny test
policies) the ChatML written out below is used: agents build later turns by concatenating token
ids, so the exact bytes of every role header must be fixed and testable either way. No agent
re-renders a conversation (search_r1 renders one user turn, reasoning a fresh one-turn chat per
call, asearcher plain text), so QwQ's template dropping the thinking of earlier assistant turns
never breaks a trajectory's prefix; only the OpenAI-compatible server re-renders what a client
sends, and there the template's own semantics are the point.
"""

from __future__ import annotations

import functools
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

  def __init__(
    self,
    tok: HFTokenizer,
    *,
    eos_token: str = IM_END,
    pad_token: str = ENDOFTEXT,
    chat_template: str | None = None,
  ):
    self._tok = tok
    # The model's own Jinja chat template (tokenizer_config.json); None: the ChatML below.
    self.chat_template = chat_template
    self.eos_token = eos_token
    self.eos_id = self._require_id(eos_token)
    self.pad_id = self._require_id(pad_token)
    self.im_start_id = tok.token_to_id(IM_START)
    self.im_end_id = tok.token_to_id(IM_END)
    self.endoftext_id = tok.token_to_id(ENDOFTEXT)

  @classmethod
  def from_dir(cls, path: str | Path, *, chat_template: bool = True) -> Tokenizer:
    """From tokenizer.json, or vocab.json + merges.txt (+ added_tokens.json/tokenizer_config);
    the chat template of tokenizer_config.json unless `chat_template` is False."""
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
    eos, pad, template = IM_END, ENDOFTEXT, None
    cfg = tok_dir / "tokenizer_config.json"
    if cfg.is_file():
      conf = json.loads(cfg.read_text())
      eos = _token_text(conf.get("eos_token")) or eos
      pad = _token_text(conf.get("pad_token")) or pad
      template = _default_template(conf.get("chat_template")) if chat_template else None
    return cls(tok, eos_token=eos, pad_token=pad, chat_template=template)

  @classmethod
  def qwen2(cls) -> Tokenizer:
    """The Qwen2/Qwen2.5 vocabulary shipped with the package (a vocabulary, not a model: the
    ChatML format, which the shipped warm starts were trained on)."""
    return cls.from_dir(PACKAGED_QWEN2, chat_template=False)

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
    if self.chat_template is not None:
      conf["chat_template"] = self.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2) + "\n")
    return out

  def format_chat(
    self,
    messages: Sequence[Mapping[str, str]],
    *,
    add_generation_prompt: bool = True,
    default_system: str | None = DEFAULT_SYSTEM,
  ) -> str:
    """The model's chat template rendered (`render_chat_template`; `default_system` is then the
    template's business), else ChatML text: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per
    message, then an opened assistant turn, a default system message prepended when none is
    given (Qwen2's template does the same; default_system=None omits it)."""
    if self.chat_template is not None:
      return render_chat_template(
        self.chat_template, messages, add_generation_prompt=add_generation_prompt,
        eos_token=self.eos_token,
      )  # fmt: skip
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


def _default_template(value) -> str | None:
  """tokenizer_config.json's chat_template: a string, or a list of named ones ("default")."""
  if isinstance(value, list):
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    value = named.get("default")
  return value if isinstance(value, str) and value.strip() else None


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str):
  """A chat template compiled as transformers compiles it: a sandboxed environment with
  trim_blocks and lstrip_blocks, loop controls, `raise_exception` and a `tojson` filter that
  keeps non-ASCII text."""
  from jinja2.ext import loopcontrols
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  def raise_exception(message: str):
    raise TokenizerError(f"the chat template refused the messages: {message}")

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[loopcontrols])  # fmt: skip
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  return env.from_string(source)


def render_chat_template(
  source: str,
  messages: Sequence[Mapping[str, str]],
  *,
  add_generation_prompt: bool = True,
  eos_token: str = IM_END,
) -> str:
  """A model's Jinja chat template rendered for `messages` (the text transformers'
  `apply_chat_template(..., tokenize=False)` gives)."""
  for m in messages:
    if m["role"] not in ("system", "user", "assistant", "tool"):
      raise ValueError(f"unknown chat role {m['role']!r}")
  return _compiled_template(source).render(
    messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
    eos_token=eos_token, bos_token=None, tools=None,
  )  # fmt: skip


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
