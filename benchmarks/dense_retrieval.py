"""Dense retrieval at scale: faiss IVF-PQ and HNSW over synthetic embeddings, and e5 encoding speed.

Run with no arguments: `.venv/bin/python benchmarks/dense_retrieval.py` (`--n` for a smaller run).
Vectors: `--n` (1M) unit vectors of `--dim` (384: e5-small's width; e5-base's 768 doubles every
figure's time and memory, too slow on 2 shared cores) drawn from a Gaussian mixture of 1000
clusters in a 48-dim latent space, mapped linearly to `dim` plus isotropic noise: clustered and of
low intrinsic dimension like real text embeddings, so approximate search has neighbours worth
finding. Each index is built with `dense_index.build_from_vectors` (streamed in shards), written,
re-loaded memory-mapped and searched with 320 queries in batches of 32; recall@10 is
|top-10 ∩ exact top-10| / 10 against the Flat (exact) index. nprobe / efSearch are swept and the
smallest setting reaching recall 0.9 is reported. HNSW runs over the first `--hnsw-n` vectors
(building an HNSW graph over 1M vectors takes longer than this run on 2 shared cores).
The encoder part times `E5Encoder.encode` on ~12-word queries with random weights at batch 1, 8
and 32 for a small config and for e5-base's shape. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asearcher_jax.tools.retrieval import dense_index as di  # noqa: E402

QUERIES = 320
BATCH = 32
K = 10
TARGET_RECALL = 0.9
NPROBES = (4, 8, 16, 32, 64, 128)
EF_SEARCHES = (16, 32, 64, 128, 256)


def rss_mb() -> float:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return 0.0


class Synthetic:
  """Gaussian-mixture embeddings with a low-dimensional latent structure (see the docstring)."""

  def __init__(self, dim: int, *, clusters: int = 1000, latent: int = 48, seed: int = 0):
    g = np.random.default_rng(seed)
    self.centers = g.standard_normal((clusters, latent)).astype(np.float32)
    self.proj = (g.standard_normal((latent, dim)) / np.sqrt(latent)).astype(np.float32)
    self.dim = dim

  def sample(self, n: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    z = self.centers[g.integers(0, len(self.centers), n)]
    z = z + 0.7 * g.standard_normal(z.shape, dtype=np.float32)
    x = z @ self.proj + 0.05 * g.standard_normal((n, self.dim), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)

  def write(self, path: Path, n: int, chunk: int = 65536) -> np.ndarray:
    """n vectors into an .npy memmap (the corpus the builds stream from), chunk by chunk."""
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, self.dim))
    for i, start in enumerate(range(0, n, chunk)):
      out[start : start + chunk] = self.sample(min(chunk, n - start), seed=1000 + i)
    out.flush()
    return np.load(path, mmap_mode="r")


def _stream(x: np.ndarray, chunk: int = 65536):
  for start in range(0, x.shape[0], chunk):
    yield np.asarray(x[start : start + chunk])


def _recall(hits: list[di.Hits], truth: list[di.Hits]) -> float:
  return float(
    np.mean([len({d for d, _ in h} & {d for d, _ in t}) / K for h, t in zip(hits, truth)])
  )


def _search_all(
  index: di.DenseIndex, queries: np.ndarray, batch: int
) -> tuple[list[di.Hits], float]:
  t0 = time.perf_counter()
  hits: list[di.Hits] = []
  for start in range(0, len(queries), batch):
    hits += index.search_vectors(queries[start : start + batch], K)
  return hits, len(queries) / (time.perf_counter() - t0)


def bench_index(
  x: np.ndarray,
  queries: np.ndarray,
  truth: list[di.Hits] | None,
  cfg: di.DenseIndexConfig,
  workdir: Path,
  sweep: tuple[str, tuple[int, ...]] | None,
) -> dict:
  """Build, reload memory-mapped, sweep the search knob; one index kind's figures."""
  directory = workdir / cfg.kind
  rss0 = rss_mb()
  info = di.build_from_vectors(_stream(x), directory, cfg)
  build_rss = rss_mb() - rss0
  rss1 = rss_mb()
  t0 = time.perf_counter()
  index = di.DenseIndex.load(directory)
  load_s = time.perf_counter() - t0
  load_rss = rss_mb() - rss1
  out = {
    "n": int(x.shape[0]),
    "factory": info["factory"],
    "build_s": info["build_s"],
    "train_s": info["train_s"],
    "index_bytes": info["index_bytes"],
    "bytes_per_vector": round(info["index_bytes"] / x.shape[0], 1),
    "build_rss_growth_mb": round(build_rss, 1),
    "load_s": round(load_s, 3),
    "load_rss_mb": round(load_rss, 1),
  }
  if truth is None:  # the exact index: its own hits are the truth
    hits, qps = _search_all(index, queries, BATCH)
    _, qps1 = _search_all(index, queries[:8], 1)  # each query scans every vector
    out.update(qps_batched=round(qps, 1), qps_batch1=round(qps1, 1), hits=hits)
    return out
  knob, values = sweep
  rows = []
  for v in values:
    index = di.DenseIndex(index.index, index.doc_ids, dataclasses.replace(cfg, **{knob: v}))
    hits, qps = _search_all(index, queries, BATCH)
    rows.append(
      {knob: v, "recall_at_10": round(_recall(hits, truth), 4), "qps_batched": round(qps, 1)}
    )
  chosen = next((r for r in rows if r["recall_at_10"] >= TARGET_RECALL), rows[-1])
  index = di.DenseIndex(
    index.index, index.doc_ids, dataclasses.replace(cfg, **{knob: chosen[knob]})
  )
  _, qps1 = _search_all(index, queries[:64], 1)
  out.update(
    sweep=rows,
    chosen={knob: chosen[knob]},
    recall_at_10=chosen["recall_at_10"],
    qps_batched=chosen["qps_batched"],
    qps_batch1=round(qps1, 1),
    search_rss_mb=round(rss_mb() - rss1, 1),
  )
  print(json.dumps({cfg.kind: out}), file=sys.stderr, flush=True)  # figures so far, if cut short
  if cfg.kind == "ivfpq":  # the same index ranked by PQ codes alone (refine over k candidates)
    pq_only = di.DenseIndex(
      index.index,
      index.doc_ids,
      dataclasses.replace(cfg, nprobe=chosen["nprobe"], refine_k_factor=1),
    )
    out["pq_only_recall_at_10"] = round(_recall(_search_all(pq_only, queries, BATCH)[0], truth), 4)
  return out


def bench_encoder(
  hidden: int, layers: int, heads: int, inter: int, batches=(1, 8, 32), reps: int = 3
) -> dict:
  """E5Encoder.encode q/s with random weights on ~12-word queries (jit compile excluded)."""
  from flax import nnx
  from tokenizers import Tokenizer, models, pre_tokenizers

  from asearcher_jax.tools.retrieval import e5

  words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "query", ":", *[f"w{i}" for i in range(2000)]]
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  cfg = e5.BertConfig(
    vocab_size=30522,
    hidden_size=hidden,
    num_layers=layers,
    num_heads=heads,
    intermediate_size=inter,
  )
  encoder = e5.E5Encoder(e5.BertEncoder(cfg, rngs=nnx.Rngs(0)), tok)
  g = np.random.default_rng(0)
  queries = [" ".join(f"w{j}" for j in g.integers(0, 2000, 12)) for _ in range(max(batches) * reps)]
  out = {"config": f"hidden={hidden} layers={layers} heads={heads} ffn={inter}"}
  for b in batches:
    encoder.encode(queries[:b], kind="query")  # compile this bucket
    t0 = time.perf_counter()
    for r in range(reps):
      encoder.encode(queries[r * b : (r + 1) * b], kind="query")
    out[f"batch{b}"] = round(b * reps / (time.perf_counter() - t0), 1)
  return out


def run(
  *,
  n: int,
  dim: int,
  hnsw_n: int,
  ivfpq: di.DenseIndexConfig,
  hnsw: di.DenseIndexConfig,
  encoders: dict[str, tuple[int, int, int, int]],
  workdir: Path,
) -> dict:
  """The benchmark's core (the test runs it at a tiny size)."""
  data = Synthetic(dim)
  t0 = time.perf_counter()
  x = data.write(workdir / "vectors.npy", n)
  gen_s = time.perf_counter() - t0
  queries = data.sample(QUERIES, seed=1)
  flat = bench_index(x, queries, None, di.DenseIndexConfig(kind="flat"), workdir, None)
  truth = flat.pop("hits")
  ivf = bench_index(x, queries, truth, ivfpq, workdir, ("nprobe", NPROBES))
  hn = min(hnsw_n, n)
  hnsw_truth = truth
  if hn < n:
    exact = faiss.IndexFlatIP(dim)  # exact search over the prefix HNSW indexes
    exact.add(np.ascontiguousarray(x[:hn]))
    hnsw_truth = di.DenseIndex(exact, np.arange(hn)).search_vectors(queries, K)
  graph = bench_index(x[:hn], queries, hnsw_truth, hnsw, workdir, ("ef_search", EF_SEARCHES))
  encoder_qps = {name: bench_encoder(*shape) for name, shape in encoders.items()}
  return {
    "n": n,
    "dim": dim,
    "hnsw_n": hn,
    "queries": QUERIES,
    "batch": BATCH,
    "gen_s": round(gen_s, 1),
    "flat": flat,
    "ivfpq": ivf,
    "hnsw": graph,
    "recall_at_10": {"ivfpq": ivf["recall_at_10"], "hnsw": graph["recall_at_10"]},
    "qps_batched": {
      "flat": flat["qps_batched"],
      "ivfpq": ivf["qps_batched"],
      "hnsw": graph["qps_batched"],
    },
    "build_s": {"flat": flat["build_s"], "ivfpq": ivf["build_s"], "hnsw": graph["build_s"]},
    "index_bytes": {
      "flat": flat["index_bytes"],
      "ivfpq": ivf["index_bytes"],
      "hnsw": graph["index_bytes"],
    },
    "encoder_qps": encoder_qps,
    "threads": os.cpu_count(),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--n", type=int, default=1_000_000, help="vectors in the IVF-PQ index")
  parser.add_argument("--dim", type=int, default=384)
  parser.add_argument("--hnsw-n", type=int, default=100_000, help="vectors in the HNSW index")
  parser.add_argument(
    "--no-base-encoder", action="store_true", help="skip the e5-base-shaped encoder"
  )
  args = parser.parse_args()
  nlist = max(16, min(4096, int(np.sqrt(args.n))))
  ivfpq = di.DenseIndexConfig(kind="ivfpq", nlist=nlist, train_size=min(args.n, 40 * nlist))
  hnsw = di.DenseIndexConfig(kind="hnsw", hnsw_m=32, ef_construction=80)
  encoders = {"small": (128, 2, 4, 512)}
  if not args.no_base_encoder:
    encoders["e5_base_shape"] = (768, 12, 12, 3072)
  with tempfile.TemporaryDirectory(prefix="dense_bench_") as tmp:
    result = run(
      n=args.n,
      dim=args.dim,
      hnsw_n=args.hnsw_n,
      ivfpq=ivfpq,
      hnsw=hnsw,
      encoders=encoders,
      workdir=Path(tmp),
    )
  print(json.dumps(result))


if __name__ == "__main__":
  main()
