"""The ToolBox in the local-knowledge setting: formatting, discovery, failover, policy errors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asearcher_jax.errors import AsearcherError
from asearcher_jax.tools.cache import CacheConfig
from asearcher_jax.tools.http_retry import RetryConfig
from asearcher_jax.tools.retrieval.corpus import wiki_url
from asearcher_jax.tools.retrieval.server import RetrievalServer, RetrievalServerConfig
from asearcher_jax.tools.search import Document, LocalRetrievalClient, LocalRetrievalConfig
from asearcher_jax.tools.toolbox import (
  NO_PAGE,
  NO_RESULTS,
  ToolBox,
  ToolBoxConfig,
  ToolCall,
  make_toolbox,
  page_jobs,
  search_job,
  snippet,
)

FAST_RETRY = RetryConfig(timeout_s=2.0, max_attempts=4, backoff_s=0.01, max_backoff_s=0.05)


def test_search_text_is_asearchers_format() -> None:
  docs = [Document(contents="x" * 6000, url="u1"), Document(contents="short", url="u2")]
  job = search_job(docs, doc_chars=5000)
  assert job.text == job.short_text
  assert (
    job.text
    == "<information>\n[Doc 1](u1):\n" + "x" * 5000 + "\n\n[Doc 2](u2):\nshort\n</information>"
  )
  assert (
    search_job([], 5000).text
    == NO_RESULTS
    == ("<information>\nNo search results are found.\n</information>")
  )


def test_snippets_show_the_title_and_the_first_sentences() -> None:
  page = '"Gazor"\nGazor is a guild. Gazor is led by Mirat. Gazor was founded in 1820!  Tail?'
  assert snippet(page, 1) == '"Gazor"\nGazor is a guild.'
  assert (
    snippet(page, 3)
    == '"Gazor"\nGazor is a guild. Gazor is led by Mirat. Gazor was founded in 1820!'
  )
  assert (
    snippet(page, 9)
    == '"Gazor"\nGazor is a guild. Gazor is led by Mirat. Gazor was founded in 1820! Tail?'
  )
  assert snippet("no title line. Two sentences.", 1) == "no title line. Two sentences."
  docs = [Document(contents=page, url="u1")]
  assert search_job(docs, 5000, doc_sentences=1).text == (
    '<information>\n[Doc 1](u1):\n"Gazor"\nGazor is a guild.\n</information>'
  )
  assert search_job(docs, 12, doc_sentences=1).text.endswith('"Gazor"\nGazo\n</information>')
  assert "Mirat" in search_job(docs, 5000).text  # 0: the whole document


def test_pages_are_chunked_as_the_agent_expects() -> None:
  config = ToolBoxConfig()
  page = "".join(chr(ord("a") + i % 26) * 1000 for i in range(300))  # 300k chars
  jobs = page_jobs(page, config)
  assert len(jobs) == 10  # 250k cap / 25k chunks
  for i, job in enumerate(jobs):
    chunk = page[i * 25_000 : (i + 1) * 25_000]
    header = f"<information>\n>>>> Page {i + 1} >>>>\n\n"
    assert job.text == header + chunk + "\n</information>"
    assert job.short_text == header + chunk[:100] + "\n</information>"
  assert len(page_jobs("short page", config)) == 1
  assert page_jobs("", config)[0].text == NO_PAGE
  assert page_jobs(None, config)[0].text == (
    "<information>\nNo More Information is Found for this URL.\n</information>"
  )
  small = page_jobs(
    "abcdefghij", ToolBoxConfig(page_chunk_chars=4, max_page_chunks=2, stub_chars=2)
  )
  assert [j.text.split("\n\n")[1] for j in small] == [
    "abcd\n</information>",
    "efgh\n</information>",
  ]


async def test_local_search_and_access_through_address_discovery(retrieval_server):
  addr_dir = retrieval_server.addr_file.parent
  client = LocalRetrievalClient(LocalRetrievalConfig(addr_dir=str(addr_dir), retry=FAST_RETRY))
  async with ToolBox(search=client, access=client) as box:
    result = await asyncio.wait_for(
      box.execute(ToolCall("search", "If Gallu is a demon Lilu is what?")), 20
    )
    assert result.stats.found and result.stats.provider == "local" and len(result.documents) == 5
    assert "Lilu (mythology)" in {d.title for d in result.documents}
    assert result.documents[0].score > result.documents[-1].score
    assert result.text.startswith(f"<information>\n[Doc 1]({result.documents[0].url}):\n")
    page = await asyncio.wait_for(box.execute(ToolCall("access", wiki_url("Lilu (mythology)"))), 20)
    assert page.stats.found and page.page.startswith("Lilu (mythology)\n\n")
    assert page.jobs[0].text.startswith("<information>\n>>>> Page 1 >>>>\n\nLilu (mythology)")
    # A page that does not exist is the policy's problem, not an environment failure.
    nowhere = await asyncio.wait_for(
      box.execute(ToolCall("access", "https://en.wikipedia.org/wiki/No_Such_Page_Xyz")), 20
    )
    assert nowhere.text == NO_PAGE and not nowhere.stats.environment_failure
    # Policy errors: unknown tool, empty query, empty URL, a URL urllib cannot split (a model
    # once wrote one with an unbalanced "[" in its host, and urllib raised in the toolbox).
    calls = (ToolCall("browse", "x"), ToolCall("search", "   "), ToolCall("access", ""),
             ToolCall("access", "https://[synthwiki.org/Doc 1"),
             ToolCall("access", "https://[Doc 1](https://synthwiki.org/X)"))  # fmt: skip
    for call in calls:
      bad = await asyncio.wait_for(box.execute(call), 5)
      assert bad.stats.invalid_call and not bad.stats.environment_failure and bad.stats.error
    m = box.metrics()
  assert m["tools/search/calls"] == 2 and m["tools/search/found"] == 1
  assert m["tools/access/calls"] == 5 and m["tools/access/found"] == 1
  assert m["tools/other/invalid_calls"] == 1 and m["tools/search/invalid_calls"] == 1
  assert m["tools/search/latency_mean_s"] > 0


async def test_failover_to_a_live_server(shipped_index, tmp_path: Path):
  """A dead address and a dead announced server are skipped; the live one answers."""
  addr_dir = tmp_path / "addrs"
  addr_dir.mkdir()
  (addr_dir / "Host127.0.0.1_IP1.txt").write_text("127.0.0.1:1")  # nothing listens on port 1
  live = RetrievalServer(shipped_index, RetrievalServerConfig(port=0, addr_dir=str(addr_dir)))
  await asyncio.wait_for(live.start(), 10)
  try:
    client = LocalRetrievalClient(
      LocalRetrievalConfig(addresses=("127.0.0.1:1",), addr_dir=str(addr_dir), retry=FAST_RETRY)
    )
    async with ToolBox(search=client, access=client) as box:
      for _ in range(5):  # whichever server is picked first, every call ends on the live one
        client._current = "127.0.0.1:1"
        result = await asyncio.wait_for(box.execute(ToolCall("search", "Teutberga")), 20)
        assert result.stats.found and not result.stats.environment_failure
        assert result.stats.attempts == 2 and result.documents[0].title == "Teutberga"
  finally:
    await asyncio.wait_for(live.stop(), 10)


async def test_all_servers_down_is_an_attributed_failure(tmp_path: Path):
  client = LocalRetrievalClient(LocalRetrievalConfig(addresses=("127.0.0.1:1",), retry=FAST_RETRY))
  async with ToolBox(search=client, access=client) as box:
    result = await asyncio.wait_for(box.execute(ToolCall("search", "anything")), 20)
    empty_dir = LocalRetrievalClient(
      LocalRetrievalConfig(addr_dir=str(tmp_path / "none"), retry=FAST_RETRY)
    )
    async with ToolBox(search=empty_dir, access=None) as box2:
      nobody = await asyncio.wait_for(box2.execute(ToolCall("search", "anything")), 20)
  assert result.stats.environment_failure and result.stats.attempts == 4
  assert result.stats.error.startswith("local: ") and "after 4 attempts" in result.stats.error
  assert result.text == NO_RESULTS
  assert nobody.stats.environment_failure and "no retrieval server" in nobody.stats.error
  with pytest.raises(AsearcherError, match="addresses"):
    LocalRetrievalClient(LocalRetrievalConfig())


async def test_make_toolbox_settings(retrieval_server, tmp_path: Path, monkeypatch):
  addr_dir = str(retrieval_server.addr_file.parent)
  box = make_toolbox(
    local=LocalRetrievalConfig(addr_dir=addr_dir),
    cache=CacheConfig(path=str(tmp_path / "c.sqlite"), mode="read-write"),
  )
  async with box:
    assert box.search_provider is box.access_provider  # one client for both local tools
    first = await asyncio.wait_for(box.execute(ToolCall("search", "Teutberga")), 20)
    again = await asyncio.wait_for(box.execute(ToolCall("search", "Teutberga")), 20)
  assert first.documents == again.documents and again.stats.cache_hit
  monkeypatch.setenv("SERPER_API_KEY", "k")
  web = make_toolbox(search="serper", access="direct")
  assert web.search_provider.name == "serper" and web.access_provider.name == "direct"
  assert not web.cache.enabled  # the cache is off unless configured
  with pytest.raises(AsearcherError, match="search provider"):
    make_toolbox(search="bing")
