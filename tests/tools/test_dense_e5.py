"""The e5 encoder against transformers' BertModel: weights, tokenizer, pooling, padding buckets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from asearcher_jax.errors import CheckpointError, ConfigValueError
from asearcher_jax.tools.retrieval import e5

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WORDS = [
  "the",
  "a",
  "of",
  "in",
  "what",
  "who",
  "is",
  "was",
  "capital",
  "city",
  "france",
  "paris",
  "river",
  "long",
  "born",
  "year",
  "play",
  "music",
  "film",
  "war",
  "king",
  "queen",
  "state",
  "united",
  "kingdom",
  "germany",
  "berlin",
  "river",
  "nile",
  "longest",
  "world",
]
PIECES = ["##s", "##ed", "##ing", "##er", "##ly", "##e", "##a", "##n"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TEXTS = [
  "What is the capital of France?",
  "paris",
  "The Nile is the longest river in the world; who played music in the war of the kingdom?",
  "Berlin is a city in Germany, capital of the united states? no.",
  "queens played",
]


def _vocab(tmp: Path) -> Path:
  tmp.mkdir(parents=True, exist_ok=True)
  chars = sorted(set("".join(WORDS)) | set("?;,.:"))
  vocab = [*SPECIALS, *dict.fromkeys([*WORDS, "query", "passage", *chars, *PIECES])]
  (tmp / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
  return tmp / "vocab.txt"


def _random_bert(tmp: Path, *, wrapped: bool = False, **overrides) -> Path:
  """A small random BERT saved by transformers (safetensors + tokenizer.json) into `tmp`."""
  vocab_file = _vocab(tmp)
  n_vocab = len(vocab_file.read_text().splitlines())
  cfg = transformers.BertConfig(
    vocab_size=n_vocab,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=64,
    **overrides,
  )
  torch.manual_seed(0)
  cls = transformers.BertForSequenceClassification if wrapped else transformers.BertModel
  model = cls(cfg).eval()
  with torch.no_grad():  # perturb every weight (LayerNorm and biases too) away from its init
    for p in model.parameters():
      p.add_(torch.randn_like(p) * 0.1)
  model.save_pretrained(tmp, safe_serialization=True)
  transformers.BertTokenizerFast.from_pretrained(vocab_file.parent).save_pretrained(tmp)
  return tmp


def _reference(model_dir: Path, texts: list[str], max_length: int) -> np.ndarray:
  """e5's published recipe: transformers tokenizer + BertModel, masked mean pooling, L2 norm."""
  tok = transformers.AutoTokenizer.from_pretrained(model_dir)
  model = transformers.BertModel.from_pretrained(model_dir, add_pooling_layer=False).eval()
  batch = tok(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
  with torch.no_grad():
    hidden = model(**batch).last_hidden_state
  mask = batch["attention_mask"][..., None].bool()
  pooled = hidden.masked_fill(~mask, 0.0).sum(dim=1) / mask.sum(dim=1)
  return torch.nn.functional.normalize(pooled, p=2, dim=1).numpy()


def test_embeddings_match_transformers_across_batches_and_lengths(tmp_path: Path) -> None:
  model_dir = _random_bert(tmp_path)
  tokens = e5.load_tokenizer(model_dir).encode("query: " + TEXTS[0]).ids
  assert 1 not in tokens  # the words are in the vocabulary: no [UNK] (id 1)
  # max_batch=2 splits five texts into chunks; buckets pad each chunk to a different length.
  enc = e5.E5Encoder.from_pretrained(model_dir, e5.E5Config(max_batch=2, length_buckets=(8, 16)))
  for kind, prefix in (("query", "query: "), ("passage", "passage: ")):
    want = _reference(model_dir, [prefix + t for t in TEXTS], enc.max_length)
    got = enc.encode(TEXTS, kind=kind)
    assert got.shape == (len(TEXTS), 32) and got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-4
    # One text alone (batch bucket 1, shortest length bucket) gives the same vector.
    assert np.abs(enc.encode(TEXTS[1:2], kind=kind)[0] - want[1]).max() <= 1e-4
  np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
  # The prefix matters: a query and a passage of the same text are different vectors.
  assert np.abs(enc.encode(TEXTS, kind="query") - got).max() > 1e-3


def test_truncation_matches_transformers(tmp_path: Path) -> None:
  model_dir = _random_bert(tmp_path)
  enc = e5.E5Encoder.from_pretrained(model_dir, e5.E5Config(max_length=12))
  long = " ".join(TEXTS)
  assert len(enc.tokenize([long])[0]) == 12
  want = _reference(model_dir, ["query: " + long, "query: paris"], 12)
  got = enc.encode([long, "paris"], kind="query")
  assert np.abs(got - want).max() <= 1e-4


def test_loads_a_wrapped_checkpoint_and_tanh_gelu(tmp_path: Path) -> None:
  """`bert.`-prefixed task models load (heads ignored); gelu_new is the tanh approximation."""
  model_dir = _random_bert(tmp_path, wrapped=True, hidden_act="gelu_new")
  enc = e5.E5Encoder.from_pretrained(model_dir)
  want = _reference(model_dir, ["query: " + t for t in TEXTS], enc.max_length)
  assert np.abs(enc.encode(TEXTS, kind="query") - want).max() <= 1e-4


def test_vocab_txt_tokenizer_matches_bert_tokenizer_fast(tmp_path: Path) -> None:
  _vocab(tmp_path)
  ours = e5.load_tokenizer(tmp_path)
  ref = transformers.BertTokenizerFast.from_pretrained(tmp_path)
  texts = [*TEXTS, "PARIS, Café naïve", "unknownword played", "query: rivers"]
  got = [e.ids for e in ours.encode_batch(texts)]
  assert got == [ref(t)["input_ids"] for t in texts]
  assert got[-1][1:-1] == [ref.vocab[w] for w in ("query", ":", "river", "##s")]


def test_config_and_checkpoint_errors_name_the_field(tmp_path: Path) -> None:
  with pytest.raises(ConfigValueError, match="num_heads"):
    e5.BertConfig(hidden_size=30, num_heads=4)
  with pytest.raises(ConfigValueError, match="hidden_act"):
    e5.BertConfig(hidden_act="relu")
  with pytest.raises(ConfigValueError, match="max_batch"):
    e5.E5Config(max_batch=0)
  model_dir = _random_bert(tmp_path)
  cfg = json.loads((model_dir / "config.json").read_text())
  (model_dir / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 40}))
  with pytest.raises(CheckpointError, match=r"intermediate\.dense\.\w+' has shape \[48\]"):
    e5.load_bert(model_dir)
  with pytest.raises(CheckpointError, match=r"no config\.json"):
    e5.load_bert(tmp_path / "missing")


@pytest.mark.slow  # jax start-up and a few small compiles
def test_an_index_built_with_the_e5_spec_serves_with_the_same_encoder(tmp_path: Path) -> None:
  """`asearcher index`'s encoder="e5:<dir>": the corpus encoded by the Flax e5 encoder loaded
  from a Hugging Face directory, the manifest naming it, `load_index` re-creating it."""
  pytest.importorskip("faiss")
  from asearcher_jax.tools.retrieval.corpus import CorpusError
  from asearcher_jax.tools.retrieval.index import build_index_dir, load_encoder, load_index

  model_dir = _random_bert(tmp_path / "e5")
  texts = [" ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(3 + i % 4)) for i in range(40)]
  (tmp_path / "c.jsonl").write_text(
    "".join(
      json.dumps({"id": str(i), "contents": f'"T{i}"\n{t}'}) + "\n" for i, t in enumerate(texts)
    )
  )
  spec = f"e5:{model_dir}"
  m = build_index_dir(corpus=[tmp_path / "c.jsonl"], index_dir=tmp_path / "ix", backend="dense",
                      encoder=spec, show_progress=False)  # fmt: skip
  assert m["encoder"] == spec and m["dense_index"]["ntotal"] == 40 and m["dense_index"]["dim"] == 32
  index = load_index(tmp_path / "ix")
  enc = index.retriever.encoder
  assert isinstance(enc, e5.E5Encoder)
  passages = enc.encode([index.passages[i].contents for i in range(40)], kind="passage")
  queries = [texts[3], texts[17]]
  q = enc.encode(queries, kind="query")
  want = np.argsort(-(q @ passages.T), axis=1, kind="stable")[:, :5]
  hits = index.retriever.search_batch(queries, 5)
  assert [[d for d, _ in h] for h in hits] == want.tolist()
  assert isinstance(load_encoder(str(model_dir)), e5.E5Encoder)  # a bare directory works too
  with pytest.raises(CorpusError, match=r"config\.json"):
    load_encoder(f"e5:{tmp_path / 'nothing'}")
