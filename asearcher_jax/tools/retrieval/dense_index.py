"""Dense retrieval over faiss: indexes built in shards, memory-mapped loading, hybrid fusion.

ASearcher-Local and Search-R1 serve wiki-18 from an e5 Flat-IP index that needs ~62 GB of RAM and
half an hour to load. Here an index directory holds `index.faiss` (any faiss index, ours or one
written elsewhere), `doc_ids.npy` (faiss row -> passage id) and `dense.json`; loading memory-maps
the index file (faiss's IO_FLAG_MMAP_IFC), so start-up reads no vectors and replicas on one host
share one copy in the page cache. Three kinds, all inner product over unit vectors (cosine):
  * flat: exact search, what ASearcher ships; memory = 4 * dim bytes a passage;
  * hnsw: a graph over full vectors, fast and near-exact, memory a little above flat;
  * ivfpq: IVF cells + product-quantised codes (m bytes a passage), re-ranked exactly over
    float16 copies of the candidates' vectors (`refine_k_factor`), which stay on disk.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from asearcher_jax.errors import ConfigValueError

log = logging.getLogger(__name__)

INDEX_FILE = "index.faiss"
IDS_FILE = "doc_ids.npy"
INFO_FILE = "dense.json"
# (doc id, score) pairs, best first.
Hits = list[tuple[int, float]]


def _faiss() -> Any:
  import faiss  # imported late: a BM25-only process never loads faiss (~60 MB, OpenMP threads)

  return faiss


@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseIndexConfig:
  """Which faiss index to build and how to search it; search fields also apply to loaded files."""

  kind: Literal["flat", "hnsw", "ivfpq"] = "flat"  # see the module docstring
  nlist: int = 1024  # ivfpq: IVF cells (~sqrt(N) to 16 sqrt(N); wiki-18's 21M: 4096-65536)
  m: int = 0  # ivfpq: PQ sub-quantisers, bytes per code; must divide dim (0: dim // 8)
  nbits: int = 8  # ivfpq: bits per sub-quantiser code
  nprobe: int = 32  # ivfpq: IVF cells scanned per query (recall vs speed)
  refine_k_factor: int = 8  # ivfpq: re-rank k * this PQ candidates on fp16 vectors (0: no refine)
  hnsw_m: int = 32  # hnsw: graph neighbours per node
  ef_construction: int = 80  # hnsw: candidate list while building
  ef_search: int = 64  # hnsw: candidate list while searching (recall vs speed)
  shard_size: int = 65536  # vectors encoded and added to the index per step
  train_size: int = 65536  # ivfpq: vectors (the first ones streamed) the quantisers train on
  encode_batch: int = 256  # passages per encoder call while building
  # A faiss index file written elsewhere (Search-R1's e5_Flat.index: row i is passage i of the
  # corpus) to serve instead of building one; None: build from the corpus with the encoder.
  prebuilt: str | None = None

  def __post_init__(self) -> None:
    if self.kind not in ("flat", "hnsw", "ivfpq"):
      raise ConfigValueError(f"DenseIndexConfig.kind={self.kind!r}: expected flat, hnsw or ivfpq")
    for name in ("nlist", "nbits", "nprobe", "hnsw_m", "ef_construction", "ef_search"):
      if getattr(self, name) < 1:
        raise ConfigValueError(f"DenseIndexConfig.{name}={getattr(self, name)}: must be >= 1")
    for name in ("shard_size", "train_size", "encode_batch"):
      if getattr(self, name) < 1:
        raise ConfigValueError(f"DenseIndexConfig.{name}={getattr(self, name)}: must be >= 1")
    if self.m < 0 or self.refine_k_factor < 0:
      raise ConfigValueError("DenseIndexConfig.m and refine_k_factor must be >= 0")

  def factory_string(self, dim: int) -> str:
    """The faiss index_factory description of this index for `dim`-dimensional vectors."""
    if self.kind == "flat":
      return "Flat"
    if self.kind == "hnsw":
      return f"HNSW{self.hnsw_m}"
    m = self.m or dim // 8
    if m < 1 or dim % m:
      raise ConfigValueError(f"DenseIndexConfig.m={m} must divide the vector dim {dim}")
    refine = ",Refine(SQfp16)" if self.refine_k_factor else ""
    return f"IVF{self.nlist},PQ{m}x{self.nbits}{refine}"


class Encoder(Protocol):
  """Texts -> [n, dim] float32 unit vectors (e5.E5Encoder is one)."""

  def encode(self, texts: Sequence[str], *, kind: str) -> np.ndarray: ...


def _parts(index: Any) -> dict[str, Any]:
  """The faiss sub-indexes whose search parameters we set: ivf, hnsw, refine (when present)."""
  faiss = _faiss()
  out: dict[str, Any] = {}
  idx = faiss.downcast_index(index)
  if isinstance(idx, faiss.IndexRefine):
    out["refine"] = idx
    idx = faiss.downcast_index(idx.base_index)
  if isinstance(idx, faiss.IndexPreTransform):
    idx = faiss.downcast_index(idx.index)
  if isinstance(idx, faiss.IndexIVF):
    out["ivf"] = idx
  if isinstance(idx, faiss.IndexHNSW):
    out["hnsw"] = idx
  return out


def kind_of(index: Any) -> str:
  parts = _parts(index)
  return "ivfpq" if "ivf" in parts else "hnsw" if "hnsw" in parts else "flat"


def apply_search_params(index: Any, cfg: DenseIndexConfig) -> None:
  """Sets nprobe / efSearch / k_factor on whichever of them the index has."""
  parts = _parts(index)
  if "ivf" in parts:
    parts["ivf"].nprobe = cfg.nprobe
  if "hnsw" in parts:
    parts["hnsw"].hnsw.efSearch = cfg.ef_search
  if "refine" in parts and cfg.refine_k_factor:
    parts["refine"].k_factor = float(cfg.refine_k_factor)


def _as_unit_f32(x: np.ndarray) -> np.ndarray:
  x = np.ascontiguousarray(x, dtype=np.float32)
  norms = np.linalg.norm(x, axis=1, keepdims=True)
  return x / np.maximum(norms, 1e-12)


def build_from_vectors(
  batches: Iterable[np.ndarray],
  directory: str | Path,
  cfg: DenseIndexConfig = DenseIndexConfig(),
  *,
  doc_ids: Iterable[int] | None = None,
  extra_info: dict[str, Any] | None = None,
) -> dict[str, Any]:
  """Adds streamed vector batches to a new index shard by shard, then writes the directory.

  Only one shard (plus the IVF training sample) is held at a time besides the index itself.
  `doc_ids` (default 0, 1, 2, ...) gives each vector's passage id. IVF-PQ trains on the first
  `train_size` vectors streamed: shuffle the corpus order first if it is sorted by topic.
  Returns the info written to dense.json (build time, sizes).
  """
  faiss = _faiss()
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  (directory / INFO_FILE).unlink(missing_ok=True)  # its presence marks a complete index
  t0 = time.perf_counter()
  index = None
  pending: list[np.ndarray] = []
  n_pending = 0
  total = 0
  train_s = 0.0

  def flush() -> None:
    nonlocal index, pending, n_pending, total, train_s
    if not pending:
      return
    x = _as_unit_f32(np.concatenate(pending))
    pending, n_pending = [], 0
    if index is None:
      index = faiss.index_factory(
        x.shape[1], cfg.factory_string(x.shape[1]), faiss.METRIC_INNER_PRODUCT
      )
      parts = _parts(index)
      if "hnsw" in parts:
        parts["hnsw"].hnsw.efConstruction = cfg.ef_construction
      if isinstance(parts.get("ivf"), faiss.IndexIVFPQ):
        # Polysemous training (re-ordering codes for Hamming filtering, which we never use) is
        # simulated annealing costing ~45 s a training whatever the sample size: skip it.
        parts["ivf"].do_polysemous_training = False
    if not index.is_trained:
      t = time.perf_counter()
      index.train(x[: cfg.train_size])
      train_s = time.perf_counter() - t
    for start in range(0, x.shape[0], cfg.shard_size):
      index.add(x[start : start + cfg.shard_size])
    total += x.shape[0]
    log.info("dense index: %d vectors added (%.0f s)", total, time.perf_counter() - t0)

  for batch in batches:
    batch = np.asarray(batch)
    if batch.ndim != 2:
      raise ValueError(f"vector batches must be [n, dim], got shape {batch.shape}")
    pending.append(batch)
    n_pending += batch.shape[0]
    # An untrained IVF index waits for its training sample; afterwards, one shard at a time.
    want = cfg.train_size if cfg.kind == "ivfpq" and index is None else cfg.shard_size
    if n_pending >= want:
      flush()
  flush()
  if index is None:
    raise ValueError("no vectors to index")
  ids = np.arange(total, dtype=np.int64) if doc_ids is None else np.fromiter(doc_ids, np.int64)
  if ids.shape[0] != total:
    raise ValueError(f"{ids.shape[0]} doc ids for {total} vectors")
  faiss.write_index(index, str(directory / INDEX_FILE))
  np.save(directory / IDS_FILE, ids)
  info = {
    "config": dataclasses.asdict(cfg),
    "factory": cfg.factory_string(index.d),
    "dim": int(index.d),
    "ntotal": int(index.ntotal),
    "build_s": round(time.perf_counter() - t0, 3),
    "train_s": round(train_s, 3),
    "index_bytes": (directory / INDEX_FILE).stat().st_size,
    **(extra_info or {}),
  }
  tmp = directory / (INFO_FILE + ".tmp")
  tmp.write_text(json.dumps(info, indent=2) + "\n")
  tmp.replace(directory / INFO_FILE)
  return info


def encode_passages(
  texts: Iterable[str], encoder: Encoder, *, batch_size: int
) -> Iterator[np.ndarray]:
  """Streams passage embeddings batch by batch (the corpus is never held in memory)."""
  chunk: list[str] = []
  for text in texts:
    chunk.append(text)
    if len(chunk) == batch_size:
      yield encoder.encode(chunk, kind="passage")
      chunk = []
  if chunk:
    yield encoder.encode(chunk, kind="passage")


def build_dense_index(
  texts: Iterable[str],
  encoder: Encoder,
  directory: str | Path,
  cfg: DenseIndexConfig = DenseIndexConfig(),
  *,
  doc_ids: Iterable[int] | None = None,
) -> dict[str, Any]:
  """Encodes streamed passages in batches and builds the index from them in shards."""
  batches = encode_passages(texts, encoder, batch_size=cfg.encode_batch)
  return build_from_vectors(batches, directory, cfg, doc_ids=doc_ids)


def read_faiss_index(path: str | Path, *, mmap: bool = True) -> Any:
  """faiss.read_index, memory-mapped where faiss can (IO_FLAG_MMAP_IFC: codes and lists stay in
  the page cache, shared by every process on the host); falls back to a plain read."""
  faiss = _faiss()
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"no faiss index file at {path}")
  if mmap:
    try:
      return faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY)
    except RuntimeError as e:
      log.warning("%s: cannot memory-map (%s); reading it into memory", path, str(e)[:200])
  return faiss.read_index(str(path))


class DenseIndex:
  """A faiss index + its row -> doc id map; vectors in, (scores, doc ids) out."""

  def __init__(self, index: Any, doc_ids: np.ndarray, cfg: DenseIndexConfig = DenseIndexConfig()):
    if doc_ids.shape[0] != index.ntotal:
      raise ValueError(f"{doc_ids.shape[0]} doc ids for an index of {index.ntotal} vectors")
    self.index = index
    self.doc_ids = doc_ids
    self.cfg = cfg
    self.dim = int(index.d)
    self.kind = kind_of(index)
    apply_search_params(index, cfg)

  @property
  def num_docs(self) -> int:
    return int(self.index.ntotal)

  @classmethod
  def load(
    cls, directory: str | Path, cfg: DenseIndexConfig | None = None, *, mmap: bool = True
  ) -> DenseIndex:
    """Loads a directory written by `build_from_vectors`; search settings from `cfg` when given."""
    directory = Path(directory)
    info_path = directory / INFO_FILE
    if not info_path.is_file():
      raise FileNotFoundError(f"no complete dense index at {directory} (no {INFO_FILE})")
    info = json.loads(info_path.read_text())
    cfg = cfg or DenseIndexConfig(**info["config"])
    ids = np.load(directory / IDS_FILE, mmap_mode="r" if mmap else None)
    return cls(read_faiss_index(directory / INDEX_FILE, mmap=mmap), ids, cfg)

  @classmethod
  def from_faiss_file(
    cls,
    path: str | Path,
    cfg: DenseIndexConfig = DenseIndexConfig(),
    *,
    doc_ids: np.ndarray | str | Path | None = None,
    mmap: bool = True,
  ) -> DenseIndex:
    """Serves an index file written elsewhere (e.g. Search-R1's prebuilt wiki-18 e5_Flat.index).

    Its rows are passage ids (line numbers of the corpus it was built from) unless `doc_ids`
    (an array or a .npy path) says otherwise; `cfg` supplies only the search settings.
    """
    index = read_faiss_index(path, mmap=mmap)
    if doc_ids is None:
      ids = np.arange(index.ntotal, dtype=np.int64)
    elif isinstance(doc_ids, (str, Path)):
      ids = np.load(doc_ids, mmap_mode="r" if mmap else None)
    else:
      ids = np.asarray(doc_ids, dtype=np.int64)
    return cls(index, ids, cfg)

  def search_vectors(self, queries: np.ndarray, k: int) -> list[Hits]:
    """One faiss search for the whole batch; rows of (doc id, score), best first."""
    q = _as_unit_f32(np.atleast_2d(queries))
    if q.shape[1] != self.dim:
      raise ValueError(f"query vectors have dim {q.shape[1]}, the index {self.dim}")
    k = min(k, self.num_docs)
    if k <= 0 or q.shape[0] == 0:
      return [[] for _ in range(q.shape[0])]
    scores, rows = self.index.search(q, k)
    out = []
    for row_s, row_i in zip(scores, rows):
      valid = row_i >= 0
      ids = self.doc_ids[row_i[valid]]
      out.append([(int(i), float(s)) for i, s in zip(ids, row_s[valid])])
    return out


class DenseRetriever:
  """Encoder + index: the server's retriever for dense search (Search-R1's e5 retriever)."""

  backend = "dense"

  def __init__(self, encoder: Encoder, index: DenseIndex) -> None:
    self.encoder = encoder
    self.index = index

  @property
  def num_docs(self) -> int:
    return self.index.num_docs

  def encode(self, queries: Sequence[str]) -> np.ndarray:
    """All queries in one encoder call (the encoder chunks and buckets them itself)."""
    return self.encoder.encode(list(queries), kind="query")

  def search(self, queries: Sequence[str], k: int) -> list[Hits]:
    if not queries:
      return []
    return self.index.search_vectors(self.encode(queries), k)

  # The server's Retriever protocol name for the same call.
  search_batch = search


def reciprocal_rank_fusion(
  runs: Sequence[Sequence[tuple[int, float]]],
  *,
  k: int,
  rrf_k: float = 60.0,
  weights: Sequence[float] | None = None,
) -> Hits:
  """Fuses ranked hit lists: score(d) = sum_i w_i / (rrf_k + rank_i(d)), ranks from 1.

  Uses ranks only, so BM25 scores (unbounded) and cosines (in [-1, 1]) need no calibration;
  rrf_k = 60 is Cormack et al.'s constant. Ties break by doc id, so results are deterministic.
  """
  weights = [1.0] * len(runs) if weights is None else list(weights)
  if len(weights) != len(runs):
    raise ValueError(f"{len(weights)} weights for {len(runs)} runs")
  fused: dict[int, float] = {}
  for run, w in zip(runs, weights):
    for rank, (doc, _) in enumerate(run, start=1):
      fused[doc] = fused.get(doc, 0.0) + w / (rrf_k + rank)
  order = sorted(fused.items(), key=lambda item: (-item[1], item[0]))
  return order[:k]


class Searcher(Protocol):
  num_docs: int

  def search_batch(self, queries: Sequence[str], k: int) -> list[Hits]: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class HybridConfig:
  """Dense + BM25 through reciprocal-rank fusion."""

  depth: int = 50  # hits taken from each retriever before fusing (>= the k asked for)
  rrf_k: float = 60.0  # RRF's rank offset: larger flattens the weight of the top ranks
  dense_weight: float = 1.0  # weight of the dense ranking in the fused score
  bm25_weight: float = 1.0  # weight of the BM25 ranking in the fused score
  # The BM25 side of an index directory: "bm25" (bm25s in memory) or "tantivy" (on disk).
  sparse: Literal["bm25", "tantivy"] = "bm25"

  def __post_init__(self) -> None:
    if self.sparse not in ("bm25", "tantivy"):
      raise ConfigValueError(f"HybridConfig.sparse={self.sparse!r}: expected bm25 or tantivy")
    if self.depth < 1:
      raise ConfigValueError(f"HybridConfig.depth={self.depth}: must be >= 1")
    if self.rrf_k < 0:
      raise ConfigValueError(f"HybridConfig.rrf_k={self.rrf_k}: must be >= 0")


class HybridRetriever:
  """Dense and BM25 over the same passage ids, fused by RRF; each side runs one batched call."""

  backend = "hybrid"

  def __init__(self, dense: Searcher, bm25: Searcher, cfg: HybridConfig = HybridConfig()):
    self.dense = dense
    self.bm25 = bm25
    self.cfg = cfg

  @property
  def num_docs(self) -> int:
    return int(self.dense.num_docs)

  def search_batch(self, queries: Sequence[str], k: int) -> list[Hits]:
    if not queries:
      return []
    depth = max(k, self.cfg.depth)
    dense = self.dense.search_batch(queries, depth)
    sparse = self.bm25.search_batch(queries, depth)
    weights = (self.cfg.dense_weight, self.cfg.bm25_weight)
    return [
      reciprocal_rank_fusion([d, s], k=k, rrf_k=self.cfg.rrf_k, weights=weights)
      for d, s in zip(dense, sparse)
    ]

  search = search_batch
