"""Search indexes over passages: BM25 (bm25s, the default) and dense (optional), one interface.

An index directory holds `manifest.json` (backend, settings, corpus checksum), `passages.jsonl`,
`pages.jsonl` and the backend's own files, so a server needs nothing but the directory.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import re
import sys
import time
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
from tqdm.auto import tqdm

from asearcher_jax.tools.retrieval.corpus import CorpusError, PageStore, Passage

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
# (passage index, score) pairs, best first.
Hits = list[tuple[int, float]]


def _import_bm25s() -> Any:
  """Imports bm25s without letting it import jax.

  bm25s imports jax at import time only to pick a top-k backend, and runs an op on it; we do
  top-k in numpy, and keeping jax out of a retrieval-only process saves seconds of start-up and
  a few hundred MB of RSS. When jax is already loaded (the trainer's process) nothing changes.
  """
  if "bm25s" in sys.modules or "jax" in sys.modules:
    import bm25s
  else:
    sys.modules["jax"] = None  # type: ignore[assignment]  # makes `import jax` fail inside bm25s
    try:
      import bm25s
    finally:
      del sys.modules["jax"]
  # bm25s sets its logger to DEBUG at import ("Building index from IDs objects" at every build):
  # let it follow the application's level like every other library, however it was imported.
  logging.getLogger("bm25s").setLevel(logging.NOTSET)
  return bm25s


# The stopword list names bm25s 0.2 accepts (`bm25s.tokenization._infer_stopwords`), checked
# when a config is built: importing bm25s there would run a jax op in processes (the trainer)
# that must not touch a backend before `jax.distributed.initialize`.
STOPWORD_LISTS = (
  "en", "english", "en_plus", "english_plus", "de", "german", "nl", "dutch", "fr", "french",
  "es", "spanish", "pt", "portuguese", "it", "italian", "ru", "russian", "sv", "swedish", "no",
  "norwegian", "zh", "chinese", "tr", "turkish", "ko", "korean", "da", "danish",
)  # fmt: skip


# bm25s's scoring variants (`bm25s.BM25(method=...)`).
Bm25Method = Literal["lucene", "robertson", "atire", "bm25l", "bm25+"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BM25Config:
  """BM25 settings; recorded in the manifest, so queries are tokenized as the corpus was."""

  # PyStemmer language ("english", "german", ...); None indexes unstemmed words.
  stemmer: str | None = "english"
  # bm25s stopword list name ("en", "de", ...); None keeps every word.
  stopwords: str | None = "en"
  # Term-frequency saturation.
  k1: float = 1.5
  # Length normalisation.
  b: float = 0.75
  # bm25s scoring variant: "lucene", "robertson", "atire", "bm25l" or "bm25+".
  method: Bm25Method = "lucene"

  def __post_init__(self):
    import Stemmer

    if self.stemmer is not None and self.stemmer not in Stemmer.algorithms():
      raise ValueError(
        f"stemmer {self.stemmer!r} is not a PyStemmer language ({', '.join(Stemmer.algorithms())})"
      )
    if self.stopwords is not None and self.stopwords not in STOPWORD_LISTS:
      raise ValueError(
        f"stopwords {self.stopwords!r} is not a bm25s stopword list ({', '.join(STOPWORD_LISTS)})"
      )
    if self.method not in typing.get_args(Bm25Method):
      raise ValueError(f"method {self.method!r} is not one of {typing.get_args(Bm25Method)}")


class Retriever(Protocol):
  """What the server needs from an index: batched top-k over passage indices."""

  backend: str

  def search_batch(self, queries: Sequence[str], k: int) -> list[Hits]: ...


_TOKEN_RE = re.compile(r"(?u)\b\w\w+\b")  # bm25s's default splitter


class BM25Retriever:
  """bm25s scores with our own query path (tokenize -> vocab ids -> scores -> numpy top-k).

  Going around `bm25s.BM25.retrieve` keeps per-query overhead to a few hundred microseconds and
  lets an all-unknown-words query return no hits instead of raising.
  """

  backend = "bm25"

  def __init__(self, model: Any, config: BM25Config) -> None:
    self.model = model
    self.config = config
    bm25s = _import_bm25s()
    self._stopwords = frozenset(
      bm25s.tokenization._infer_stopwords(config.stopwords) if config.stopwords else ()
    )
    self._stem = _stemmer(config.stemmer)
    self.num_docs = int(model.scores["num_docs"])

  @classmethod
  def build(
    cls, texts: Sequence[str], config: BM25Config, *, show_progress: bool = True
  ) -> BM25Retriever:
    bm25s = _import_bm25s()
    stemmer = None
    if config.stemmer:
      import Stemmer

      stemmer = Stemmer.Stemmer(config.stemmer)
    tokens = bm25s.tokenize(
      list(texts), stopwords=config.stopwords or None, stemmer=stemmer, show_progress=show_progress
    )
    model = bm25s.BM25(k1=config.k1, b=config.b, method=config.method)
    model.index(tokens, show_progress=show_progress)
    return cls(model, config)

  def save(self, directory: Path) -> None:
    self.model.save(str(directory / "bm25"), show_progress=False)

  @classmethod
  def load(cls, directory: Path, config: BM25Config) -> BM25Retriever:
    bm25s = _import_bm25s()
    model = bm25s.BM25.load(str(directory / "bm25"), load_corpus=False, show_progress=False)
    return cls(model, config)

  def query_token_ids(self, query: str) -> list[int]:
    words = [w for w in _TOKEN_RE.findall(query.lower()) if w not in self._stopwords]
    if self._stem is not None:
      words = self._stem(words)
    vocab = self.model.vocab_dict
    return [vocab[w] for w in words if w in vocab]

  def search_batch(self, queries: Sequence[str], k: int) -> list[Hits]:
    out: list[Hits] = []
    for query in queries:
      ids = self.query_token_ids(query)
      if not ids:
        out.append([])
        continue
      scores = self.model.get_scores_from_ids(ids)
      out.append(_top_k(scores, k))
    return out


def _stemmer(language: str | None) -> Callable[[list[str]], list[str]] | None:
  if not language:
    return None
  import Stemmer

  return Stemmer.Stemmer(language).stemWords


def _top_k(scores: np.ndarray, k: int) -> Hits:
  """Best k positive scores, ties broken by passage order (deterministic across runs)."""
  k = min(k, scores.shape[0])
  if k <= 0:
    return []
  candidates = np.argpartition(-scores, k - 1)[:k] if k < scores.shape[0] else np.arange(k)
  order = sorted(candidates.tolist(), key=lambda i: (-float(scores[i]), i))
  return [(i, float(scores[i])) for i in order if scores[i] > 0]


class Encoder(Protocol):
  """A user-supplied local text encoder for dense retrieval (e.g. an e5 model they host)."""

  def encode(self, texts: Sequence[str], *, kind: str) -> np.ndarray:
    """Returns [len(texts), dim] float embeddings; `kind` is "query" or "passage"."""
    ...


def load_encoder(spec: str) -> Encoder:
  """`"package.module:factory"` -> factory(), so an encoder can be named in gin or a manifest."""
  module_name, _, attr = spec.partition(":")
  if not module_name or not attr:
    raise CorpusError(f"encoder must be given as 'module:factory', got {spec!r}")
  try:
    factory = getattr(importlib.import_module(module_name), attr)
  except (ImportError, AttributeError) as e:
    raise CorpusError(f"cannot load encoder {spec!r}: {e}") from None
  return factory()


def _normalize(x: np.ndarray) -> np.ndarray:
  x = np.asarray(x, dtype=np.float32)
  return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


class DenseRetriever:
  """Inner product over L2-normalised embeddings (ASearcher's e5 + FAISS Flat-IP setup).

  Uses faiss when it is installed and an exact numpy matmul otherwise: both compute the same
  top-k, faiss is only faster on large corpora.
  """

  backend = "dense"

  def __init__(self, embeddings: np.ndarray, encoder: Encoder, *, batch_size: int = 256) -> None:
    self.embeddings = _normalize(embeddings)
    self.encoder = encoder
    self.batch_size = batch_size
    self.num_docs = int(self.embeddings.shape[0])
    self._faiss_index = None
    try:
      import faiss
    except ImportError:
      faiss = None
    if faiss is not None:
      index = faiss.IndexFlatIP(self.embeddings.shape[1])
      index.add(self.embeddings)
      self._faiss_index = index

  @classmethod
  def build(
    cls,
    texts: Sequence[str],
    encoder: Encoder,
    *,
    batch_size: int = 256,
    show_progress: bool = True,
  ) -> DenseRetriever:
    chunks = []
    for start in tqdm(
      range(0, len(texts), batch_size), desc="Encode passages", disable=not show_progress
    ):
      chunks.append(np.asarray(encoder.encode(texts[start : start + batch_size], kind="passage")))
    return cls(np.concatenate(chunks), encoder, batch_size=batch_size)

  def save(self, directory: Path) -> None:
    np.save(directory / "embeddings.npy", self.embeddings)

  @classmethod
  def load(cls, directory: Path, encoder: Encoder) -> DenseRetriever:
    return cls(np.load(directory / "embeddings.npy"), encoder)

  def search_batch(self, queries: Sequence[str], k: int) -> list[Hits]:
    if not queries:
      return []
    q = _normalize(self.encoder.encode(list(queries), kind="query"))
    k = min(k, self.num_docs)
    if self._faiss_index is not None:
      scores, ids = self._faiss_index.search(q, k)
      return [
        [(int(i), float(s)) for i, s in zip(row_i, row_s) if i >= 0]
        for row_i, row_s in zip(ids, scores)
      ]
    sims = q @ self.embeddings.T
    out = []
    for row in sims:
      top = np.argsort(-row, kind="stable")[:k]
      out.append([(int(i), float(row[i])) for i in top])
    return out


@dataclasses.dataclass(frozen=True)
class LoadedIndex:
  """Everything a server needs: the retriever, the passages it indexes, pages and the manifest."""

  retriever: Retriever
  passages: list[Passage]
  pages: PageStore
  manifest: dict[str, Any]


def write_index(
  directory: Path,
  retriever: BM25Retriever | DenseRetriever,
  passages: Sequence[Passage],
  pages: PageStore,
  manifest: dict[str, Any],
) -> None:
  """Writes the index files, then the manifest last (its presence marks a complete index)."""
  directory.mkdir(parents=True, exist_ok=True)
  (directory / MANIFEST).unlink(missing_ok=True)
  with open(directory / "passages.jsonl", "w", encoding="utf-8") as f:
    for p in passages:
      f.write(json.dumps(dataclasses.asdict(p), ensure_ascii=False) + "\n")
  pages.save(directory / "pages.jsonl")
  retriever.save(directory)
  manifest = {"format_version": FORMAT_VERSION, **manifest}
  tmp = directory / (MANIFEST + ".tmp")
  tmp.write_text(json.dumps(manifest, indent=2) + "\n")
  tmp.replace(directory / MANIFEST)


def read_manifest(directory: Path) -> dict[str, Any] | None:
  path = Path(directory) / MANIFEST
  if not path.exists():
    return None
  try:
    return json.loads(path.read_text())
  except (OSError, json.JSONDecodeError) as e:
    raise CorpusError(f"unreadable index manifest {path}: {e}") from None


def load_index(directory: Path, *, encoder: Encoder | None = None) -> LoadedIndex:
  """Loads an index directory written by `write_index`.

  A dense index re-creates its encoder from the manifest's `encoder` spec unless one is passed.
  """
  directory = Path(directory)
  manifest = read_manifest(directory)
  if manifest is None:
    raise CorpusError(f"no index at {directory} (run `asearcher index` first)")
  if manifest.get("format_version") != FORMAT_VERSION:
    raise CorpusError(f"{directory}: index format {manifest.get('format_version')} is unsupported")
  t0 = time.perf_counter()
  passages = []
  with open(directory / "passages.jsonl", encoding="utf-8") as f:
    for line in f:
      passages.append(Passage(**json.loads(line)))
  pages = PageStore.from_file(directory / "pages.jsonl")
  if manifest["backend"] == "bm25":
    retriever: Retriever = BM25Retriever.load(directory, BM25Config(**manifest["bm25"]))
  elif manifest["backend"] == "dense":
    if encoder is None:
      encoder = load_encoder(manifest["encoder"])
    retriever = DenseRetriever.load(directory, encoder)
  else:
    raise CorpusError(f"{directory}: unknown index backend {manifest['backend']!r}")
  if len(passages) != retriever.num_docs:  # type: ignore[attr-defined]
    raise CorpusError(
      f"{directory}: {len(passages)} passages but the index holds a different count"
    )
  manifest = {**manifest, "load_s": round(time.perf_counter() - t0, 3)}
  return LoadedIndex(retriever=retriever, passages=passages, pages=pages, manifest=manifest)


def build_index_dir(
  *,
  corpus: Sequence[Path],
  index_dir: Path,
  backend: str = "bm25",
  bm25: BM25Config = BM25Config(),
  pages_file: Path | None = None,
  encoder: str | None = None,
  force: bool = False,
  show_progress: bool = True,
) -> dict[str, Any]:
  """Builds (or keeps, when corpus checksum and settings match) an index; returns its manifest."""
  from asearcher_jax.tools.retrieval.corpus import corpus_sha256, load_passages

  corpus = [Path(p) for p in corpus]
  for path in [*corpus, *([Path(pages_file)] if pages_file else [])]:
    if not path.exists():
      raise CorpusError(f"corpus file not found: {path}")
  if backend not in ("bm25", "dense"):
    raise CorpusError(f"unknown index backend {backend!r} (expected 'bm25' or 'dense')")
  if backend == "dense" and not encoder:
    raise CorpusError("the dense backend needs an encoder ('module:factory')")
  checksum = corpus_sha256(corpus + ([Path(pages_file)] if pages_file else []))
  settings: dict[str, Any] = {"backend": backend}
  if backend == "bm25":
    settings["bm25"] = dataclasses.asdict(bm25)
  else:
    settings["encoder"] = encoder
  index_dir = Path(index_dir)
  old = read_manifest(index_dir)
  if (
    not force
    and old is not None
    and old.get("format_version") == FORMAT_VERSION
    and old.get("corpus_sha256") == checksum
    and all(old.get(k) == v for k, v in settings.items())
  ):
    return {**old, "reused": True}
  t0 = time.perf_counter()
  passages = load_passages(corpus)
  pages = PageStore.from_file(Path(pages_file)) if pages_file else PageStore.from_passages(passages)
  texts = [p.contents for p in passages]
  if backend == "bm25":
    retriever: BM25Retriever | DenseRetriever = BM25Retriever.build(
      texts, bm25, show_progress=show_progress
    )
  else:
    retriever = DenseRetriever.build(texts, load_encoder(encoder), show_progress=show_progress)
  manifest = {
    **settings,
    "corpus_files": [str(p) for p in corpus],
    "pages_file": str(pages_file) if pages_file else None,
    "corpus_sha256": checksum,
    "num_passages": len(passages),
    "num_pages": len(pages),
    "build_s": round(time.perf_counter() - t0, 3),
    "created_unix": int(time.time()),
  }
  write_index(index_dir, retriever, passages, pages, manifest)
  return {**manifest, "format_version": FORMAT_VERSION, "reused": False}
