"""Retrieval server throughput and latency over the shipped corpus, against rank_bm25 in-process.

Run with no arguments: `.venv/bin/python benchmarks/retrieval.py`. It builds the BM25 index of the
shipped corpus (timed), starts `asearcher serve-retrieval` as a subprocess (so its RSS is its own),
sends one-query `/retrieve` requests from 1, 8 and 32 concurrent clients (HotpotQA-100 questions,
cycled), then runs the same queries through `rank_bm25.BM25Okapi` in-process with 1, 8 and 32
threads: the baseline a user would otherwise pick. Targets (2 cores): >= 500 queries/s at
concurrency 32, p99 < 100 ms, build < 60 s, server RSS < 1 GB. The last line is one JSON object.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asearcher_jax.tools.retrieval.corpus import asset_path, default_corpus_paths  # noqa: E402
from asearcher_jax.tools.retrieval.index import build_index_dir, load_index  # noqa: E402

CONCURRENCY = (1, 8, 32)
REQUESTS = {1: 600, 8: 3000, 32: 6000}  # per level, after a warm-up
BASELINE_QUERIES = 300  # rank_bm25 is ~100x slower: fewer queries keep the run short
TOPK = 5


def hotpotqa() -> list[dict]:
  with gzip.open(asset_path("qa/hipporag_hotpotqa_train100.json.gz"), "rt") as f:
    return json.load(f)


def recall_at_5(index_dir: Path, items: list[dict]) -> float:
  """Mean fraction of gold supporting titles in the top 5 for the raw question."""
  index = load_index(index_dir)
  hits = index.retriever.search_batch([q["question"] for q in items], 5)
  recalls = []
  for q, h in zip(items, hits):
    gold = {t for t, _ in q["supporting_facts"]}
    recalls.append(len(gold & {index.passages[i].title for i, _ in h}) / len(gold))
  return float(np.mean(recalls))


def percentiles(latencies_s: list[float]) -> tuple[float, float]:
  ms = np.asarray(latencies_s) * 1000
  return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


def rss_mb(pid: int) -> tuple[float, float]:
  """(current, peak) resident set size of a process, from /proc."""
  fields = {}
  for line in Path(f"/proc/{pid}/status").read_text().splitlines():
    key, _, value = line.partition(":")
    fields[key] = value.strip()
  return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def start_server(index_dir: Path, addr_dir: Path) -> tuple[subprocess.Popen, str]:
  proc = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "asearcher_jax.main",
      "serve-retrieval",
      f"--gin_param=serve_retrieval.serve.index_dir='{index_dir}'",
      "--gin_param=server.RetrievalServerConfig.port=0",
      f"--gin_param=server.RetrievalServerConfig.addr_dir='{addr_dir}'",
      "--log_level=WARNING",
    ],
    cwd=REPO,
  )
  deadline = time.monotonic() + 120
  while time.monotonic() < deadline:
    files = list(addr_dir.glob("Host*_IP*.txt"))
    if files:
      return proc, files[0].read_text().strip()
    if proc.poll() is not None:
      raise RuntimeError(f"server exited with {proc.returncode}")
    time.sleep(0.05)
  proc.kill()
  raise RuntimeError("server did not announce itself within 120 s")


async def load(address: str, queries: list[str], concurrency: int, total: int) -> dict:
  url = f"http://{address}/retrieve"
  latencies: list[float] = []
  errors = 0
  counter = iter(range(total))
  connector = aiohttp.TCPConnector(limit=concurrency)
  timeout = aiohttp.ClientTimeout(total=30)
  async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

    async def worker() -> None:
      nonlocal errors
      for i in counter:
        payload = {"queries": [queries[i % len(queries)]], "topk": TOPK}
        t0 = time.perf_counter()
        async with session.post(url, json=payload) as resp:
          body = await resp.read()
          if resp.status != 200 or not body.startswith(b'{"result"'):
            errors += 1
        latencies.append(time.perf_counter() - t0)

    warm = iter(range(min(200, total)))
    counter, real = warm, counter
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    latencies.clear()
    counter = real
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
  p50, p99 = percentiles(latencies)
  return {"qps": len(latencies) / wall, "p50_ms": p50, "p99_ms": p99, "errors": errors}


def baseline(queries: list[str]) -> dict[int, dict]:
  """rank_bm25 over the same passages and the same tokenization (stemmed, no stopwords)."""
  from rank_bm25 import BM25Okapi

  with tempfile.TemporaryDirectory() as tmp:
    build_index_dir(corpus=default_corpus_paths(), index_dir=Path(tmp), show_progress=False)
    index = load_index(Path(tmp))
  tok = index.retriever
  vocab_inverse = {v: k for k, v in tok.model.vocab_dict.items()}

  def words(text: str) -> list[str]:
    return [vocab_inverse[i] for i in tok.query_token_ids(text)]

  t0 = time.perf_counter()
  bm25 = BM25Okapi([words(p.contents) for p in index.passages])
  build_s = time.perf_counter() - t0
  qs = [queries[i % len(queries)] for i in range(BASELINE_QUERIES)]
  out: dict[int, dict] = {"build_s": build_s}  # type: ignore[dict-item]
  for c in CONCURRENCY:
    latencies: list[float] = []
    lock = threading.Lock()

    def one(q: str, latencies: list[float] = latencies, lock: threading.Lock = lock) -> None:
      t = time.perf_counter()
      scores = bm25.get_scores(words(q))
      np.argpartition(-scores, TOPK)[:TOPK]
      with lock:
        latencies.append(time.perf_counter() - t)

    with ThreadPoolExecutor(max_workers=c) as pool:
      t0 = time.perf_counter()
      list(pool.map(one, qs))
      wall = time.perf_counter() - t0
    p50, p99 = percentiles(latencies)
    out[c] = {"qps": len(qs) / wall, "p50_ms": p50, "p99_ms": p99}
  return out


def main() -> None:
  items = hotpotqa()
  queries = [q["question"] for q in items]
  print(f"cores: {os.cpu_count()}, queries: {len(queries)} HotpotQA-100 questions (cycled)")
  with tempfile.TemporaryDirectory() as tmp:
    index_dir, addr_dir = Path(tmp) / "index", Path(tmp) / "addrs"
    t0 = time.perf_counter()
    manifest = build_index_dir(
      corpus=default_corpus_paths(), index_dir=index_dir, show_progress=False, force=True
    )
    build_s = time.perf_counter() - t0
    print(f"index build: {manifest['num_passages']} passages in {build_s:.2f} s")
    recall = recall_at_5(index_dir, items)
    print(f"HotpotQA-100 gold-title recall@5 (one search, raw question): {recall:.3f}")
    t0 = time.perf_counter()
    proc, address = start_server(index_dir, addr_dir)
    start_s = time.perf_counter() - t0
    print(f"server up at {address} in {start_s:.2f} s (pid {proc.pid})")
    results = {}
    try:
      for c in CONCURRENCY:
        r = asyncio.run(load(address, queries, c, REQUESTS[c]))
        results[c] = r
        print(
          f"server    c={c:<3d} {r['qps']:8.0f} q/s  p50 {r['p50_ms']:6.2f} ms  "
          f"p99 {r['p99_ms']:6.2f} ms  errors {r['errors']}"
        )
      rss, peak = rss_mb(proc.pid)
      print(f"server RSS {rss:.0f} MB (peak {peak:.0f} MB)")
    finally:
      proc.terminate()
      proc.wait(timeout=30)
  base = baseline(queries)
  print(f"rank_bm25 build (in-process, tokens given): {base['build_s']:.2f} s")
  for c in CONCURRENCY:
    b = base[c]
    print(
      f"rank_bm25 c={c:<3d} {b['qps']:8.0f} q/s  p50 {b['p50_ms']:6.2f} ms  p99 {b['p99_ms']:6.2f} ms"
    )
  summary = {
    "qps_c32": round(results[32]["qps"], 1),
    "p99_ms_c32": round(results[32]["p99_ms"], 2),
    "baseline_qps_c32": round(base[32]["qps"], 1),
    "build_s": round(build_s, 2),
    "rss_mb": round(peak, 1),
    "recall_at5": round(recall, 3),
    "speedup_c32": round(results[32]["qps"] / base[32]["qps"], 1),
    "server_start_s": round(start_s, 2),
    "errors": sum(r["errors"] for r in results.values()),
    "cores": os.cpu_count(),
  }
  for c in (1, 8):
    summary[f"qps_c{c}"] = round(results[c]["qps"], 1)
    summary[f"p99_ms_c{c}"] = round(results[c]["p99_ms"], 2)
    summary[f"baseline_qps_c{c}"] = round(base[c]["qps"], 1)
  for c in CONCURRENCY:
    summary[f"p50_ms_c{c}"] = round(results[c]["p50_ms"], 2)
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
