"""benchmarks/dense_retrieval.py's core at a tiny size: every key, recall against exact search."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("faiss")

from asearcher_jax.tools.retrieval import dense_index as di

REPO = Path(__file__).resolve().parents[2]


def _bench():
  spec = importlib.util.spec_from_file_location(
    "dense_bench", REPO / "benchmarks" / "dense_retrieval.py"
  )
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.slow  # ~15 s on 2 shared cores (faiss training, one encoder compile per batch size)
def test_dense_benchmark_core_runs_small(tmp_path: Path) -> None:
  bench = _bench()
  out = bench.run(
    n=4000,
    dim=32,
    hnsw_n=2000,
    ivfpq=di.DenseIndexConfig(kind="ivfpq", nlist=32, m=8, train_size=4000),
    hnsw=di.DenseIndexConfig(kind="hnsw", hnsw_m=16, ef_construction=40),
    encoders={"tiny": (16, 1, 2, 32)},
    workdir=tmp_path,
  )
  for key in (
    "ivfpq",
    "hnsw",
    "recall_at_10",
    "qps_batched",
    "build_s",
    "index_bytes",
    "encoder_qps",
  ):
    assert key in out
  assert out["hnsw"]["n"] == 2000 and out["ivfpq"]["n"] == 4000
  assert out["recall_at_10"]["ivfpq"] >= 0.9 and out["recall_at_10"]["hnsw"] >= 0.9
  # PQ codes are smaller than the float32 vectors a Flat index keeps (refine copies are fp16).
  assert out["ivfpq"]["index_bytes"] < out["flat"]["index_bytes"]
  assert out["ivfpq"]["pq_only_recall_at_10"] <= out["recall_at_10"]["ivfpq"]
  assert set(out["encoder_qps"]["tiny"]) == {"config", "batch1", "batch8", "batch32"}
  assert all(out["encoder_qps"]["tiny"][f"batch{b}"] > 0 for b in (1, 8, 32))
