"""The retrieval server: ASearcher/Search-R1 wire compatibility, input validation, batching."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from pathlib import Path

import aiohttp

from asearcher_jax.tools.retrieval.corpus import wiki_url
from asearcher_jax.tools.retrieval.discovery import read_address_files
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
  assert health["pages"] == 7583 and health["workers"] == 2
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
