"""`asearcher index`: a search index over corpus files (default: the shipped corpus).

Runs with no gin file at all: the shipped corpus, a BM25 index under the user cache directory.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from asearcher_jax import storage
from asearcher_jax.tools.retrieval.corpus import default_corpus_paths
from asearcher_jax.tools.retrieval.index import (
  BM25Config,
  DenseIndexConfig,
  HybridConfig,
  TantivyConfig,
  build_index_dir,
)

log = logging.getLogger(__name__)

# backend="auto": corpus files larger than this in all (bytes, as stored, so a .gz counts
# compressed) get the on-disk "tantivy" BM25, smaller ones bm25s in memory. bm25s holds the whole
# index in memory, ~6 kB a wiki-18 passage (126 GB at 21M passages, docs/measurements.md);
# 256 MiB of wiki-18 jsonl is ~400k passages, ~2.4 GB of bm25s, where tantivy streams in ~1 GB.
LARGE_CORPUS_BYTES = 256 << 20


def auto_backend(paths: Sequence[Path]) -> str:
  """The BM25 engine `backend="auto"` picks for these corpus files (LARGE_CORPUS_BYTES)."""
  size = sum(p.stat().st_size for p in paths if p.is_file())
  return "tantivy" if size > LARGE_CORPUS_BYTES else "bm25"


def default_index_dir() -> Path:
  """Where the shipped corpus's index lives unless told otherwise ($ASEARCHER_HOME or ~/.cache)."""
  home = os.environ.get("ASEARCHER_HOME") or Path.home() / ".cache" / "asearcher_jax"
  return Path(home) / "index" / "default-bm25"


def build_index(
  *,
  corpus: str | Sequence[str] = (),
  add_shipped_corpus: bool = False,
  index_dir: str | None = None,
  backend: str = "auto",
  bm25: BM25Config = BM25Config(),
  tantivy: TantivyConfig = TantivyConfig(),
  dense: DenseIndexConfig = DenseIndexConfig(),
  hybrid: HybridConfig = HybridConfig(),
  pages_file: str | None = None,
  encoder: str | None = None,
  force: bool = False,
  show_progress: bool = True,
) -> int:
  """Builds a search index over `corpus` files (default: the shipped corpus) into `index_dir`.

  An index whose manifest records the same corpus checksum and settings is kept unless `force`.
  Returns 0 (the process exit code).

  Args:
    corpus: one corpus file or a list of them (.jsonl / .json, optionally .gz; the formats are in
      `tools.retrieval.corpus`); (): the shipped corpus.
    add_shipped_corpus: also index the shipped corpus (~8k Wikipedia passages) after `corpus`, as
      distractors around one's own documents.
    index_dir: where the index goes; None: the shipped corpus's default ($ASEARCHER_HOME or
      ~/.cache/asearcher_jax, index/default-bm25).
    backend: "auto" (the default: "tantivy" for corpus files over LARGE_CORPUS_BYTES, 256 MiB,
      else "bm25"), "bm25" (bm25s in memory: corpora up to a few hundred thousand passages),
      "tantivy" (BM25 on disk, the corpus streamed: wiki-18's 21M passages),
      "dense" (`encoder` + a faiss index, see `dense`) or "hybrid" (dense and BM25 fused by
      reciprocal rank, see `hybrid`).
    bm25: the BM25 settings (stemmer, stopwords, k1, b, variant; `index.BM25Config.*`); tantivy
      uses the stemmer and stopwords, and Lucene's k1=1.2, b=0.75.
    tantivy: how a tantivy index is built (writer threads and memory; `index.TantivyConfig.*`).
    dense: the faiss index of a dense or hybrid index (flat, hnsw or ivfpq and their search
      settings; `prebuilt`: serve a faiss file built elsewhere, e.g. Search-R1's e5_Flat.index,
      whose rows are the corpus's passages in order; `index.DenseIndexConfig.*`).
    hybrid: how a hybrid index fuses its rankings and which BM25 engine it holds ("bm25" or
      "tantivy"; `index.HybridConfig.*`).
    pages_file: whole pages for `access` (.jsonl rows {"url", "contents", "title"?}, ASearcher's
      wiki_webpages.jsonl); None: the passages of each URL joined in corpus order.
    encoder: a dense or hybrid index's encoder: "e5:<dir>" (a Hugging Face e5/BERT directory,
      e.g. intfloat/e5-base-v2, run by the Flax `tools.retrieval.e5` encoder) or
      "package.module:factory"; recorded in the manifest, so the server loads the same one.
    force: rebuild even when the manifest says the index is up to date.
    show_progress: progress bars while indexing.
  """
  if isinstance(corpus, str):  # one path, not a sequence of one-letter paths
    corpus = [corpus]
  # gs:// corpus files are read from the local cache (`storage.local_copy`)
  paths = [Path(storage.local_copy(p, what="corpus")) for p in corpus] or default_corpus_paths()
  if add_shipped_corpus and corpus:
    paths += default_corpus_paths()
  if backend == "auto":
    backend = auto_backend(paths)
    log.info("index: backend %s for %s (auto, over %d bytes: tantivy)", backend,
             ", ".join(map(str, paths)), LARGE_CORPUS_BYTES)  # fmt: skip
  if dense.prebuilt:  # faiss reads a local file
    dense = dataclasses.replace(dense, prebuilt=storage.local_copy(dense.prebuilt, what="prebuilt"))
  out = Path(index_dir) if index_dir else default_index_dir()
  manifest = build_index_dir(
    corpus=paths,
    index_dir=out,
    backend=backend,
    bm25=bm25,
    tantivy=tantivy,
    dense=dense,
    hybrid=hybrid,
    pages_file=Path(storage.local_copy(pages_file, what="pages_file")) if pages_file else None,
    encoder=encoder,
    force=force,
    show_progress=show_progress,
  )
  verb = "up to date" if manifest["reused"] else f"built in {manifest['build_s']:.1f} s"
  print(
    f"index {out}: {manifest['backend']}, {manifest['num_passages']} passages, "
    f"{manifest['num_pages']} pages, corpus sha256 {manifest['corpus_sha256'][:12]}, {verb}"
  )
  return 0
