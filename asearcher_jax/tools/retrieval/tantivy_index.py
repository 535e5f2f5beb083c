"""BM25 over tantivy: the backend for corpora too large for bm25s (wiki-18's 21M passages).

tantivy (a Rust search library, Lucene's design without the JVM) keeps the whole index on disk,
memory-mapped: opening an index is instant and resident memory is what the queries touch. The
corpus is streamed into a multi-threaded writer whose heap is bounded (`TantivyConfig`), so
building needs the writer heap plus one passage at a time, never the corpus. Passages are tantivy
stored fields (compressed, on disk); `access` pages are rebuilt from the passages of one URL (a
raw `page` term per passage) or read from a separate pages index, so no second copy of the text
is held anywhere. Search releases the GIL inside tantivy, so worker threads score in parallel.

Tokenisation mirrors bm25s's (`(?u)\\b\\w\\w+\\b`, lowercase, the same stopword list, the same
Snowball stemmer), so both backends index the same terms; tantivy's BM25 has Lucene's constants
(k1=1.2, b=0.75), which `BM25Config.k1`/`b`/`method` do not change.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from asearcher_jax.tools.retrieval.corpus import CorpusError, Passage, page_key

# (passage index, score) pairs, best first (the same shape as index.Hits).
Hits = list[tuple[int, float]]
ANALYZER = "asearcher_bm25"
PASSAGES_DIR = "tantivy"
PAGES_DIR = "tantivy_pages"
# Stored-only fields (UTF-8 bytes) of a passage and of a row of a separate pages file.
STORED = ("title", "text", "url")
PAGE_STORED = ("url", "title", "contents")
# The most passages one page may have (access joins them; wiki-18 pages have a few hundred).
MAX_PAGE_PASSAGES = 10_000


@dataclasses.dataclass(frozen=True, kw_only=True)
class TantivyConfig:
  """How a tantivy index is built (not what it holds: changing these does not force a rebuild)."""

  # Indexing threads of the writer; each builds its own segments from the streamed passages.
  writer_threads: int = 2
  # The writer's memory budget in MB, split between its threads (tantivy needs >= 15 MB each);
  # a thread flushes a segment to disk when its share fills, so this bounds the build's memory.
  writer_heap_mb: int = 1024

  def __post_init__(self):
    if not isinstance(self.writer_threads, int) or self.writer_threads < 1:
      raise ValueError(f"writer_threads must be an integer >= 1, got {self.writer_threads!r}")
    if not isinstance(self.writer_heap_mb, int) or self.writer_heap_mb < 15 * self.writer_threads:
      raise ValueError(
        f"writer_heap_mb must be >= 15 per writer thread ({15 * self.writer_threads} for "
        f"{self.writer_threads}), got {self.writer_heap_mb!r}"
      )


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


def _tantivy() -> Any:
  try:
    import tantivy
  except ImportError:  # pinned in requirements.txt; a hand-made environment may lack it
    raise CorpusError(
      "the tantivy backend needs the `tantivy` package (requirements.txt)"
    ) from None
  return tantivy


def _stopwords(name: str | None) -> list[str]:
  if not name:
    return []
  return sorted(_import_bm25s().tokenization._infer_stopwords(name))


def make_analyzer(stemmer: str | None, stopwords: str | None) -> Any:
  """bm25s's tokenisation as a tantivy analyzer (the same terms in both backends)."""
  tantivy = _tantivy()
  builder = tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.regex(r"(?u)\b\w\w+\b"))
  builder = builder.filter(tantivy.Filter.lowercase())
  if stopwords:
    builder = builder.filter(tantivy.Filter.custom_stopword(_stopwords(stopwords)))
  if stemmer:
    builder = builder.filter(tantivy.Filter.stemmer(stemmer))
  return builder.build()


def _passage_schema() -> Any:
  tantivy = _tantivy()
  sb = tantivy.SchemaBuilder()
  # Scored text: term frequencies only (no positions: BM25 needs none, the index is smaller).
  sb.add_text_field("body", stored=False, tokenizer_name=ANALYZER, index_option="freq")
  # Corpus order: the passage index every Hits carries, and its lookup term.
  sb.add_unsigned_field("ord", stored=False, indexed=True, fast=True)
  sb.add_text_field("id", stored=True, tokenizer_name="raw", index_option="basic")
  sb.add_text_field("page", stored=False, tokenizer_name="raw", index_option="basic")
  for name in STORED:  # stored only: bytes fields are not indexed (a text field always is)
    sb.add_bytes_field(name, stored=True)
  return sb.build()


def _pages_schema() -> Any:
  tantivy = _tantivy()
  sb = tantivy.SchemaBuilder()
  sb.add_text_field("key", stored=False, tokenizer_name="raw", index_option="basic")
  for name in PAGE_STORED:
    sb.add_bytes_field(name, stored=True)
  return sb.build()


class _Hashes:
  """64-bit hashes of strings in a growing numpy array: duplicate and distinct counts over
  millions of ids in 8 bytes each, instead of a Python set of the strings. (Python's own str
  hash: salted per process, which is fine, every hash of one build is taken in its process.)"""

  def __init__(self) -> None:
    self._chunks: list[np.ndarray] = []
    self._buf: list[int] = []

  def add(self, s: str) -> None:
    self._buf.append(hash(s))
    if len(self._buf) >= 1 << 16:
      self._chunks.append(np.array(self._buf, dtype=np.int64))
      self._buf = []

  def sorted(self) -> np.ndarray:
    parts = [*self._chunks, np.array(self._buf, dtype=np.int64)]
    return np.sort(np.concatenate(parts))


def _open_writer(directory: Path, schema: Any, config: TantivyConfig, analyzer: Any | None) -> Any:
  tantivy = _tantivy()
  directory.mkdir(parents=True, exist_ok=True)
  index = tantivy.Index(schema, path=str(directory), reuse=False)
  if analyzer is not None:
    index.register_tokenizer(ANALYZER, analyzer)
  heap = config.writer_heap_mb * 1_000_000
  return index, index.writer(heap_size=heap, num_threads=config.writer_threads)


def build_passages(
  passages: Iterable[Passage],
  directory: Path,
  *,
  stemmer: str | None,
  stopwords: str | None,
  config: TantivyConfig,
) -> tuple[int, int]:
  """Streams `passages` into a tantivy index at `directory`; returns (passages, distinct pages).

  Empty passages are skipped and duplicate ids refused, as `corpus.load_passages` does.
  """
  tantivy = _tantivy()
  index, writer = _open_writer(
    directory, _passage_schema(), config, make_analyzer(stemmer, stopwords)
  )
  ids, pages = _Hashes(), _Hashes()
  n, last_url, key = 0, None, ""
  for p in passages:
    if not p.text and not p.title:
      continue
    if p.url != last_url:  # a page's passages are usually consecutive: one page_key each
      last_url, key = p.url, page_key(p.url)
      pages.add(key)
    doc = tantivy.Document()
    doc.add_text("body", p.contents)
    doc.add_unsigned("ord", n)
    doc.add_text("id", p.id)
    doc.add_text("page", key)
    doc.add_bytes("title", p.title.encode())
    doc.add_bytes("text", p.text.encode())
    doc.add_bytes("url", p.url.encode())
    writer.add_document(doc)
    ids.add(p.id)
    n += 1
  writer.commit()
  writer.wait_merging_threads()
  if n == 0:
    raise CorpusError("no passages in the corpus")
  hashed = ids.sorted()
  if (dup := np.flatnonzero(hashed[1:] == hashed[:-1])).size:
    index.reload()
    searcher = index.searcher()
    for pid in _ids_with_hash(index, searcher, int(hashed[dup[0]])):
      raise CorpusError(f"duplicate passage id {pid!r} in the corpus")
  page_hashes = pages.sorted()
  return n, int(1 + np.count_nonzero(page_hashes[1:] != page_hashes[:-1]))


def _ids_with_hash(index: Any, searcher: Any, digest: int) -> Iterator[str]:
  """The ids whose hash is `digest` and that occur more than once (a hash collision is not);
  a scan of every stored id, only on the error path."""
  tantivy = _tantivy()
  every, page = tantivy.Query.all_query(), 65536
  for offset in range(0, searcher.num_docs, page):
    for _, addr in searcher.search(every, page, count=False, offset=offset).hits:
      pid = searcher.doc(addr).get_first("id")
      if hash(pid) == digest:
        q = tantivy.Query.term_query(index.schema, "id", pid)
        if len(searcher.search(q, 2, count=False).hits) > 1:
          yield pid


def build_pages(rows: Iterable[dict[str, str]], directory: Path, config: TantivyConfig) -> int:
  """A separate pages file (ASearcher's wiki_webpages.jsonl rows) as its own small index."""
  tantivy = _tantivy()
  _, writer = _open_writer(directory, _pages_schema(), config, None)
  n = 0
  for row in rows:
    doc = tantivy.Document()
    doc.add_text("key", page_key(row["url"]))
    for name in PAGE_STORED:
      doc.add_bytes(name, row.get(name, "").encode())
    writer.add_document(doc)
    n += 1
  writer.commit()
  writer.wait_merging_threads()
  return n


def _passage(doc: Any) -> Passage:
  d = doc.to_dict()
  return Passage(id=d["id"][0], **{k: bytes(d[k][0]).decode() for k in STORED})


class TantivyPassages:
  """The passages of a tantivy index by corpus position: `passages[i]` reads stored fields."""

  def __init__(self, retriever: TantivyRetriever) -> None:
    self._r = retriever

  def __len__(self) -> int:
    return self._r.num_docs

  def __getitem__(self, i: int) -> Passage:
    if not 0 <= i < self._r.num_docs:
      raise IndexError(i)
    tantivy = _tantivy()
    searcher = self._r.searcher()
    hits = searcher.search(tantivy.Query.term_query(self._r.schema, "ord", i), 1, count=False).hits
    return _passage(searcher.doc(hits[0][1]))


class TantivyPages:
  """`get(url)` -> the page row, from the pages index or rebuilt from the URL's passages."""

  def __init__(self, retriever: TantivyRetriever, pages_dir: Path | None, count: int) -> None:
    self._r = retriever
    self._count = count
    self._pages = None
    if pages_dir is not None:
      self._pages = _tantivy().Index.open(str(pages_dir))

  def __len__(self) -> int:
    return self._count

  def get(self, url: str) -> dict[str, str] | None:
    tantivy = _tantivy()
    key = page_key(url)
    if self._pages is not None:
      searcher = self._pages.searcher()
      q = tantivy.Query.term_query(self._pages.schema, "key", key)
      hits = searcher.search(q, 1, count=False).hits
      if not hits:
        return None
      d = searcher.doc(hits[0][1]).to_dict()
      return {k: bytes(d[k][0]).decode() for k in PAGE_STORED}
    searcher = self._r.searcher()
    q = tantivy.Query.term_query(self._r.schema, "page", key)
    hits = searcher.search(q, MAX_PAGE_PASSAGES, count=False).hits
    if not hits:
      return None
    ords = searcher.fast_field_values("ord", [a for _, a in hits])
    passages = [_passage(searcher.doc(a)) for _, a in sorted(zip(ords, (a for _, a in hits)))]
    texts: list[str] = []
    for p in passages:  # as PageStore.from_passages: distinct texts in corpus order
      if p.text and p.text not in texts:
        texts.append(p.text)
    first = passages[0]
    return {"url": first.url, "title": first.title,
            "contents": f"{first.title}\n\n" + "\n\n".join(texts)}  # fmt: skip


class TantivyRetriever:
  """BM25 top-k over a memory-mapped tantivy index; safe to call from several threads."""

  backend = "tantivy"

  def __init__(self, directory: Path, *, stemmer: str | None, stopwords: str | None) -> None:
    tantivy = _tantivy()
    self.index = tantivy.Index.open(str(directory))
    self.analyzer = make_analyzer(stemmer, stopwords)
    self.index.register_tokenizer(ANALYZER, self.analyzer)
    self.schema = self.index.schema
    self._local = threading.local()
    self.num_docs = int(self.index.searcher().num_docs)

  def searcher(self) -> Any:
    """One searcher per thread (an index that is never written needs no reload)."""
    s = getattr(self._local, "searcher", None)
    if s is None:
      s = self._local.searcher = self.index.searcher()
    return s

  def query_terms(self, query: str) -> list[str]:
    return self.analyzer.analyze(query)

  def _hits(self, query: str, k: int) -> list[tuple[float, int, Any]]:
    """(score, passage index, address), best first, ties by corpus order (deterministic)."""
    tantivy = _tantivy()
    terms = list(dict.fromkeys(self.query_terms(query)))
    if not terms or k <= 0:
      return []
    schema = self.schema
    should = tantivy.Occur.Should
    q = tantivy.Query.boolean_query(
      [(should, tantivy.Query.term_query(schema, "body", t)) for t in terms]
    )
    searcher = self.searcher()
    hits = searcher.search(q, k, count=False).hits
    if not hits:
      return []
    ords = searcher.fast_field_values("ord", [a for _, a in hits])
    out = [(float(s), int(o), a) for (s, a), o in zip(hits, ords, strict=True) if s > 0]
    out.sort(key=lambda h: (-h[0], h[1]))
    return out

  def search_batch(self, queries: Sequence[str], k: int) -> list[Hits]:
    return [[(o, s) for s, o, _ in self._hits(q, k)] for q in queries]

  def search_rows(self, queries: Sequence[str], k: int) -> list[list[tuple[dict[str, str], float]]]:
    """Hits with their documents, read in the same pass (the server's path: one lookup a hit)."""
    out = []
    for query in queries:
      hits = self._hits(query, k)
      searcher = self.searcher()
      out.append([(_passage(searcher.doc(a)).to_row(), s) for s, _, a in hits])
    return out
