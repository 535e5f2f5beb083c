"""BM25 at wiki-18 scale: build time, peak memory, index size and query throughput vs corpus size.

Run with no arguments: `.venv/bin/python benchmarks/retrieval_scale.py` (about 20 minutes on 2
cores). Synthetic 100-word passages (a Zipfian vocabulary whose 150 most frequent words are
English stopwords, as in real text; seed 0), written streamed to a temporary JSONL, 5 passages a
page. For each BM25 backend and each size (250k, 1M, 2M passages): `asearcher`'s own build in a
child process (its wall time and peak RSS via getrusage, the index size on disk). bm25s is
skipped above the first size at which its build exceeds `--bm25s_limit_s` (it holds the corpus
and its token matrix in memory). Then, over each tantivy index, the real server
(`asearcher serve-retrieval` as a subprocess) under 32 concurrent one-query `/retrieve` clients
(aiohttp on loopback): q/s, p50, p99; over the largest index with 1 and 2 worker threads and 2
worker processes (their ratios to 1 thread). The last line is one JSON object (keys `backends`,
`curve`, `qps_c32_2m`, `p99_ms_c32_2m`, `peak_rss_gb_2m`, `workers_ratio_2_over_1`,
`workers_ratio_2proc_over_1`, `projection_21m`). Targets for tantivy: peak RSS at
2M <= 3 GB, >= 100 q/s at c32 over 2M. `--sizes 2000,4000` runs the same at small sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES = (250_000, 1_000_000, 2_000_000)
BACKENDS = ("bm25", "tantivy")  # bm25: bm25s (in memory); tantivy: on disk
VOCAB = 200_000
ZIPF_S = 1.05
WORDS_PER_PASSAGE = 100
PASSAGES_PER_PAGE = 5
QUERY_WORDS = 6
CONCURRENCY = 32
TOPK = 5
WIKI18_PASSAGES = 21_000_000


def _vocabulary(rng: np.random.Generator) -> list[str]:
  """Rank order: the bm25s English stopwords first (they are the commonest words of real
  text, and both backends drop them), then random lowercase words of 3-10 letters."""
  from asearcher_jax.tools.retrieval.tantivy_index import _stopwords

  stop = [w for w in _stopwords("en") if w.isalpha() and len(w) > 1][:150]
  letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
  words, seen = list(stop), set(stop)
  while len(words) < VOCAB:
    w = "".join(letters[rng.integers(0, 26, int(rng.integers(3, 11)))])
    if w not in seen:
      seen.add(w)
      words.append(w)
  return words


_VOCABULARY: list[str] = []


class Zipf:
  """Deterministic word streams from the Zipfian vocabulary (one vocabulary, seed 0, for the
  corpus and the queries alike; `seed` only draws the stream)."""

  def __init__(self, seed: int = 0) -> None:
    if not _VOCABULARY:
      _VOCABULARY.extend(_vocabulary(np.random.default_rng(0)))
    self.rng = np.random.default_rng(seed)
    self.words = np.array(_VOCABULARY, dtype=object)
    p = 1.0 / np.arange(1, VOCAB + 1) ** ZIPF_S
    self.cdf = np.cumsum(p / p.sum())

  def sample(self, rows: int, cols: int) -> np.ndarray:
    ranks = np.searchsorted(self.cdf, self.rng.random((rows, cols)))
    return self.words[np.minimum(ranks, VOCAB - 1)]


def write_corpus(path: Path, n: int, seed: int = 0) -> None:
  """n passages as wiki-18 jsonl, generated and written in chunks (never all in memory)."""
  zipf = Zipf(seed)
  with open(path, "w", encoding="utf-8") as f:
    for start in range(0, n, 10_000):
      rows = zipf.sample(min(10_000, n - start), WORDS_PER_PASSAGE)
      lines = []
      for j, row in enumerate(rows):
        i = start + j
        title = f"Synthetic page {i // PASSAGES_PER_PAGE}"
        lines.append(json.dumps({"id": str(i), "contents": f'"{title}"\n' + " ".join(row)}))
      f.write("\n".join(lines) + "\n")


def make_queries(n: int, seed: int = 1) -> list[str]:
  return [" ".join(r) for r in Zipf(seed).sample(n, QUERY_WORDS)]


def child_build(backend: str, corpus: str, index_dir: str) -> None:
  """Runs in a child process: one build, then its own peak RSS (getrusage) as one JSON line."""
  from asearcher_jax.tools.retrieval.index import build_index_dir

  t0 = time.perf_counter()
  m = build_index_dir(corpus=[Path(corpus)], index_dir=Path(index_dir), backend=backend,
                      force=True, show_progress=False)  # fmt: skip
  wall = time.perf_counter() - t0
  peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
  print(json.dumps({"build_s": wall, "peak_rss_gb": peak_kb * 1024 / 1e9,
                    "num_passages": m["num_passages"]}))  # fmt: skip


def dir_bytes(path: Path) -> int:
  return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def build(backend: str, corpus: Path, index_dir: Path, limit_s: float) -> dict:
  cmd = [sys.executable, __file__, "--child_build", backend, str(corpus), str(index_dir)]
  try:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s, cwd=REPO)
  except subprocess.TimeoutExpired:
    shutil.rmtree(index_dir, ignore_errors=True)
    return {"skipped": f"build exceeded {limit_s:g} s"}
  if r.returncode != 0:
    tail = r.stderr.strip().splitlines()[-1:] or ["?"]
    return {"skipped": f"build failed ({r.returncode}): {tail[0][:200]}"}
  out = json.loads(r.stdout.strip().splitlines()[-1])
  out["disk_gb"] = dir_bytes(index_dir) / 1e9
  return out


def start_server(
  index_dir: Path, addr_dir: Path, workers: int, kind: str = "thread"
) -> tuple[subprocess.Popen, str]:
  shutil.rmtree(addr_dir, ignore_errors=True)
  proc = subprocess.Popen(
    [sys.executable, "-m", "asearcher_jax.main", "serve-retrieval",
     f"--gin_param=serve_retrieval.serve.index_dir='{index_dir}'",
     "--gin_param=server.RetrievalServerConfig.port=0",
     f"--gin_param=server.RetrievalServerConfig.addr_dir='{addr_dir}'",
     f"--gin_param=server.RetrievalServerConfig.workers={workers}",
     f"--gin_param=server.RetrievalServerConfig.worker_kind='{kind}'",
     "--log_level=WARNING"],
    cwd=REPO, env={**os.environ, "ASEARCHER_COMPILE_CACHE": "off"},
  )  # fmt: skip
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline:
    files = list(addr_dir.glob("Host*_IP*.txt")) if addr_dir.exists() else []
    if files:
      return proc, files[0].read_text().strip()
    if proc.poll() is not None:
      raise RuntimeError(f"server exited with {proc.returncode}")
    time.sleep(0.05)
  proc.kill()
  raise RuntimeError("server did not announce itself within 300 s")


async def load(address: str, queries: list[str], seconds: float, warmup_s: float) -> dict:
  """32 closed-loop clients for warmup_s, then `seconds` measured."""
  import aiohttp

  url = f"http://{address}/retrieve"
  latencies: list[float] = []
  errors = 0
  stop_at = [0.0]
  measuring = [False]
  connector = aiohttp.TCPConnector(limit=CONCURRENCY)
  async with aiohttp.ClientSession(
    connector=connector, timeout=aiohttp.ClientTimeout(total=60)
  ) as session:

    async def client(c: int) -> None:
      nonlocal errors
      i = c
      while time.perf_counter() < stop_at[0]:
        payload = {"queries": [queries[i % len(queries)]], "topk": TOPK}
        i += CONCURRENCY
        t0 = time.perf_counter()
        async with session.post(url, json=payload) as resp:
          body = await resp.read()
        if resp.status != 200 or not body.startswith(b'{"result"'):
          errors += 1
        if measuring[0]:
          latencies.append(time.perf_counter() - t0)

    stop_at[0] = time.perf_counter() + warmup_s
    await asyncio.gather(*(client(c) for c in range(CONCURRENCY)))
    measuring[0] = True
    t0 = time.perf_counter()
    stop_at[0] = t0 + seconds
    await asyncio.gather(*(client(c) for c in range(CONCURRENCY)))
    wall = time.perf_counter() - t0
  ms = np.asarray(latencies) * 1000
  return {"qps": len(latencies) / wall, "p50_ms": float(np.percentile(ms, 50)),
          "p99_ms": float(np.percentile(ms, 99)), "requests": len(latencies), "errors": errors}  # fmt: skip


def serve_and_load(
  index_dir: Path, tmp: Path, workers: int, seconds: float, kind: str = "thread"
) -> dict:
  proc, address = start_server(index_dir, tmp / "addrs", workers, kind)
  try:
    out = asyncio.run(load(address, make_queries(4000), seconds, warmup_s=min(3.0, seconds)))
  finally:
    proc.terminate()
    proc.wait(30)
  return {"workers": workers, "worker_kind": kind, **out}


def _fit_power(xs: list[float], ys: list[float]) -> tuple[float, float]:
  """y = a * x**b by least squares in log space (b = 1 for a single point: linear)."""
  if len(xs) < 2:
    return ys[0] / xs[0], 1.0
  b, loga = np.polyfit(np.log(xs), np.log(ys), 1)
  return float(np.exp(loga)), float(b)


def projection(curve: list[dict], backend: str) -> dict | None:
  """wiki-18's 21M passages from the measured curve, each figure a power law fitted over the
  sizes measured (one size: linear; q/s inversely proportional): build time and disk about
  linear, q/s falling with the postings a query reads."""
  rows = [r for r in curve if r["backend"] == backend and "build_s" in r]
  if not rows:
    return None
  n = [r["passages"] for r in rows]
  out: dict = {"passages": WIKI18_PASSAGES}
  for key in ("build_s", "disk_gb"):
    a, b = _fit_power(n, [r[key] for r in rows])
    out[key] = a * WIKI18_PASSAGES**b
  # Fitted like the others: pessimistic for tantivy, whose writer heap (`writer_heap_mb`, 1 GB)
  # fills up to ~2M passages and then bounds the build.
  a, b = _fit_power(n, [r["peak_rss_gb"] for r in rows])
  out["peak_rss_gb"] = a * WIKI18_PASSAGES**b
  q = [(r["passages"], r["qps_c32"]) for r in rows if "qps_c32" in r]
  if q:
    if len(q) > 1:
      a, b = _fit_power([x for x, _ in q], [y for _, y in q])
      out["qps_c32"] = a * WIKI18_PASSAGES**b
    else:  # one point: q/s inversely proportional to the corpus (pessimistic)
      out["qps_c32"] = q[0][1] * q[0][0] / WIKI18_PASSAGES
  return out


def run(
  sizes: tuple[int, ...],
  backends: tuple[str, ...] = BACKENDS,
  *,
  qps_seconds: float = 15.0,
  bm25s_limit_s: float = 300.0,
  build_limit_s: float = 1800.0,
  tmp_dir: Path | None = None,
) -> dict:
  """The benchmark's core (the test runs it at tiny sizes)."""
  with tempfile.TemporaryDirectory(prefix="retrieval_scale_", dir=tmp_dir) as tmp_name:
    tmp = Path(tmp_name)
    curve: list[dict] = []
    skip_from: dict[str, str] = {}
    largest = max(sizes)
    for size in sorted(sizes):
      corpus = tmp / f"corpus_{size}.jsonl"
      t0 = time.perf_counter()
      write_corpus(corpus, size)
      corpus_gb = corpus.stat().st_size / 1e9
      print(f"[scale] corpus {size}: {corpus_gb:.2f} GB in {time.perf_counter() - t0:.0f} s",
            file=sys.stderr, flush=True)  # fmt: skip
      for backend in backends:
        row: dict = {"backend": backend, "passages": size}
        if backend in skip_from:
          row["skipped"] = skip_from[backend]
          curve.append(row)
          continue
        index_dir = tmp / f"index_{backend}_{size}"
        limit = bm25s_limit_s if backend == "bm25" else build_limit_s
        row |= build(backend, corpus, index_dir, limit)
        if "skipped" in row:
          skip_from[backend] = f"{row['skipped']} at {size} passages"
        elif backend == "tantivy":
          workers = [1, 2] if size == largest else [2]
          loads = {w: serve_and_load(index_dir, tmp, w, qps_seconds) for w in workers}
          row |= {"qps_c32": loads[2]["qps"], "p50_ms_c32": loads[2]["p50_ms"],
                  "p99_ms_c32": loads[2]["p99_ms"], "errors": loads[2]["errors"]}  # fmt: skip
          if 1 in loads:
            row["qps_c32_1_worker"] = loads[1]["qps"]
            row["workers_ratio_2_over_1"] = loads[2]["qps"] / loads[1]["qps"]
            procs = serve_and_load(index_dir, tmp, 2, qps_seconds, "process")
            row["qps_c32_2_processes"] = procs["qps"]
            row["p99_ms_c32_2_processes"] = procs["p99_ms"]
            row["workers_ratio_2proc_over_1"] = procs["qps"] / loads[1]["qps"]
        elif backend == "bm25" and size == min(sizes):  # its baseline at the smallest size
          load2 = serve_and_load(index_dir, tmp, 2, qps_seconds)
          row |= {"qps_c32": load2["qps"], "p99_ms_c32": load2["p99_ms"]}
        print(f"[scale] {json.dumps(row)}", file=sys.stderr, flush=True)
        curve.append(row)
        shutil.rmtree(index_dir, ignore_errors=True)
      corpus.unlink()
  top = next((r for r in curve if r["backend"] == "tantivy" and r["passages"] == largest), {})
  return {
    "benchmark": "retrieval_scale",
    "sizes": list(sizes),
    "backends": list(backends),
    "chosen": "tantivy",
    "cpus": os.cpu_count(),
    "curve": curve,
    "largest": largest,
    "qps_c32_2m": top.get("qps_c32"),
    "p50_ms_c32_2m": top.get("p50_ms_c32"),
    "p99_ms_c32_2m": top.get("p99_ms_c32"),
    "peak_rss_gb_2m": top.get("peak_rss_gb"),
    "build_s_2m": top.get("build_s"),
    "disk_gb_2m": top.get("disk_gb"),
    "workers_ratio_2_over_1": top.get("workers_ratio_2_over_1"),
    "workers_ratio_2proc_over_1": top.get("workers_ratio_2proc_over_1"),
    "projection_21m": {b: projection(curve, b) for b in backends},
  }


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated passages")
  p.add_argument("--backends", default=",".join(BACKENDS))
  p.add_argument("--qps_seconds", type=float, default=15.0)
  p.add_argument("--bm25s_limit_s", type=float, default=300.0)
  p.add_argument("--child_build", nargs=3, metavar=("BACKEND", "CORPUS", "INDEX_DIR"))
  a = p.parse_args()
  if a.child_build:
    child_build(*a.child_build)
    return
  sizes = tuple(int(s) for s in a.sizes.split(","))
  result = run(sizes, tuple(a.backends.split(",")), qps_seconds=a.qps_seconds,
               bm25s_limit_s=a.bm25s_limit_s)  # fmt: skip
  print(json.dumps(result))


if __name__ == "__main__":
  main()
