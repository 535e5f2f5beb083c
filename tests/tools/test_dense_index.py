"""faiss dense indexes: sharded builds, mmap loads, files written by faiss itself, RRF fusion."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from asearcher_jax.errors import ConfigValueError
from asearcher_jax.tools.retrieval import dense_index as di

faiss = pytest.importorskip("faiss")

DIM = 32


def _vectors(n: int, seed: int) -> np.ndarray:
  """Clustered unit vectors with a low intrinsic dimension (like text embeddings)."""
  g = np.random.default_rng(seed)
  centers = np.random.default_rng(0).standard_normal((20, 8))
  proj = np.random.default_rng(1).standard_normal((8, DIM))
  z = centers[g.integers(0, 20, n)] + 0.5 * g.standard_normal((n, 8))
  x = (z @ proj + 0.05 * g.standard_normal((n, DIM))).astype(np.float32)
  return x / np.linalg.norm(x, axis=1, keepdims=True)


def _exact(base: np.ndarray, q: np.ndarray, k: int) -> np.ndarray:
  return np.argsort(-(q @ base.T), axis=1, kind="stable")[:, :k]


def _recall(hits: list[di.Hits], truth: np.ndarray, offset: int = 0) -> float:
  found = [
    len({d - offset for d, _ in h} & set(t.tolist())) / truth.shape[1] for h, t in zip(hits, truth)
  ]
  return float(np.mean(found))


class FakeEncoder:
  """Maps query "q<i>" to the i-th of a fixed set of vectors; counts calls."""

  def __init__(self, vectors: np.ndarray):
    self.vectors = vectors
    self.calls: list[tuple[int, str]] = []

  def encode(self, texts, *, kind):
    self.calls.append((len(texts), kind))
    return self.vectors[[int(t[1:]) for t in texts]]


class CountingIndex:
  """A faiss index proxy counting `search` calls (the batch must be one call)."""

  def __init__(self, inner):
    self.inner, self.searches = inner, 0

  def __getattr__(self, name):
    return getattr(self.inner, name)

  def search(self, q, k):
    self.searches += 1
    return self.inner.search(q, k)


@pytest.mark.parametrize(
  "cfg",
  [
    di.DenseIndexConfig(kind="flat", shard_size=700),
    di.DenseIndexConfig(kind="hnsw", hnsw_m=16, ef_search=64, shard_size=700),
    di.DenseIndexConfig(kind="ivfpq", nlist=16, m=8, nprobe=8, train_size=2000, shard_size=700),
  ],
  ids=lambda c: c.kind,
)
def test_sharded_build_loads_memory_mapped_and_finds_neighbours(tmp_path: Path, cfg) -> None:
  base, queries = _vectors(3000, 1), _vectors(50, 2)
  batches = (base[i : i + 256] * 3.0 for i in range(0, 3000, 256))  # unnormalised in, unit stored
  info = di.build_from_vectors(batches, tmp_path, cfg, doc_ids=range(1000, 4000))
  assert info["ntotal"] == 3000 and info["dim"] == DIM and info["index_bytes"] > 0
  index = di.DenseIndex.load(tmp_path)
  assert index.kind == cfg.kind and index.num_docs == 3000
  assert isinstance(index.doc_ids, np.memmap)
  truth = _exact(base, queries, 10)
  hits = index.search_vectors(queries, 10)
  assert all(len(h) == 10 for h in hits)
  assert all(h[0][1] >= h[-1][1] for h in hits)
  assert _recall(hits, truth, offset=1000) >= (0.999 if cfg.kind == "flat" else 0.9)
  # A passage's own vector finds that passage first, under its doc id.
  own = index.search_vectors(base[[5, 2999]], 1)
  assert [h[0][0] for h in own] == [1005, 3999]


def test_ivfpq_trains_on_the_first_vectors_then_adds_every_shard(tmp_path: Path) -> None:
  cfg = di.DenseIndexConfig(kind="ivfpq", nlist=8, m=4, train_size=1000, shard_size=300)
  base = _vectors(2500, 3)
  info = di.build_from_vectors((base[i : i + 100] for i in range(0, 2500, 100)), tmp_path, cfg)
  assert info["factory"] == "IVF8,PQ4x8,Refine(SQfp16)" and info["ntotal"] == 2500
  no_refine = di.DenseIndexConfig(kind="ivfpq", nlist=8, m=4, refine_k_factor=0)
  assert no_refine.factory_string(DIM) == "IVF8,PQ4x8"


def test_serves_an_index_file_written_by_plain_faiss(tmp_path: Path) -> None:
  """As with Search-R1's prebuilt e5_Flat.index: rows are passage ids, no files of ours."""
  base, queries = _vectors(2000, 4), _vectors(8, 5)
  flat = faiss.IndexFlatIP(DIM)
  flat.add(base)
  faiss.write_index(flat, str(tmp_path / "e5_Flat.index"))
  quantizer = faiss.IndexFlatIP(DIM)
  ivf = faiss.IndexIVFFlat(quantizer, DIM, 16, faiss.METRIC_INNER_PRODUCT)
  ivf.train(base)
  ivf.add(base)
  faiss.write_index(ivf, str(tmp_path / "ivf.index"))

  index = di.DenseIndex.from_faiss_file(tmp_path / "e5_Flat.index")
  assert index.kind == "flat"
  truth = _exact(base, queries, 5)
  assert [[d for d, _ in h] for h in index.search_vectors(queries, 5)] == truth.tolist()
  ivf_index = di.DenseIndex.from_faiss_file(tmp_path / "ivf.index", di.DenseIndexConfig(nprobe=16))
  assert ivf_index.kind == "ivfpq" and faiss.extract_index_ivf(ivf_index.index).nprobe == 16
  assert _recall(ivf_index.search_vectors(queries, 5), truth) == 1.0  # all cells probed: exact

  np.save(tmp_path / "ids.npy", np.arange(2000, dtype=np.int64)[::-1].copy())
  encoder = FakeEncoder(queries)
  retriever = di.DenseRetriever(
    encoder, di.DenseIndex.from_faiss_file(tmp_path / "e5_Flat.index", doc_ids=tmp_path / "ids.npy")
  )
  counting = CountingIndex(retriever.index.index)
  retriever.index.index = counting
  hits = retriever.search([f"q{i}" for i in range(8)], 5)
  assert [[d for d, _ in h] for h in hits] == (1999 - truth).tolist()
  assert encoder.calls == [(8, "query")] and counting.searches == 1  # one encode, one search
  assert retriever.search([], 5) == [] and retriever.num_docs == 2000


@pytest.mark.slow  # ~15 s on 2 shared cores: jax start-up and two small compiles
def test_builds_from_text_with_the_e5_encoder(tmp_path: Path) -> None:
  """Passages stream through the real (randomly initialised) e5 encoder into an index."""
  from flax import nnx
  from tokenizers import Tokenizer, models, pre_tokenizers

  from asearcher_jax.tools.retrieval import e5

  words = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "query",
    "passage",
    ":",
    *[f"w{i}" for i in range(40)],
  ]
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  bert = e5.BertConfig(
    vocab_size=len(words), hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
    max_position_embeddings=32,
  )  # fmt: skip
  encoder = e5.E5Encoder(e5.BertEncoder(bert, rngs=nnx.Rngs(0)), tok, e5.E5Config(max_batch=8))
  texts = [" ".join(f"w{(i * 7 + j) % 40}" for j in range(i % 5 + 1)) for i in range(30)]
  cfg = di.DenseIndexConfig(kind="flat", encode_batch=8, shard_size=10)
  info = di.build_dense_index(iter(texts), encoder, tmp_path, cfg)
  assert info["ntotal"] == 30 and info["dim"] == 16
  retriever = di.DenseRetriever(encoder, di.DenseIndex.load(tmp_path))
  want = encoder.encode(texts[3:4], kind="passage")
  assert retriever.index.search_vectors(want, 1)[0][0][0] == 3


def test_reciprocal_rank_fusion() -> None:
  dense = [(7, 0.9), (3, 0.8), (5, 0.1)]
  bm25 = [(3, 12.0), (9, 11.0), (7, 2.0)]
  fused = di.reciprocal_rank_fusion([dense, bm25], k=10, rrf_k=60)
  assert [d for d, _ in fused] == [3, 7, 9, 5]  # 3 and 7 both ranked twice; 3: 1/62 + 1/61
  assert fused[0][1] == pytest.approx(1 / 62 + 1 / 61)
  assert fused[2][1] == pytest.approx(1 / 62) and fused[3][1] == pytest.approx(1 / 63)
  assert di.reciprocal_rank_fusion([dense, bm25], k=2) == fused[:2]
  # Weights: BM25 alone decides; a doc in one list only ties by doc id (deterministic).
  only_bm25 = di.reciprocal_rank_fusion([dense, bm25], k=3, weights=[0.0, 1.0])
  assert [d for d, _ in only_bm25] == [3, 9, 7]
  assert [d for d, _ in di.reciprocal_rank_fusion([[(4, 1.0)], [(2, 1.0)]], k=2)] == [2, 4]
  with pytest.raises(ValueError, match="weights"):
    di.reciprocal_rank_fusion([dense], k=1, weights=[1.0, 2.0])


def test_hybrid_retriever_fuses_one_batched_call_per_side() -> None:
  class Fixed:
    num_docs = 10

    def __init__(self, hits):
      self.hits, self.calls = hits, []

    def search_batch(self, queries, k):
      self.calls.append((list(queries), k))
      return [self.hits[:k] for _ in queries]

  dense = Fixed([(1, 0.9), (2, 0.5)])
  bm25 = Fixed([(2, 9.0), (3, 1.0)])
  hybrid = di.HybridRetriever(dense, bm25, di.HybridConfig(depth=20))
  out = hybrid.search_batch(["a", "b"], 2)
  assert out[0] == out[1] and [d for d, _ in out[0]] == [2, 1]
  assert dense.calls == [(["a", "b"], 20)] and bm25.calls == [(["a", "b"], 20)]
  assert hybrid.num_docs == 10


def test_config_errors_name_the_field() -> None:
  with pytest.raises(ConfigValueError, match=r"DenseIndexConfig\.kind"):
    di.DenseIndexConfig(kind="lsh")
  with pytest.raises(ConfigValueError, match=r"DenseIndexConfig\.nprobe"):
    di.DenseIndexConfig(nprobe=0)
  with pytest.raises(ConfigValueError, match=r"DenseIndexConfig\.m=5 must divide"):
    di.DenseIndexConfig(kind="ivfpq", m=5).factory_string(32)
  with pytest.raises(ConfigValueError, match=r"HybridConfig\.depth"):
    di.HybridConfig(depth=0)
