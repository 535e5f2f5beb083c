"""The e5 text encoder (a BERT encoder, mean-pooled and L2-normalised) in Flax NNX.

ASearcher-Local and Search-R1 retrieve over wiki-18 with intfloat/e5-base-v2: a BERT-base encoder
whose embedding of a text is the mean of its last hidden states over the attention mask, L2
normalised, with "query: " or "passage: " put before the text. This module loads that model from a
Hugging Face directory (`config.json`, `*.safetensors`, `tokenizer.json` or `vocab.txt`) and
encodes batches with one jitted call per (batch, length) bucket, so a server compiles a handful of
programs once instead of one per request shape.

Numerics follow transformers' BertModel (absolute position embeddings, post-LN layers, exact erf
GELU, LayerNorm eps from the config) so that embeddings match it to ~1e-6 in float32. The policy's
loader (asearcher_jax.model.hf_io) is not reused: tools must not import the model package, and a
retrieval host has no mesh to shard over.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from asearcher_jax.errors import CheckpointError, ConfigValueError, TokenizerError

_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BertConfig:
  """The BERT encoder's shape; defaults are bert-base (e5-base-v2's)."""

  vocab_size: int = 30522  # word-piece vocabulary size
  hidden_size: int = 768  # width of every hidden state
  num_layers: int = 12  # encoder layers (HF: num_hidden_layers)
  num_heads: int = 12  # attention heads per layer (HF: num_attention_heads)
  intermediate_size: int = 3072  # feed-forward width
  max_position_embeddings: int = 512  # longest input the position table covers
  type_vocab_size: int = 2  # token-type (segment) embeddings; e5 uses type 0 only
  layer_norm_eps: float = 1e-12  # LayerNorm epsilon (BERT's 1e-12)
  hidden_act: Literal["gelu", "gelu_new", "gelu_pytorch_tanh"] = "gelu"  # gelu = exact erf
  dtype: str = "float32"  # compute and parameter dtype

  def __post_init__(self) -> None:
    if self.hidden_size % self.num_heads:
      raise ConfigValueError(
        f"BertConfig.hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}"
      )
    if self.hidden_act not in _ACTIVATIONS:
      raise ConfigValueError(f"BertConfig.hidden_act={self.hidden_act!r}: expected {_ACTIVATIONS}")


def bert_config_from_hf(hf: dict[str, Any], **overrides: Any) -> BertConfig:
  """A BertConfig from a Hugging Face BERT `config.json` dict (BertModel's field names)."""
  position = hf.get("position_embedding_type", "absolute")
  if position != "absolute":
    raise ConfigValueError(f"config.json position_embedding_type={position!r}: only 'absolute'")
  if hf.get("model_type", "bert") not in ("bert", "xlm-roberta", "roberta"):
    raise ConfigValueError(f"config.json model_type={hf.get('model_type')!r}: expected 'bert'")
  if hf.get("model_type") in ("xlm-roberta", "roberta"):
    # RoBERTa offsets positions by padding_idx + 1; not implemented (e5 models are BERT).
    raise ConfigValueError(f"config.json model_type={hf['model_type']!r} is not supported")
  fields = {
    "vocab_size": hf["vocab_size"],
    "hidden_size": hf["hidden_size"],
    "num_layers": hf["num_hidden_layers"],
    "num_heads": hf["num_attention_heads"],
    "intermediate_size": hf["intermediate_size"],
    "max_position_embeddings": hf["max_position_embeddings"],
    "type_vocab_size": hf.get("type_vocab_size", 2),
    "layer_norm_eps": hf.get("layer_norm_eps", 1e-12),
    "hidden_act": hf.get("hidden_act", "gelu"),
  }
  return BertConfig(**{**fields, **overrides})


@dataclasses.dataclass(frozen=True, kw_only=True)
class E5Config:
  """How texts become embeddings; defaults are ASearcher-Local's / Search-R1's e5 settings."""

  query_prefix: str = "query: "  # put before every query (e5's training format)
  passage_prefix: str = "passage: "  # put before every passage
  max_length: int = 256  # tokens kept per text, [CLS] and [SEP] included (Search-R1: 256)
  # padded sequence lengths: each batch pads to the smallest bucket that fits its longest text
  length_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
  max_batch: int = 64  # texts per jitted call; larger inputs run in chunks of this size

  def __post_init__(self) -> None:
    if self.max_length < 2:
      raise ConfigValueError(f"E5Config.max_length={self.max_length}: must be >= 2")
    if self.max_batch < 1:
      raise ConfigValueError(f"E5Config.max_batch={self.max_batch}: must be >= 1")
    if list(self.length_buckets) != sorted(set(self.length_buckets)) or not self.length_buckets:
      raise ConfigValueError(f"E5Config.length_buckets={self.length_buckets}: must be increasing")


class Linear(nnx.Module):
  """y = x @ kernel + bias; kernel stored [in, out] (the transpose of torch's Linear.weight)."""

  def __init__(self, din: int, dout: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
    self.kernel = nnx.Param(jax.nn.initializers.normal(0.02)(rngs.params(), (din, dout), dtype))
    self.bias = nnx.Param(jnp.zeros((dout,), dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    return x @ self.kernel.get_value() + self.bias.get_value()


class LayerNorm(nnx.Module):
  """LayerNorm in float32 (torch's LayerNorm: biased variance, eps inside the square root)."""

  def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype):
    self.scale = nnx.Param(jnp.ones((dim,), dtype))
    self.bias = nnx.Param(jnp.zeros((dim,), dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * self.scale.get_value() + self.bias.get_value()).astype(x.dtype)


class Embeddings(nnx.Module):
  """Word + absolute position + token-type embeddings, then LayerNorm."""

  def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs):
    dt, init = jnp.dtype(cfg.dtype), jax.nn.initializers.normal(0.02)
    self.word = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dt))
    self.position = nnx.Param(
      init(rngs.params(), (cfg.max_position_embeddings, cfg.hidden_size), dt)
    )
    self.token_type = nnx.Param(init(rngs.params(), (cfg.type_vocab_size, cfg.hidden_size), dt))
    self.norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dt)

  def __call__(self, ids: jax.Array) -> jax.Array:
    t = ids.shape[1]
    # e5 feeds one segment: every token type is 0.
    x = self.word.get_value()[ids] + self.position.get_value()[:t][None]
    return self.norm(x + self.token_type.get_value()[0])


class EncoderLayer(nnx.Module):
  """Post-LN BERT layer: x = LN(x + Attn(x)); x = LN(x + FFN(x))."""

  def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs):
    dt, h = jnp.dtype(cfg.dtype), cfg.hidden_size
    self.num_heads = cfg.num_heads
    self.act = cfg.hidden_act
    self.query = Linear(h, h, dtype=dt, rngs=rngs)
    self.key = Linear(h, h, dtype=dt, rngs=rngs)
    self.value = Linear(h, h, dtype=dt, rngs=rngs)
    self.attn_out = Linear(h, h, dtype=dt, rngs=rngs)
    self.attn_norm = LayerNorm(h, eps=cfg.layer_norm_eps, dtype=dt)
    self.intermediate = Linear(h, cfg.intermediate_size, dtype=dt, rngs=rngs)
    self.output = Linear(cfg.intermediate_size, h, dtype=dt, rngs=rngs)
    self.out_norm = LayerNorm(h, eps=cfg.layer_norm_eps, dtype=dt)

  def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
    b, t, h = x.shape
    nh = self.num_heads
    q, k, v = (f(x).reshape(b, t, nh, h // nh) for f in (self.query, self.key, self.value))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(h // nh) + bias
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(x.dtype)
    attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, h)
    x = self.attn_norm(x + self.attn_out(attn))
    ff = jax.nn.gelu(self.intermediate(x), approximate=self.act != "gelu")
    return self.out_norm(x + self.output(ff))


class BertEncoder(nnx.Module):
  """BERT without its pooler: token ids + attention mask -> last hidden states [B, T, H]."""

  def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embeddings = Embeddings(cfg, rngs=rngs)
    self.layers = nnx.List([EncoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])

  def __call__(self, ids: jax.Array, mask: jax.Array) -> jax.Array:
    x = self.embeddings(ids)
    # Padded keys get the dtype's most negative value, as transformers' extended mask does.
    bias = jnp.where(mask[:, None, None, :] > 0, 0.0, jnp.finfo(x.dtype).min).astype(x.dtype)
    for layer in self.layers:
      x = layer(x, bias)
    return x


def mean_pool_normalize(hidden: jax.Array, mask: jax.Array) -> jax.Array:
  """e5's embedding: mean over unmasked tokens, then unit L2 norm (so inner product = cosine)."""
  m = mask.astype(jnp.float32)[..., None]
  pooled = jnp.sum(hidden.astype(jnp.float32) * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
  return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)


# --- Hugging Face checkpoint names ---------------------------------------------------------------

_EMBEDDING_NAMES = {
  "word": "embeddings.word_embeddings.weight",
  "position": "embeddings.position_embeddings.weight",
  "token_type": "embeddings.token_type_embeddings.weight",
}
_LAYER_NAMES = {
  "query": "attention.self.query",
  "key": "attention.self.key",
  "value": "attention.self.value",
  "attn_out": "attention.output.dense",
  "attn_norm": "attention.output.LayerNorm",
  "intermediate": "intermediate.dense",
  "output": "output.dense",
  "out_norm": "output.LayerNorm",
}
# Old TF-converted BERT checkpoints name LayerNorm's parameters gamma/beta.
_LEAF_NAMES = {"kernel": ("weight",), "scale": ("weight", "gamma"), "bias": ("bias", "beta")}


def hf_names(path: tuple[Any, ...]) -> tuple[tuple[str, ...], bool]:
  """(candidate Hugging Face tensor names, needs transpose) for one of our parameter paths."""
  parts = [str(p) for p in path]
  if parts[0] == "embeddings" and parts[1] in _EMBEDDING_NAMES:
    return (_EMBEDDING_NAMES[parts[1]],), False
  if parts[0] == "embeddings":  # ("embeddings", "norm", leaf)
    prefix = "embeddings.LayerNorm"
  else:  # ("layers", i, module, leaf)
    prefix = f"encoder.layer.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
  leaf = parts[-1]
  return tuple(f"{prefix}.{n}" for n in _LEAF_NAMES[leaf]), leaf == "kernel"


def _read_json(path: Path) -> dict[str, Any]:
  try:
    return json.loads(path.read_text())
  except (OSError, json.JSONDecodeError) as e:
    raise CheckpointError(f"cannot read {path}: {e}") from e


def load_bert(model_dir: str | Path, **config_overrides: Any) -> tuple[BertEncoder, BertConfig]:
  """A BertEncoder with the weights of a Hugging Face BERT directory (config.json + safetensors).

  Accepts BertModel checkpoints and task models that wrap one under `bert.`; the pooler and any
  heads are ignored. Raises CheckpointError naming the file or tensor that is missing or wrong.
  """
  model_dir = Path(model_dir)
  if not (model_dir / "config.json").is_file():
    raise CheckpointError(f"no config.json in encoder directory {str(model_dir)!r}")
  cfg = bert_config_from_hf(_read_json(model_dir / "config.json"), **config_overrides)
  files = sorted(model_dir.glob("*.safetensors"))
  if not files:
    raise CheckpointError(f"no *.safetensors files in encoder directory {str(model_dir)!r}")
  where: dict[str, tuple[Any, str]] = {}  # our name (no `bert.` prefix) -> (handle, file name)
  for f in files:
    try:
      h = safe_open(str(f), framework="numpy")
    except (SafetensorError, OSError, ValueError) as e:
      raise CheckpointError(f"corrupt safetensors file {str(f)!r}: {e}") from e
    for name in h.keys():  # noqa: SIM118 (safe_open is not a mapping)
      where[name.removeprefix("bert.")] = (h, name)
  abstract = nnx.eval_shape(lambda: BertEncoder(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  dtype = jnp.dtype(cfg.dtype)
  flat = nnx.to_flat_state(state)
  for path, var in flat:
    names, transpose = hf_names(path)
    name = next((n for n in names if n in where), None)
    if name is None:
      raise CheckpointError(f"{model_dir}: tensor {names[0]!r} is missing")
    want = tuple(var.get_value().shape)
    handle, stored = where[name]
    try:
      value = handle.get_tensor(stored)
    except (SafetensorError, OSError, ValueError) as e:
      raise CheckpointError(f"{model_dir}: cannot read tensor {stored!r}: {e}") from e
    value = value.T if transpose else value
    if tuple(value.shape) != want:
      raise CheckpointError(
        f"{model_dir}: tensor {stored!r} has shape {list(value.T.shape if transpose else value.shape)}"
        f", expected {list(want[::-1] if transpose else want)}"
      )
    var.set_value(jnp.asarray(value, dtype))
  state = nnx.from_flat_state(flat)
  return nnx.merge(graphdef, state), cfg


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
  """The word-piece tokenizer: `tokenizer.json` when present, else built from `vocab.txt`.

  The `vocab.txt` path follows BertTokenizerFast: BERT normaliser (lower-casing unless
  tokenizer_config.json says do_lower_case=false), BERT pre-tokeniser, [CLS] text [SEP].
  """
  model_dir = Path(model_dir)
  if (model_dir / "tokenizer.json").is_file():
    try:
      return Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    except Exception as e:  # tokenizers raises a bare Exception for a malformed file
      raise TokenizerError(f"cannot read {model_dir / 'tokenizer.json'}: {e}") from e
  vocab_path = model_dir / "vocab.txt"
  if not vocab_path.is_file():
    raise TokenizerError(f"no tokenizer.json or vocab.txt in {str(model_dir)!r}")
  vocab = {w: i for i, w in enumerate(vocab_path.read_text(encoding="utf-8").splitlines())}
  for special in ("[CLS]", "[SEP]", "[UNK]"):
    if special not in vocab:
      raise TokenizerError(f"{vocab_path} has no {special} token")
  lower = True
  if (model_dir / "tokenizer_config.json").is_file():
    lower = bool(_read_json(model_dir / "tokenizer_config.json").get("do_lower_case", True))
  tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]", max_input_chars_per_word=100))
  tok.normalizer = normalizers.BertNormalizer(
    clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lower
  )
  tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  tok.post_processor = processors.TemplateProcessing(
    single="[CLS] $A [SEP]",
    pair="[CLS] $A [SEP] $B:1 [SEP]:1",
    special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
  )
  tok.decoder = decoders.WordPiece(prefix="##")
  return tok


def bucket(n: int, buckets: Sequence[int]) -> int:
  """The smallest bucket >= n (the largest bucket when none is)."""
  return next((b for b in buckets if b >= n), buckets[-1])


@functools.partial(jax.jit, static_argnums=0)
def _embed(graphdef: nnx.GraphDef, state: nnx.State, ids: jax.Array, mask: jax.Array) -> jax.Array:
  model = nnx.merge(graphdef, state)
  return mean_pool_normalize(model(ids, mask), mask)


class E5Encoder:
  """Texts -> unit-norm e5 embeddings, batched and bucketed; `encode` is the index's Encoder API."""

  def __init__(self, model: BertEncoder, tokenizer: Tokenizer, cfg: E5Config = E5Config()) -> None:
    self.cfg = cfg
    self.dim = model.cfg.hidden_size
    self.max_length = min(cfg.max_length, model.cfg.max_position_embeddings)
    self._graphdef, self._state = nnx.split(model)
    self._tokenizer = tokenizer
    self._tokenizer.no_padding()
    self._tokenizer.enable_truncation(self.max_length)
    pad = tokenizer.token_to_id("[PAD]")
    self._pad_id = 0 if pad is None else pad
    self._lengths = (*(b for b in cfg.length_buckets if b < self.max_length), self.max_length)
    # Batch buckets: powers of two up to max_batch, so batch 1..max_batch compiles log2 programs.
    self._batches = tuple(
      sorted({min(2**i, cfg.max_batch) for i in range(cfg.max_batch.bit_length() + 1)})
    )

  @classmethod
  def from_pretrained(cls, model_dir: str | Path, cfg: E5Config = E5Config()) -> E5Encoder:
    """Loads weights and tokenizer from one Hugging Face directory (e.g. intfloat/e5-base-v2)."""
    model, _ = load_bert(model_dir)
    return cls(model, load_tokenizer(model_dir), cfg)

  def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in self._tokenizer.encode_batch(list(texts))]

  def encode(self, texts: Sequence[str], *, kind: str) -> np.ndarray:
    """[len(texts), dim] float32 unit vectors; `kind` "query" or "passage" picks e5's prefix."""
    if kind not in ("query", "passage"):
      raise ValueError(f"kind must be 'query' or 'passage', got {kind!r}")
    prefix = self.cfg.query_prefix if kind == "query" else self.cfg.passage_prefix
    out = np.zeros((len(texts), self.dim), np.float32)
    step = self.cfg.max_batch
    for start in range(0, len(texts), step):
      chunk = [prefix + t for t in texts[start : start + step]]
      out[start : start + len(chunk)] = self._encode_ids(self.tokenize(chunk))
    return out

  def _encode_ids(self, rows: list[list[int]]) -> np.ndarray:
    b = bucket(len(rows), self._batches)
    t = bucket(max(len(r) for r in rows), self._lengths)
    ids = np.full((b, t), self._pad_id, np.int32)
    mask = np.zeros((b, t), np.int32)
    for i, r in enumerate(rows):
      ids[i, : len(r)] = r
      mask[i, : len(r)] = 1
    mask[len(rows) :, 0] = 1  # padding rows: one visible token keeps their softmax finite
    emb = _embed(self._graphdef, self._state, jnp.asarray(ids), jnp.asarray(mask))
    return np.asarray(emb)[: len(rows)]
