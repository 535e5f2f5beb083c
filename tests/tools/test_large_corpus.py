"""The large-corpus path: the streamed corpus, tantivy's on-disk passage and page store, the
server's batching over several workers, and the scale benchmark's core at a tiny size."""

from __future__ import annotations

import asyncio
import collections.abc
import json
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import aiohttp
import pytest

from asearcher_jax.tools.retrieval.corpus import CorpusError, wiki_url
from asearcher_jax.tools.retrieval.index import _stream_passages, build_index_dir, load_index
from asearcher_jax.tools.retrieval.server import (
  MicroBatcher,
  RetrievalServer,
  RetrievalServerConfig,
  retrieve_rows,
)
from asearcher_jax.tools.retrieval.tantivy_index import TantivyConfig

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = aiohttp.ClientTimeout(total=30)


def _corpus(path: Path, n: int, per_page: int = 3, words: int = 40) -> Path:
  with open(path, "w") as f:
    for i in range(n):
      title = f"Page {i // per_page}"
      text = " ".join(f"w{(i * 7 + j) % 997}" for j in range(words))
      f.write(json.dumps({"id": f"p{i}", "contents": f'"{title}"\n{text} part {i % per_page}'}))
      f.write("\n")
  return path


def _peak_python_mb(fn) -> float:
  tracemalloc.start()
  try:
    fn()
    return tracemalloc.get_traced_memory()[1] / 1e6
  finally:
    tracemalloc.stop()


def test_the_corpus_is_streamed_not_held(tmp_path: Path) -> None:
  """The loader is a generator, and a tantivy build's Python memory does not grow with the
  corpus: 10x the passages, about the same peak (the text would be ~10x)."""
  small = _corpus(tmp_path / "s.jsonl", 1_500, words=150)
  big = _corpus(tmp_path / "b.jsonl", 15_000, words=150)
  stream = _stream_passages([small])
  assert isinstance(stream, collections.abc.Iterator) and not isinstance(stream, list)
  assert next(stream).id == "p0"

  def build(path: Path, out: str):
    return lambda: build_index_dir(corpus=[path], index_dir=tmp_path / out, backend="tantivy",
                                   tantivy=TantivyConfig(writer_threads=1, writer_heap_mb=50),
                                   show_progress=False)  # fmt: skip

  build(small, "warm")()  # imports and one-time allocations out of the measurement
  peak_small, peak_big = _peak_python_mb(build(small, "s")), _peak_python_mb(build(big, "b"))
  text_mb = big.stat().st_size / 1e6  # ~13 MB; held as Python strings it would be more
  assert peak_big < 2 * peak_small + 1.0 and peak_big < text_mb / 4, (peak_small, peak_big, text_mb)
  assert load_index(tmp_path / "b").manifest["num_passages"] == 15_000


def test_access_and_lookup_from_the_on_disk_store(tmp_path: Path) -> None:
  corpus = _corpus(tmp_path / "c.jsonl", 30)
  build_index_dir(corpus=[corpus], index_dir=tmp_path / "ix", backend="tantivy",
                  show_progress=False)  # fmt: skip
  ix = load_index(tmp_path / "ix")
  assert len(ix.passages) == 30 and len(ix.pages) == 10
  assert ix.passages[4].id == "p4" and ix.passages[4].title == "Page 1"
  with pytest.raises(IndexError):
    ix.passages[30]
  # A page is its passages joined in corpus order, under any spelling of its URL.
  page = ix.pages.get("https://en.wikipedia.org/wiki/Page_1")
  assert page == ix.pages.get(wiki_url("Page 1"))
  assert page["url"] == wiki_url("Page 1") and page["title"] == "Page 1"
  parts = page["contents"].split("\n\n")
  assert parts[0] == "Page 1" and [p.split()[-1] for p in parts[1:]] == ["0", "1", "2"]
  assert ix.pages.get("https://en.wikipedia.org/wiki/Page_99") is None
  # A separate pages file is its own on-disk index.
  pages = tmp_path / "pages.jsonl"
  pages.write_text(json.dumps({"url": wiki_url("Page 2"), "contents": "The whole page."}) + "\n")
  build_index_dir(corpus=[corpus], index_dir=tmp_path / "ix2", backend="tantivy",
                  pages_file=pages, show_progress=False)  # fmt: skip
  ix2 = load_index(tmp_path / "ix2")
  assert len(ix2.pages) == 1
  assert ix2.pages.get("https://en.wikipedia.org/wiki/Page_2")["contents"] == "The whole page."
  assert ix2.pages.get(wiki_url("Page 1")) is None


def test_tantivy_refuses_duplicate_ids_and_empty_corpora(tmp_path: Path) -> None:
  dup = tmp_path / "dup.jsonl"
  dup.write_text('{"id": "1", "contents": "\\"A\\"\\nalpha"}\n{"id": "1", "contents": "beta"}\n')
  with pytest.raises(CorpusError, match="duplicate passage id '1'"):
    build_index_dir(corpus=[dup], index_dir=tmp_path / "a", backend="tantivy")
  empty = tmp_path / "e.jsonl"
  empty.write_text("\n")
  with pytest.raises(CorpusError, match="no passages"):
    build_index_dir(corpus=[empty], index_dir=tmp_path / "b", backend="tantivy")
  with pytest.raises(CorpusError, match="unknown index backend 'lucene'"):
    build_index_dir(corpus=[dup], index_dir=tmp_path / "c", backend="lucene")
  with pytest.raises(ValueError, match="writer_heap_mb must be >= 15 per writer thread"):
    TantivyConfig(writer_threads=4, writer_heap_mb=30)
  with pytest.raises(ValueError, match="workers must be an integer >= 1, got 0"):
    RetrievalServerConfig(workers=0)


async def test_batches_are_split_over_the_workers() -> None:
  """Concurrent requests under load: scored by two threads at once, each request its own
  answer, fewer scoring calls than requests."""
  running, peak, lock, calls = [0], [0], threading.Lock(), []

  def search(queries, k):
    with lock:
      running[0] += 1
      peak[0] = max(peak[0], running[0])
      calls.append(len(queries))
    time.sleep(0.05)  # releases the GIL, as tantivy's search does
    with lock:
      running[0] -= 1
    return [[({"q": q}, float(k))] for q in queries]

  from concurrent.futures import ThreadPoolExecutor

  with ThreadPoolExecutor(2) as pool:
    batcher = MicroBatcher(search, pool, 256, workers=2, window_s=0.002)
    results = await asyncio.wait_for(
      asyncio.gather(*(batcher.search([f"q{i}", f"r{i}"], 1 + i % 3) for i in range(40))), 20
    )
  for i, rows in enumerate(results):  # each request its own queries' hits, in order
    assert [h[0][0] for h in rows] == [{"q": f"q{i}"}, {"q": f"r{i}"}]
  assert peak[0] == 2 and sum(calls) == 80 and len(calls) < 40


async def test_concurrent_answers_equal_sequential_ones_on_two_workers(tantivy_index) -> None:
  server = RetrievalServer(tantivy_index, RetrievalServerConfig(port=0, workers=2))
  await asyncio.wait_for(server.start(), 10)
  queries = [f"{w} {v}" for w in ("Lothair", "queen", "demon", "river") for v in ("II", "film")]
  expected = {q: retrieve_rows(tantivy_index, [q], 5)[0] for q in queries}
  try:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:

      async def one(q: str):
        async with s.post(f"http://127.0.0.1:{server.port}/retrieve",
                          json={"queries": [q], "topk": 5}) as resp:  # fmt: skip
          return q, (await resp.json())["result"][0]

      got = await asyncio.wait_for(asyncio.gather(*(one(q) for q in queries * 6)), 30)
    assert all(rows == expected[q] for q, rows in got)
    assert server._batcher.batches < len(got)
  finally:
    await asyncio.wait_for(server.stop(), 10)


async def test_a_search_that_outlives_its_timeout_is_a_503(shipped_index) -> None:
  server = RetrievalServer(shipped_index, RetrievalServerConfig(port=0, search_timeout_s=0.2))
  await asyncio.wait_for(server.start(), 10)
  gate = threading.Event()
  original = server._batcher._search_batch

  def stuck(queries, k):
    gate.wait(10)
    return original(queries, k)

  server._batcher._search_batch = stuck
  try:
    async with (
      aiohttp.ClientSession(timeout=TIMEOUT) as s,
      s.post(f"http://127.0.0.1:{server.port}/retrieve", json={"queries": ["Teutberga"]}) as r,
    ):
      assert r.status == 503 and "within 0.2 s" in (await r.json())["error"]
    assert server.requests["busy"] == 1
  finally:
    gate.set()
    await asyncio.wait_for(server.stop(), 10)


@pytest.mark.slow
def test_the_scale_benchmark_core_at_a_tiny_size(tmp_path: Path) -> None:
  sys.path.insert(0, str(REPO / "benchmarks"))
  try:
    import retrieval_scale
  finally:
    sys.path.remove(str(REPO / "benchmarks"))
  out = retrieval_scale.run((1_500, 3_000), qps_seconds=1.0, tmp_dir=tmp_path)
  for key in ("backends", "curve", "qps_c32_2m", "p99_ms_c32_2m", "peak_rss_gb_2m",
              "workers_ratio_2_over_1", "workers_ratio_2proc_over_1", "projection_21m"):  # fmt: skip
    assert key in out
  rows = {(r["backend"], r["passages"]): r for r in out["curve"]}
  assert set(rows) == {(b, n) for b in ("bm25", "tantivy") for n in (1_500, 3_000)}
  top = rows["tantivy", 3_000]
  assert top["num_passages"] == 3_000 and top["disk_gb"] > 0 and top["errors"] == 0
  assert out["qps_c32_2m"] == top["qps_c32"] > 0 and out["workers_ratio_2_over_1"] > 0
  assert out["workers_ratio_2proc_over_1"] > 0
  assert out["projection_21m"]["tantivy"]["passages"] == 21_000_000
  json.dumps(out)  # one JSON object
