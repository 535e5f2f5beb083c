"""Search indexes over passages: BM25 (bm25s, the default; tantivy for large corpora), dense
(an encoder over faiss) and hybrid (both, fused by reciprocal rank), one interface.

A backend is a small class with `search_batch(queries, k) -> [Hits]` over passage indices and a
`num_docs`; the passages and pages it serves are reached by index (`LoadedIndex.passages[i]`) and
by URL (`LoadedIndex.pages.get(url)`), in memory for bm25s and dense, on disk for tantivy.
An index directory holds `manifest.json` (backend, settings, corpus checksum) and the backend's
files: `passages.jsonl` + `pages.jsonl` + its arrays for bm25s (small corpora, loaded into
memory), the tantivy index directories for tantivy (memory-mapped, the corpus streamed in), and
for dense `dense/` (`dense_index`'s faiss files) or, instead, the path of a faiss file built
elsewhere (Search-R1's e5_Flat.index: row i is passage i), so a server needs nothing but the
directory (and the encoder the manifest names).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib
import itertools
import json
import re
import time
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from asearcher_jax import storage
from asearcher_jax.tools.retrieval.corpus import CorpusError, PageStore, Passage
from asearcher_jax.tools.retrieval.dense_index import (
  DenseIndex,
  DenseIndexConfig,
  DenseRetriever,
  Encoder,
  HybridConfig,
  HybridRetriever,
)
from asearcher_jax.tools.retrieval.tantivy_index import (
  PAGES_DIR,
  PASSAGES_DIR,
  TantivyConfig,
  TantivyPages,
  TantivyPassages,
  TantivyRetriever,
  _import_bm25s,
)

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
# (passage index, score) pairs, best first.
Hits = list[tuple[int, float]]


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


# The index backends `build_index_dir` knows: bm25s in memory (small corpora, the default),
# tantivy on disk (large corpora), dense (an encoder + a faiss index, built here or prebuilt) and
# hybrid (dense and BM25 fused by reciprocal rank).
BACKENDS = ("bm25", "tantivy", "dense", "hybrid")
# Where a dense (or hybrid) index directory keeps its faiss files (`dense_index` layout).
DENSE_DIR = "dense"
# A search hit with its document row (`Passage.to_row()`), as the server returns it.
RowHits = list[tuple[dict[str, str], float]]


class Retriever(Protocol):
  """What the server needs from an index: batched top-k over passage indices. Several threads
  may call `search_batch` at once (the server's workers)."""

  backend: str
  num_docs: int

  def search_batch(self, queries: Sequence[str], k: int) -> list[Hits]: ...


class Passages(Protocol):
  """Passages by corpus position (a list for in-memory backends, stored fields for tantivy)."""

  def __len__(self) -> int: ...

  def __getitem__(self, i: int) -> Passage: ...


class Pages(Protocol):
  """Whole pages by URL (any spelling `corpus.page_key` unifies)."""

  def __len__(self) -> int: ...

  def get(self, url: str) -> dict[str, str] | None: ...


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


def load_encoder(spec: str) -> Encoder:
  """An encoder named in gin or a manifest: `"e5:<dir>"` (or a bare directory holding a Hugging
  Face e5/BERT model) loads `e5.E5Encoder` from it; `"package.module:factory"` -> factory()."""
  prefix, _, rest = spec.partition(":")
  if prefix == "e5" and rest.startswith("gs://"):
    rest = storage.local_copy(rest, what="encoder")
  if prefix == "e5" or (Path(spec).is_dir() and (Path(spec) / "config.json").is_file()):
    model_dir = Path(rest if prefix == "e5" else spec)
    if not (model_dir / "config.json").is_file():
      raise CorpusError(f"encoder {spec!r}: no Hugging Face model (config.json) in {model_dir}")
    from asearcher_jax.tools.retrieval import e5  # jax and flax: only for an e5 index

    return e5.E5Encoder.from_pretrained(model_dir)
  module_name, attr = prefix, rest
  if not module_name or not attr:
    raise CorpusError(
      f"encoder must be given as 'e5:<model dir>' or 'module:factory', got {spec!r}"
    )
  try:
    factory = getattr(importlib.import_module(module_name), attr)
  except (ImportError, AttributeError) as e:
    raise CorpusError(f"cannot load encoder {spec!r}: {e}") from None
  return factory()


@dataclasses.dataclass(frozen=True)
class LoadedIndex:
  """Everything a server needs: the retriever, the passages it indexes, pages and the manifest."""

  retriever: Retriever
  passages: Passages
  pages: Pages
  manifest: dict[str, Any]
  # The index directory it was loaded from (process workers load their own copy from it).
  directory: Path | None = None

  def search_rows(self, queries: Sequence[str], k: int) -> list[RowHits]:
    """Top-k documents with scores for each query: the retriever's own pass when it reads
    documents as it searches (tantivy), else its hits looked up in `passages`."""
    direct = getattr(self.retriever, "search_rows", None)
    if direct is not None:
      return direct(queries, k)
    hits = self.retriever.search_batch(queries, k)
    return [[(self.passages[i].to_row(), s) for i, s in h] for h in hits]


def read_manifest(directory: Path) -> dict[str, Any] | None:
  path = Path(directory) / MANIFEST
  if not path.exists():
    return None
  try:
    return json.loads(path.read_text())
  except (OSError, json.JSONDecodeError) as e:
    raise CorpusError(f"unreadable index manifest {path}: {e}") from None


def _sparse_backend(manifest: dict[str, Any]) -> str | None:
  """The BM25 engine an index holds: its own backend, a hybrid's BM25 side, or none (dense)."""
  backend = manifest["backend"]
  if backend == "hybrid":
    return manifest["hybrid"]["sparse"]
  return backend if backend in ("bm25", "tantivy") else None


def _load_tantivy(directory: Path, manifest: dict[str, Any]) -> LoadedIndex:
  bm25 = manifest["bm25"]
  tantivy = TantivyRetriever(
    directory / PASSAGES_DIR, stemmer=bm25["stemmer"], stopwords=bm25["stopwords"]
  )
  if tantivy.num_docs != manifest["num_passages"]:
    raise CorpusError(
      f"{directory}: the manifest records {manifest['num_passages']} passages but the tantivy "
      f"index holds {tantivy.num_docs} (rebuild it with `asearcher index`)"
    )
  pages_dir = directory / PAGES_DIR if manifest.get("pages_file") else None
  pages = TantivyPages(tantivy, pages_dir, manifest["num_pages"])
  return LoadedIndex(
    retriever=tantivy, passages=TantivyPassages(tantivy), pages=pages, manifest=manifest
  )


def _load_dense(
  directory: Path, manifest: dict[str, Any], encoder: Encoder | None
) -> DenseRetriever:
  """The encoder (passed, else the manifest's spec) over the faiss index: the directory's own,
  or the prebuilt file the manifest points at (rows are passage ids)."""
  if "dense" not in manifest:  # written before dense indexes were faiss directories
    raise CorpusError(
      f"{directory}: an old dense index (embeddings.npy); rebuild it with `asearcher index`"
    )
  if encoder is None:
    encoder = load_encoder(manifest["encoder"])
  cfg = DenseIndexConfig(**manifest["dense"])
  if cfg.prebuilt:
    index = DenseIndex.from_faiss_file(cfg.prebuilt, cfg)
  else:
    index = DenseIndex.load(directory / DENSE_DIR, cfg)
  return DenseRetriever(encoder, index)


def load_index(directory: Path, *, encoder: Encoder | None = None) -> LoadedIndex:
  """Loads an index directory written by `build_index_dir`.

  A dense or hybrid index re-creates its encoder from the manifest's `encoder` spec unless one is
  passed; its passage count must equal the faiss index's rows (row i is passage i). A gs://
  directory is read from the local cache (`storage.local_copy`: faiss reads local files).
  """
  directory = Path(storage.local_copy(directory, what="index"))
  manifest = read_manifest(directory)
  if manifest is None:
    raise CorpusError(f"no index at {directory} (run `asearcher index` first)")
  if manifest.get("format_version") != FORMAT_VERSION:
    raise CorpusError(f"{directory}: index format {manifest.get('format_version')} is unsupported")
  if manifest["backend"] not in BACKENDS:
    raise CorpusError(f"{directory}: unknown index backend {manifest['backend']!r}")
  t0 = time.perf_counter()
  sparse = _sparse_backend(manifest)
  if sparse == "tantivy":
    base = _load_tantivy(directory, manifest)
  else:
    passages = []
    with open(directory / "passages.jsonl", encoding="utf-8") as f:
      for line in f:
        passages.append(Passage(**json.loads(line)))
    bm25 = BM25Retriever.load(directory, BM25Config(**manifest["bm25"])) if sparse else None
    page_store = PageStore.from_file(directory / "pages.jsonl")
    base = LoadedIndex(retriever=bm25, passages=passages, pages=page_store, manifest=manifest)  # type: ignore[arg-type]
  retriever: Retriever = base.retriever
  if manifest["backend"] in ("dense", "hybrid"):
    retriever = _load_dense(directory, manifest, encoder)
    if manifest["backend"] == "hybrid":
      hybrid = HybridConfig(**manifest["hybrid"])
      retriever = HybridRetriever(retriever, base.retriever, hybrid)
  if len(base.passages) != retriever.num_docs:
    raise CorpusError(
      f"{directory}: {len(base.passages)} passages but the index holds {retriever.num_docs}"
    )
  manifest = {**manifest, "load_s": round(time.perf_counter() - t0, 3)}
  return dataclasses.replace(base, retriever=retriever, manifest=manifest, directory=directory)


@contextlib.contextmanager
def _build_lock(index_dir: Path) -> Iterator[None]:
  """One builder per index directory at a time (replicas of a server started together would
  otherwise build the same default index over each other); the others wait, then reuse it."""
  index_dir.parent.mkdir(parents=True, exist_ok=True)
  with open(index_dir.parent / f".{index_dir.name}.lock", "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _stream_passages(paths: Sequence[Path]) -> Iterator[Passage]:
  """Every passage of the files in order, one at a time (never a list of the corpus)."""
  from asearcher_jax.tools.retrieval.corpus import iter_passages

  return itertools.chain.from_iterable(iter_passages(p) for p in paths)


def _stream_pages(path: Path) -> Iterator[dict[str, str]]:
  from asearcher_jax.tools.retrieval.corpus import iter_page_rows

  return iter_page_rows(path)


def build_index_dir(
  *,
  corpus: Sequence[Path],
  index_dir: Path,
  backend: str = "bm25",
  bm25: BM25Config = BM25Config(),
  tantivy: TantivyConfig = TantivyConfig(),
  dense: DenseIndexConfig = DenseIndexConfig(),
  hybrid: HybridConfig = HybridConfig(),
  pages_file: Path | None = None,
  encoder: str | None = None,
  force: bool = False,
  show_progress: bool = True,
) -> dict[str, Any]:
  """Builds (or keeps, when corpus checksum and settings match) an index; returns its manifest.

  `tantivy` sets how a tantivy index is built (writer threads and memory), not what it holds, so
  it is not among the settings that decide reuse. A dense or hybrid index encodes the streamed
  corpus with `encoder` into the faiss index `dense` describes, or, with `dense.prebuilt`, points
  at a faiss file built elsewhere (not copied: wiki-18's is 60 GB) whose rows must be the corpus's
  passages in order.
  """
  from asearcher_jax.tools.retrieval.corpus import corpus_sha256

  corpus = [Path(p) for p in corpus]
  for path in [*corpus, *([Path(pages_file)] if pages_file else [])]:
    if not path.exists():
      raise CorpusError(f"corpus file not found: {path}")
  if backend not in BACKENDS:
    raise CorpusError(f"unknown index backend {backend!r} (expected one of {', '.join(BACKENDS)})")
  if backend in ("dense", "hybrid") and not encoder:
    raise CorpusError(
      f"the {backend} backend needs an encoder ('e5:<model dir>' or 'module:factory')"
    )
  if backend in ("dense", "hybrid") and dense.prebuilt and not Path(dense.prebuilt).is_file():
    raise CorpusError(f"prebuilt faiss index not found: {dense.prebuilt}")
  index_dir = Path(index_dir)
  with _build_lock(index_dir):
    checksum = corpus_sha256(corpus + ([Path(pages_file)] if pages_file else []))
    settings: dict[str, Any] = {"backend": backend}
    if backend != "dense":
      settings["bm25"] = dataclasses.asdict(bm25)
    if backend in ("dense", "hybrid"):
      settings |= {"encoder": encoder, "dense": dataclasses.asdict(dense)}
      if dense.prebuilt:  # a replaced file (same path) is a different index
        stat = Path(dense.prebuilt).stat()
        settings["prebuilt_stat"] = [stat.st_size, stat.st_mtime_ns]
    if backend == "hybrid":
      settings["hybrid"] = dataclasses.asdict(hybrid)
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
    info: dict[str, Any] = {
      **settings,
      "corpus_files": [str(p) for p in corpus],
      "pages_file": str(pages_file) if pages_file else None,
      "corpus_sha256": checksum,
    }
    sparse = _sparse_backend(settings)
    if sparse == "tantivy":
      info |= _build_tantivy(corpus, index_dir, bm25, tantivy, pages_file)
    else:
      info |= _build_in_memory(corpus, index_dir, bm25 if sparse else None, pages_file,
                               show_progress)  # fmt: skip
    if backend in ("dense", "hybrid"):
      info["dense_index"] = _build_dense(corpus, index_dir, dense, encoder, info["num_passages"])
    info |= {"build_s": round(time.perf_counter() - t0, 3), "created_unix": int(time.time())}
    _write_manifest(index_dir, info)
    return {**info, "format_version": FORMAT_VERSION, "reused": False}


def _build_in_memory(
  corpus: Sequence[Path],
  index_dir: Path,
  bm25: BM25Config | None,
  pages_file: Path | None,
  show_progress: bool,
) -> dict[str, Any]:
  """passages.jsonl + pages.jsonl (and the bm25s arrays unless `bm25` is None); their counts."""
  from asearcher_jax.tools.retrieval.corpus import load_passages

  passages = load_passages(corpus)
  pages = PageStore.from_file(Path(pages_file)) if pages_file else PageStore.from_passages(passages)
  retriever = None
  if bm25 is not None:
    texts = [p.contents for p in passages]
    retriever = BM25Retriever.build(texts, bm25, show_progress=show_progress)
  index_dir.mkdir(parents=True, exist_ok=True)
  (index_dir / MANIFEST).unlink(missing_ok=True)
  with open(index_dir / "passages.jsonl", "w", encoding="utf-8") as f:
    for p in passages:
      f.write(json.dumps(dataclasses.asdict(p), ensure_ascii=False) + "\n")
  pages.save(index_dir / "pages.jsonl")
  if retriever is not None:
    retriever.save(index_dir)
  return {"num_passages": len(passages), "num_pages": len(pages)}


def _build_dense(
  corpus: Sequence[Path],
  index_dir: Path,
  cfg: DenseIndexConfig,
  encoder: str | None,
  num_passages: int,
) -> dict[str, Any]:
  """The faiss side: the corpus streamed through the encoder into `index_dir/dense`, or a check
  that a prebuilt file has one row per passage. Returns what the manifest records of it."""
  from asearcher_jax.tools.retrieval import dense_index

  if cfg.prebuilt:
    index = dense_index.read_faiss_index(cfg.prebuilt)
    if index.ntotal != num_passages:
      raise CorpusError(
        f"prebuilt faiss index {cfg.prebuilt} holds {index.ntotal} vectors but the corpus "
        f"{num_passages} passages (its rows must be the corpus's passages, in order)"
      )
    return {"prebuilt": cfg.prebuilt, "dim": int(index.d), "ntotal": int(index.ntotal),
            "kind": dense_index.kind_of(index)}  # fmt: skip
  assert encoder is not None
  texts = (p.contents for p in _stream_passages(corpus))
  info = dense_index.build_dense_index(texts, load_encoder(encoder), index_dir / DENSE_DIR, cfg)
  return {k: info[k] for k in ("factory", "dim", "ntotal", "build_s", "train_s", "index_bytes")}


def _build_tantivy(
  corpus: Sequence[Path],
  index_dir: Path,
  bm25: BM25Config,
  config: TantivyConfig,
  pages_file: Path | None,
) -> dict[str, Any]:
  """The corpus streamed into tantivy (and a pages file into its own index); counts and the
  settings the index was built with, for the manifest."""
  import shutil

  from asearcher_jax.tools.retrieval import tantivy_index

  index_dir.mkdir(parents=True, exist_ok=True)
  (index_dir / MANIFEST).unlink(missing_ok=True)  # an interrupted build leaves no valid index
  for name in (PASSAGES_DIR, PAGES_DIR):
    shutil.rmtree(index_dir / name, ignore_errors=True)
  n, num_pages = tantivy_index.build_passages(
    _stream_passages(corpus),
    index_dir / PASSAGES_DIR,
    stemmer=bm25.stemmer,
    stopwords=bm25.stopwords,
    config=config,
  )
  if pages_file:
    num_pages = tantivy_index.build_pages(_stream_pages(Path(pages_file)), index_dir / PAGES_DIR,
                                          config)  # fmt: skip
  return {
    "num_passages": n,
    "num_pages": num_pages,
    "tantivy": dataclasses.asdict(config),
    "scoring": "tantivy BM25 (Lucene's k1=1.2, b=0.75)",
  }


def _write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
  manifest = {"format_version": FORMAT_VERSION, **manifest}
  tmp = directory / (MANIFEST + ".tmp")
  tmp.write_text(json.dumps(manifest, indent=2) + "\n")
  tmp.replace(directory / MANIFEST)
