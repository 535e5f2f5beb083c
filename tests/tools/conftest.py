"""Fixtures for the tool tests: one BM25 index of the shipped corpus per session and backend
(bm25s; tantivy), and helpers that start aiohttp apps on 127.0.0.1 (the only network the tests
touch). `backend_index` / `backend_server` run a test once per BM25 backend."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from asearcher_jax.tools.retrieval.corpus import default_corpus_paths
from asearcher_jax.tools.retrieval.index import LoadedIndex, build_index_dir, load_index
from asearcher_jax.tools.retrieval.server import RetrievalServer, RetrievalServerConfig

TESTDATA = Path(__file__).parent / "testdata"


@pytest.fixture(scope="session")
def shipped_index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
  out = tmp_path_factory.mktemp("index") / "default-bm25"
  build_index_dir(corpus=default_corpus_paths(), index_dir=out, show_progress=False)
  return out


@pytest.fixture(scope="session")
def shipped_index(shipped_index_dir: Path) -> LoadedIndex:
  return load_index(shipped_index_dir)


@pytest.fixture(scope="session")
def tantivy_index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
  out = tmp_path_factory.mktemp("index") / "default-tantivy"
  build_index_dir(
    corpus=default_corpus_paths(), index_dir=out, backend="tantivy", show_progress=False
  )
  return out


@pytest.fixture(scope="session")
def tantivy_index(tantivy_index_dir: Path) -> LoadedIndex:
  return load_index(tantivy_index_dir)


BM25_BACKENDS = ("bm25", "tantivy")


@pytest.fixture(params=BM25_BACKENDS)
def backend_index(request: pytest.FixtureRequest) -> LoadedIndex:
  """The shipped corpus's index on each BM25 backend in turn."""
  return request.getfixturevalue("shipped_index" if request.param == "bm25" else "tantivy_index")


class LocalApp:
  """An aiohttp app served on 127.0.0.1:<free port> for the duration of a test."""

  def __init__(self, app: web.Application) -> None:
    self.app = app
    self.runner: web.AppRunner | None = None
    self.url = ""

  async def start(self) -> LocalApp:
    self.runner = web.AppRunner(self.app, access_log=None)
    await asyncio.wait_for(self.runner.setup(), 10)
    site = web.TCPSite(self.runner, "127.0.0.1", 0)
    await asyncio.wait_for(site.start(), 10)
    port = next(a for a in self.runner.addresses if isinstance(a, tuple))[1]
    self.url = f"http://127.0.0.1:{port}"
    return self

  async def stop(self) -> None:
    if self.runner is not None:
      await asyncio.wait_for(self.runner.cleanup(), 10)
      self.runner = None


@pytest.fixture
async def serve_app() -> AsyncIterator:
  """`await serve_app(app)` -> LocalApp (stopped at teardown)."""
  started: list[LocalApp] = []

  async def start(app: web.Application) -> LocalApp:
    local = await LocalApp(app).start()
    started.append(local)
    return local

  yield start
  for local in started:
    await local.stop()


@pytest.fixture
async def retrieval_server(shipped_index: LoadedIndex, tmp_path: Path) -> AsyncIterator:
  server = RetrievalServer(
    shipped_index, RetrievalServerConfig(port=0, addr_dir=str(tmp_path / "addrs"))
  )
  await asyncio.wait_for(server.start(), 10)
  yield server
  await asyncio.wait_for(server.stop(), 10)


@pytest.fixture
async def backend_server(backend_index: LoadedIndex, tmp_path: Path) -> AsyncIterator:
  """A retrieval server over `backend_index` (each BM25 backend in turn)."""
  server = RetrievalServer(
    backend_index, RetrievalServerConfig(port=0, addr_dir=str(tmp_path / "addrs"))
  )
  await asyncio.wait_for(server.start(), 10)
  yield server
  await asyncio.wait_for(server.stop(), 10)
