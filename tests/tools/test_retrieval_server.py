"""The retrieval server: ASearcher/Search-R1 wire compatibility, input validation, batching."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
import zlib
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from asearcher_jax.tools.retrieval.corpus import CorpusError, wiki_url
from asearcher_jax.tools.retrieval.dense_index import (
  DenseIndexConfig,
  HybridConfig,
  HybridRetriever,
  reciprocal_rank_fusion,
)
from asearcher_jax.tools.retrieval.discovery import read_address_files
from asearcher_jax.tools.retrieval.index import build_index_dir, load_index
from asearcher_jax.tools.retrieval.server import (
  RetrievalServer,
  RetrievalServerConfig,
  retrieve_rows,
)

TIMEOUT = aiohttp.ClientTimeout(total=20)


def _base(server: RetrievalServer) -> str:
  return f"http://127.0.0.1:{server.port}"


async def _post(url: str, payload, *, raw: bytes | None = None) -> tuple[int, object]:
  async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
    kwargs = (
      {"data": raw, "headers": {"Content-Type": "application/json"}}
      if raw is not None
      else {"json": payload}
    )
    async with s.post(url, **kwargs) as resp:
      return resp.status, await resp.json(content_type=None)


async def test_wire_format_as_the_asearcher_client_uses_it(backend_server, backend_index):
  """Plain JSON, exactly the fields and shapes ASearcher's `search_utils` client sends and reads."""
  base = _base(backend_server)
  query = "If Gallu is a demon Lilu is what?"
  req_meta = {"queries": [query], "topk": 5, "return_scores": False}
  status, body = await _post(base + "/retrieve", req_meta)
  assert status == 200 and set(body) == {"result"}
  assert len(body["result"]) == 1 and len(body["result"][0]) == 5
  documents = [doc["contents"] for doc in body["result"][0]]
  urls = [doc["url"] for doc in body["result"][0]]
  assert all(isinstance(d, str) and d.startswith('"') for d in documents)
  assert all(u.startswith("https://en.wikipedia.org/w/index.php?title=") for u in urls)
  assert "Lilu (mythology)" in {doc["title"] for doc in body["result"][0]}
  # The same rows an in-process search gives.
  assert body["result"] == retrieve_rows(backend_index, [query], 5)

  # Search-R1's client: several queries, return_scores=True -> [{"document", "score"}].
  status, body = await _post(
    base + "/retrieve", {"queries": [query, "Lothair II"], "topk": 3, "return_scores": True}
  )
  assert status == 200 and [len(r) for r in body["result"]] == [3, 3]
  first = body["result"][1][0]
  assert set(first) == {"document", "score"} and isinstance(first["score"], float)
  assert {"id", "contents", "url"} <= set(first["document"])

  # topk missing or 0 -> the server default (3, as ASearcher's server).
  for payload in (
    {"queries": [query]},
    {"queries": [query], "topk": 0},
    {"queries": [query], "topk": None},
  ):
    status, body = await _post(base + "/retrieve", payload)
    assert status == 200 and len(body["result"][0]) == 3

  # /access: {"urls": [...]} -> {"result": [page | null]}; clients read result[0]["contents"].
  status, body = await _post(
    base + "/access",
    {
      "urls": [
        wiki_url("Lilu (mythology)"),
        "https://en.wikipedia.org/wiki/Lilu_(mythology)",
        "https://nowhere.example/x",
      ]
    },
  )
  assert status == 200 and len(body["result"]) == 3
  page = body["result"][0]
  assert page["contents"].startswith("Lilu (mythology)\n\n") and "demon" in page["contents"]
  assert body["result"][1] == page  # /wiki/ spelling of the same page
  assert body["result"][2] is None


async def test_a_blocking_stdlib_client_works_too(backend_server):
  """`requests`-style synchronous clients (urllib here) get the same JSON."""
  url = _base(backend_server) + "/retrieve"
  data = json.dumps({"queries": ["Teutberga queen"], "topk": 2}).encode()

  def call() -> dict:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
      return json.loads(resp.read())

  body = await asyncio.wait_for(asyncio.to_thread(call), 20)
  assert body["result"][0][0]["title"] == "Teutberga"


async def test_health_and_address_file(backend_server, tmp_path: Path):
  async with (
    aiohttp.ClientSession(timeout=TIMEOUT) as s,
    s.get(_base(backend_server) + "/health") as resp,
  ):
    health = await resp.json()
  assert health["status"] == "ok" and health["passages"] == 8113
  assert health["backend"] == backend_server.index.manifest["backend"]
  assert health["pages"] == 7583 and health["workers"] == 1
  assert len(health["corpus_sha256"]) == 64
  addr_file = backend_server.addr_file
  assert addr_file.name == f"Host127.0.0.1_IP{backend_server.port}.txt"
  assert read_address_files(addr_file.parent) == [f"127.0.0.1:{backend_server.port}"]
  await asyncio.wait_for(backend_server.stop(), 10)
  assert not addr_file.exists()  # a stopped server is no longer announced


async def test_malformed_requests_get_400_and_the_server_keeps_serving(backend_server):
  base = _base(backend_server)
  cases = [
    (b"{not json", "malformed JSON"),
    (b"\xff\xfe garbage", "malformed JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"queries": "one string"}', "list of strings"),
    (b'{"queries": [1, 2]}', "list of strings"),
    (b'{"queries": ["a"], "topk": -1}', "topk"),
    (b'{"queries": ["a"], "topk": 101}', "topk"),
    (b'{"queries": ["a"], "topk": "5"}', "topk"),
    (b'{"queries": ["a"], "topk": true}', "topk"),
    (b'{"queries": ["a"], "return_scores": "yes"}', "return_scores"),
    (json.dumps({"queries": ["q"] * 513}).encode(), "too many"),
    (json.dumps({"queries": ["x" * 5000]}).encode(), "longer than"),
  ]
  for raw, message in cases:
    status, body = await _post(base + "/retrieve", None, raw=raw)
    assert status == 400, raw[:40]
    assert message in body["error"], (raw[:40], body)
  for raw in (b'{"urls": "x"}', b"{}", b'{"urls": [null]}'):
    status, body = await _post(base + "/access", None, raw=raw)
    assert status == 400 and "urls" in body["error"]
  # A body over the size limit is refused before it is parsed.
  async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
    big = b'{"queries": ["' + b"a" * (2 << 20) + b'"]}'
    async with s.post(base + "/retrieve", data=big) as resp:
      assert resp.status == 413 and "size" in (await resp.json())["error"]
    # aiohttp's own error statuses are JSON too.
    async with s.get(base + "/retrieve") as resp:
      assert resp.status == 405
      assert (await resp.json())["error"] == "Method Not Allowed: GET /retrieve (allowed: POST)"
    async with s.post(base + "/nowhere", json={}) as resp:
      assert resp.status == 404 and (await resp.json())["error"] == "Not Found: POST /nowhere"
  # Still serving, and the bad requests were counted.
  status, body = await _post(base + "/retrieve", {"queries": ["Teutberga"], "topk": 1})
  assert status == 200 and body["result"][0][0]["title"] == "Teutberga"
  assert backend_server.requests["bad_request"] == len(cases) + 3
  # Empty query list and empty query are valid: nothing found.
  status, body = await _post(base + "/retrieve", {"queries": []})
  assert status == 200 and body == {"result": []}
  status, body = await _post(base + "/retrieve", {"queries": ["", "the of"]})
  assert status == 200 and body == {"result": [[], []]}


async def test_concurrent_requests_are_micro_batched_with_correct_results(
  backend_server, backend_index
):
  base = _base(backend_server)
  queries = [
    f"{w} history" for w in ("Lothair", "queen", "demon", "mythology", "film", "river")
  ] * 10
  expected = {q: retrieve_rows(backend_index, [q], 4)[0] for q in set(queries)}
  async with aiohttp.ClientSession(timeout=TIMEOUT) as s:

    async def one(q: str, k: int):
      async with s.post(base + "/retrieve", json={"queries": [q], "topk": k}) as resp:
        assert resp.status == 200
        return q, k, (await resp.json())["result"][0]

    # Mixed topk in one batch: each request gets its own k.
    results = await asyncio.wait_for(
      asyncio.gather(*(one(q, 2 + i % 3) for i, q in enumerate(queries))), 30
    )
  for q, k, rows in results:
    assert rows == expected[q][:k]
  batcher = backend_server._batcher
  assert batcher.queries >= len(queries)
  assert batcher.batches < len(queries)  # some requests shared a scoring call


async def test_too_many_inflight_requests_get_503(backend_index):
  server = RetrievalServer(backend_index, RetrievalServerConfig(port=0, max_inflight=1))
  await asyncio.wait_for(server.start(), 10)
  try:
    gate = threading.Event()
    original = server._batcher._search_batch

    def slow(queries, k):  # runs on the worker thread: holds the one slot until released
      assert gate.wait(20)
      return original(queries, k)

    server._batcher._search_batch = slow
    base = _base(server)
    first = asyncio.create_task(_post(base + "/retrieve", {"queries": ["Teutberga"]}))
    for _ in range(200):
      if server._inflight:
        break
      await asyncio.sleep(0.01)
    status, body = await _post(base + "/retrieve", {"queries": ["Teutberga"]})
    assert status == 503 and "busy" in body["error"]
    gate.set()
    status, body = await asyncio.wait_for(first, 20)
    assert status == 200
  finally:
    await asyncio.wait_for(server.stop(), 10)


# --- dense and hybrid indexes over HTTP ------------------------------------------------------

DENSE_DIM = 16


class SeededEncoder:
  """Each text -> a fixed pseudo-random vector (crc32-seeded): no ties, no model, any process."""

  def encode(self, texts, *, kind: str) -> np.ndarray:
    rows = [np.random.default_rng(zlib.crc32(t.encode())).standard_normal(DENSE_DIM) for t in texts]
    return np.asarray(rows, np.float32).reshape(len(texts), DENSE_DIM)


def make_seeded_encoder() -> SeededEncoder:
  return SeededEncoder()


def _dense_corpus(path: Path, n: int) -> list[str]:
  """wiki-18 jsonl rows; returns each passage's `contents` (what the index encodes)."""
  contents = [f'"Page {i}"\nword{i} topic{i % 7} filler text number {i}' for i in range(n)]
  path.write_text("".join(json.dumps({"id": str(i), "contents": c}) + "\n"
                          for i, c in enumerate(contents)))  # fmt: skip
  return contents


async def _serve(index, tmp_path: Path):
  server = RetrievalServer(index, RetrievalServerConfig(port=0, addr_dir=str(tmp_path / "addrs")))
  await asyncio.wait_for(server.start(), 10)
  return server


async def test_a_faiss_file_written_by_faiss_itself_loads_and_serves(tmp_path: Path) -> None:
  """Search-R1's layout: a plain `faiss.write_index` Flat-IP file whose row i is passage i of the
  corpus; the index directory only points at it, and /retrieve answers exact inner-product top-k
  in the usual wire format."""
  faiss = pytest.importorskip("faiss")
  contents = _dense_corpus(tmp_path / "wiki.jsonl", 300)
  enc = SeededEncoder()
  base = enc.encode(contents, kind="passage")
  base /= np.linalg.norm(base, axis=1, keepdims=True)
  flat = faiss.IndexFlatIP(DENSE_DIM)
  flat.add(base)
  faiss.write_index(flat, str(tmp_path / "e5_Flat.index"))
  spec = f"{__name__}:make_seeded_encoder"
  manifest = build_index_dir(
    corpus=[tmp_path / "wiki.jsonl"], index_dir=tmp_path / "ix", backend="dense", encoder=spec,
    dense=DenseIndexConfig(prebuilt=str(tmp_path / "e5_Flat.index")), show_progress=False,
  )  # fmt: skip
  assert manifest["dense_index"] == {"prebuilt": str(tmp_path / "e5_Flat.index"), "dim": DENSE_DIM,
                                     "ntotal": 300, "kind": "flat"}  # fmt: skip
  assert not (tmp_path / "ix" / "dense").exists()  # not copied
  queries = [f"question {i}" for i in range(6)]
  q = enc.encode(queries, kind="query")
  q /= np.linalg.norm(q, axis=1, keepdims=True)
  sims = q @ base.T
  want = np.argsort(-sims, axis=1, kind="stable")[:, :5]

  server = await _serve(load_index(tmp_path / "ix"), tmp_path)
  try:
    status, body = await _post(
      _base(server) + "/retrieve", {"queries": queries, "topk": 5, "return_scores": True}
    )
    assert status == 200 and set(body) == {"result"}
    got = [[int(h["document"]["id"]) for h in row] for row in body["result"]]
    assert got == want.tolist()
    for i, row in enumerate(body["result"]):
      assert [h["score"] for h in row] == pytest.approx(sims[i, want[i]].tolist(), abs=1e-5)
      assert row[0]["document"]["contents"] == contents[want[i, 0]]
    status, body = await _post(_base(server) + "/access", {"urls": [wiki_url("Page 3")]})
    assert status == 200 and "word3" in body["result"][0]["contents"]
    health = await asyncio.to_thread(urllib.request.urlopen, _base(server) + "/health", timeout=20)
    assert json.loads(health.read())["backend"] == "dense"
  finally:
    await asyncio.wait_for(server.stop(), 10)

  # A file with another row count than the corpus is refused at build time, not served wrong.
  faiss.write_index(faiss.IndexFlatIP(DENSE_DIM), str(tmp_path / "empty.index"))
  with pytest.raises(CorpusError, match="0 vectors but the corpus 300"):
    build_index_dir(corpus=[tmp_path / "wiki.jsonl"], index_dir=tmp_path / "bad",
                    backend="dense", encoder=spec,
                    dense=DenseIndexConfig(prebuilt=str(tmp_path / "empty.index")))  # fmt: skip


@pytest.mark.parametrize("sparse", ["bm25", "tantivy"])
async def test_hybrid_index_fuses_dense_and_bm25_and_serves(tmp_path: Path, sparse: str) -> None:
  """`backend="hybrid"`: a faiss index built here plus either BM25 engine, RRF-fused; the server
  answers exactly the fusion of the two rankings."""
  pytest.importorskip("faiss")
  _dense_corpus(tmp_path / "wiki.jsonl", 120)
  spec = f"{__name__}:make_seeded_encoder"
  hybrid = HybridConfig(depth=20, sparse=sparse)
  manifest = build_index_dir(
    corpus=[tmp_path / "wiki.jsonl"], index_dir=tmp_path / "ix", backend="hybrid", encoder=spec,
    hybrid=hybrid, show_progress=False,
  )  # fmt: skip
  assert manifest["hybrid"]["sparse"] == sparse and manifest["dense_index"]["ntotal"] == 120
  again = build_index_dir(corpus=[tmp_path / "wiki.jsonl"], index_dir=tmp_path / "ix",
                          backend="hybrid", encoder=spec, hybrid=hybrid, show_progress=False)  # fmt: skip
  assert again["reused"]
  index = load_index(tmp_path / "ix")
  retriever = index.retriever
  assert isinstance(retriever, HybridRetriever) and retriever.bm25.backend == sparse
  queries = ["word7 topic3", "topic5 filler"]
  dense = retriever.dense.search_batch(queries, 20)
  bm25 = retriever.bm25.search_batch(queries, 20)
  fused = [reciprocal_rank_fusion([d, b], k=4) for d, b in zip(dense, bm25)]
  assert bm25[0][0][0] == 7  # the one passage with both query words
  assert all(len(d) == 20 for d in dense) and {i for i, _ in fused[0]} != {
    i for i, _ in bm25[0][:4]
  }
  server = await _serve(index, tmp_path)
  try:
    status, body = await _post(_base(server) + "/retrieve", {"queries": queries, "topk": 4})
  finally:
    await asyncio.wait_for(server.stop(), 10)
  assert status == 200
  assert [[int(d["id"]) for d in row] for row in body["result"]] == [
    [i for i, _ in f] for f in fused
  ]


async def test_process_workers_answer_as_thread_workers_do(backend_index) -> None:
  """`worker_kind="process"`: each worker loads the index directory itself (its own GIL); the
  answers and pages are the in-process ones, and the server is ready when it listens."""
  server = RetrievalServer(
    backend_index, RetrievalServerConfig(port=0, workers=2, worker_kind="process")
  )
  await asyncio.wait_for(server.start(), 120)
  try:
    queries = ["Lothair II", "If Gallu is a demon Lilu is what?", "queen history"]
    status, body = await _post(_base(server) + "/retrieve", {"queries": queries, "topk": 4})
    assert status == 200 and body["result"] == retrieve_rows(backend_index, queries, 4)
    status, body = await _post(_base(server) + "/access", {"urls": [wiki_url("Lothair II")]})
    assert status == 200 and body["result"] == [backend_index.pages.get(wiki_url("Lothair II"))]
  finally:
    await asyncio.wait_for(server.stop(), 30)


async def test_process_workers_that_do_not_load_in_time_stop_the_start(backend_index) -> None:
  """A server whose workers have not loaded the index in time refuses to listen, naming the
  setting, rather than announcing itself and failing every request."""
  cfg = RetrievalServerConfig(port=0, workers=1, worker_kind="process", worker_load_timeout_s=1e-3)
  server = RetrievalServer(backend_index, cfg)
  try:
    with pytest.raises(RuntimeError, match="worker_load_timeout_s"):
      await asyncio.wait_for(server.start(), 120)
    assert server.port is None
  finally:
    await asyncio.wait_for(server.stop(), 60)
  with pytest.raises(ValueError, match="worker_load_timeout_s must be > 0"):
    RetrievalServerConfig(worker_load_timeout_s=0.0)
