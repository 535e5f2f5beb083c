"""Corpus formats, the page store, index build/reuse and retrieval quality on real data."""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path

import numpy as np
import pytest

from asearcher_jax.errors import AsearcherError
from asearcher_jax.tools.retrieval.corpus import (
  CorpusError,
  PageStore,
  asset_path,
  default_corpus_paths,
  iter_passages,
  load_passages,
  page_key,
  wiki_url,
)
from asearcher_jax.tools.retrieval.dense_index import DenseRetriever
from asearcher_jax.tools.retrieval.index import (
  BM25Config,
  build_index_dir,
  load_index,
  read_manifest,
)


def _write(path: Path, text: str) -> Path:
  path.write_text(text, encoding="utf-8")
  return path


def test_reads_the_three_corpus_formats(tmp_path: Path) -> None:
  wiki18 = _write(
    tmp_path / "wiki.jsonl",
    '{"id": "17", "contents": "\\"Ada Lovelace\\"\\nAda was a mathematician."}\n\n'
    '{"id": "18", "contents": "\\"Bob\\"\\nBob text.", "url": "https://example.org/bob"}\n',
  )
  pairs = _write(tmp_path / "pairs.json", json.dumps([{"title": "Carol", "text": "Carol text."}]))
  hotpot = _write(
    tmp_path / "hotpot.json", json.dumps({"Dave": ["Dave is a name.", " He likes tea."]})
  )
  ps = load_passages([wiki18, pairs, hotpot])
  assert [p.id for p in ps] == ["17", "18", "pairs:0", "hotpot:0"]
  assert ps[0].title == "Ada Lovelace" and ps[0].text == "Ada was a mathematician."
  assert ps[0].contents == '"Ada Lovelace"\nAda was a mathematician.'
  assert (
    ps[0].url
    == wiki_url("Ada Lovelace")
    == ("https://en.wikipedia.org/w/index.php?title=Ada%20Lovelace")
  )
  assert ps[1].url == "https://example.org/bob"
  assert ps[3].text == "Dave is a name. He likes tea."  # HotpotQA sentences keep their spaces
  # Ids are stable: reading again gives the same ids.
  assert [p.id for p in load_passages([wiki18, pairs, hotpot])] == [p.id for p in ps]


def test_gzip_and_shipped_corpus_sizes() -> None:
  counts = {path.name: sum(1 for _ in iter_passages(path)) for path in default_corpus_paths()}
  assert counts == {
    "hipporag_hotpotqa_train100_corpus.json.gz": 994,
    "hipporag_2wikimultihopqa_corpus.json.gz": 6119,
    "flashrag_wiki18_sample1000.jsonl.gz": 1000,
  }


@pytest.mark.parametrize(
  ("name", "text", "message"),
  [
    ("bad.jsonl", '{"id": 1, "contents": "x"}\nnot json\n', "bad.jsonl:2"),
    ("bad.json", '{"x": 3}', "entry 0"),
    ("empty.json", "[]", "no passages"),
    ("odd.json", '"just a string"', "expected a list"),
    ("dup.jsonl", '{"id": 1, "contents": "a"}\n{"id": 1, "contents": "b"}\n', "duplicate"),
  ],
)
def test_bad_corpus_files_are_user_errors(tmp_path: Path, name: str, text: str, message: str):
  path = _write(tmp_path / name, text)
  with pytest.raises(CorpusError, match=message) as info:
    load_passages([path])
  assert isinstance(info.value, AsearcherError)


def test_missing_corpus_file(tmp_path: Path) -> None:
  with pytest.raises(CorpusError, match="not found"):
    build_index_dir(corpus=[tmp_path / "nope.jsonl"], index_dir=tmp_path / "ix")


def test_page_keys_unify_wikipedia_url_spellings() -> None:
  a = wiki_url("Lilu (mythology)")
  variants = [
    a,
    "https://en.wikipedia.org/wiki/Lilu_(mythology)",
    "https://en.wikipedia.org/w/index.php/Lilu_(mythology)",
    "https://en.wikipedia.org/wiki/Lilu_%28mythology%29#History",
    " https://EN.wikipedia.org/wiki/Lilu_(mythology) ",
  ]
  assert len({page_key(v) for v in variants}) == 1
  assert page_key("https://example.org/a/") == page_key("https://example.org/a#x")
  assert page_key("https://example.org/a?b=1") != page_key("https://example.org/a?b=2")


def test_page_store_joins_passages_of_one_url(tmp_path: Path) -> None:
  path = _write(
    tmp_path / "c.jsonl",
    "\n".join(
      json.dumps(r)
      for r in [
        {"id": "1", "contents": '"Tea"\nTea is a drink.'},
        {"id": "2", "contents": '"Tea"\nIt is popular.'},
        {"id": "3", "contents": '"Tea"\nTea is a drink.'},  # a duplicate text is kept once
        {"id": "4", "contents": '"Milk"\nMilk is white.'},
      ]
    ),
  )
  store = PageStore.from_passages(load_passages([path]))
  assert len(store) == 2
  page = store.get("https://en.wikipedia.org/wiki/Tea")
  assert page is not None
  assert page["contents"] == "Tea\n\nTea is a drink.\n\nIt is popular."
  assert store.get("https://en.wikipedia.org/wiki/Coffee") is None


@pytest.mark.parametrize("backend", ["bm25", "tantivy"])
def test_build_records_checksum_reuses_and_rebuilds(tmp_path: Path, backend: str) -> None:
  corpus = _write(tmp_path / "c.json", json.dumps({"Alpha": ["alpha beta"], "Gamma": ["gamma"]}))
  index_dir = tmp_path / "ix"

  def build(**kw):
    return build_index_dir(corpus=[corpus], index_dir=index_dir, backend=backend, **kw,
                           show_progress=False)  # fmt: skip

  m1 = build()
  assert not m1["reused"] and m1["num_passages"] == 2 and len(m1["corpus_sha256"]) == 64
  assert read_manifest(index_dir)["corpus_sha256"] == m1["corpus_sha256"]
  assert m1["backend"] == backend and m1["num_pages"] == 2
  m2 = build()
  assert m2["reused"]
  # Other settings, a changed corpus, or force: rebuilt.
  m3 = build(bm25=BM25Config(stemmer=None))
  assert not m3["reused"]
  _write(corpus, json.dumps({"Alpha": ["alpha beta"], "Delta": ["delta"]}))
  m4 = build()
  assert not m4["reused"] and m4["corpus_sha256"] != m1["corpus_sha256"]
  ix = load_index(index_dir)
  assert [ix.passages[i].title for i, _ in ix.retriever.search_batch(["delta"], 5)[0]] == ["Delta"]
  assert not build(force=True)["reused"]


def _query_terms(retriever, query: str) -> list:
  if retriever.backend == "tantivy":
    return retriever.query_terms(query)
  return retriever.query_token_ids(query)


def test_bm25_stemming_stopwords_and_unknown_words(backend_index) -> None:
  shipped_index = backend_index
  r = shipped_index.retriever
  # Stemming: "demons algorithms" finds "Demon algorithm"; stopwords add nothing.
  assert _query_terms(r, "demons") == _query_terms(r, "the demon") != []
  hits = r.search_batch(["demons algorithms"], 3)[0]
  assert shipped_index.passages[hits[0][0]].title == "Demon algorithm"
  # Only stopwords or unknown words: no hits rather than an error or random documents.
  assert r.search_batch(["the of and", "qqqzzzxxyy", ""], 5) == [[], [], []]
  scores = [s for _, s in r.search_batch(["Lothair II queen"], 10)[0]]
  assert scores == sorted(scores, reverse=True) and all(s > 0 for s in scores)


def test_retrieval_quality_on_hotpotqa_100(backend_index) -> None:
  """One BM25 search with the raw question finds >= 0.70 of the gold titles in the top 5."""
  shipped_index = backend_index
  with gzip.open(asset_path("qa/hipporag_hotpotqa_train100.json.gz"), "rt") as f:
    questions = json.load(f)
  assert len(questions) == 100
  hits = shipped_index.retriever.search_batch([q["question"] for q in questions], 5)
  recalls = []
  for q, h in zip(questions, hits, strict=True):
    gold = {title for title, _ in q["supporting_facts"]}
    found = {shipped_index.passages[i].title for i, _ in h}
    recalls.append(len(gold & found) / len(gold))
  recall = float(np.mean(recalls))
  backend = shipped_index.retriever.backend
  print(f"HotpotQA-100 gold-title recall@5 with the raw question ({backend}): {recall:.3f}")
  assert recall >= 0.70


class HashingEncoder:
  """A deterministic bag-of-words encoder: enough to test the dense path end to end. (crc32, not
  `hash()`: Python salts str hashes per process, so collisions would change from run to run.)"""

  def __init__(self, dim: int = 512) -> None:
    self.dim = dim

  def encode(self, texts, *, kind: str) -> np.ndarray:
    out = np.zeros((len(texts), self.dim), np.float32)
    for row, text in enumerate(texts):
      for word in text.lower().split():
        out[row, zlib.crc32(word.strip('".,()').encode()) % self.dim] += 1.0
    return out


def make_hashing_encoder() -> HashingEncoder:
  return HashingEncoder()


def test_dense_backend_behind_the_same_interface(tmp_path: Path) -> None:
  corpus = _write(
    tmp_path / "c.json",
    json.dumps({"Apple": ["apple fruit red"], "Car": ["car engine wheel"], "Sky": ["sky blue"]}),
  )
  spec = f"{__name__}:make_hashing_encoder"
  manifest = build_index_dir(
    corpus=[corpus], index_dir=tmp_path / "dense", backend="dense", encoder=spec
  )
  assert manifest["backend"] == "dense" and manifest["encoder"] == spec
  ix = load_index(tmp_path / "dense")  # re-creates the encoder from the manifest
  assert isinstance(ix.retriever, DenseRetriever) and ix.retriever.index.kind == "flat"
  assert manifest["dense_index"]["ntotal"] == 3 and manifest["dense"]["kind"] == "flat"
  hits = ix.retriever.search_batch(["engine wheel", "blue sky"], 2)
  assert [ix.passages[h[0][0]].title for h in hits] == ["Car", "Sky"]
  assert hits[0][0][1] == pytest.approx(2 / np.sqrt(2 * 6), rel=1e-5)  # cosine: "car" twice (title)
  with pytest.raises(CorpusError, match="encoder"):
    build_index_dir(corpus=[corpus], index_dir=tmp_path / "d2", backend="dense")
