"""The built-in tools, `search` (a query to a search provider) and `access` (a URL to a page
provider), with ASearcher's renderings: search results as `[Doc k](url):` blocks in one read turn,
a page in 25k-character chunks, each compacted to a 100-character stub once read.

Their requests are the record/replay cache's keys (`{"query", "topk"}`, `{"url"}`), kept as they
were so recorded caches replay.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from asearcher_jax.tools.base import InvalidArgument, Rendered, Tool, ToolBoxConfig, ToolJob
from asearcher_jax.tools.cache import normalize_query, normalize_url
from asearcher_jax.tools.http_retry import CallStats
from asearcher_jax.tools.search import AccessProvider, Document, SearchProvider

NO_RESULTS = "<information>\nNo search results are found.\n</information>"
NO_PAGE = "<information>\nNo More Information is Found for this URL.\n</information>"

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def snippet(contents: str, sentences: int) -> str:
  """The first line (a wiki-18 title) and the first `sentences` sentences after it."""
  title, _, text = contents.partition("\n")
  if not text:
    return contents
  return title + "\n" + " ".join(_SENTENCE_END.split(text.strip(), maxsplit=sentences)[:sentences])


def search_job(docs: list[Document], doc_chars: int, doc_sentences: int = 0) -> ToolJob:
  """ASearcher's rendering: `[Doc k](url):` + the first `doc_chars` characters, one block
  (with `doc_sentences`, only the title and that many sentences: a snippet)."""
  if not docs:
    return ToolJob(NO_RESULTS, NO_RESULTS, "search")

  def shown(d: Document) -> str:
    text = snippet(d.contents, doc_sentences) if doc_sentences else d.contents
    return text[:doc_chars]

  body = "\n\n".join(f"[Doc {k}]({d.url}):\n{shown(d)}" for k, d in enumerate(docs, 1))
  text = f"<information>\n{body}\n</information>"
  return ToolJob(text, text, "search")  # search results are never compacted (by default)


def page_jobs(page: str | None, config: ToolBoxConfig) -> tuple[ToolJob, ...]:
  """A page cut to `max_page_chars` and split into chunks, each with a 100-char stub."""
  if not page:
    return (ToolJob(NO_PAGE, NO_PAGE, "page 1"),)
  page = page[: config.max_page_chars]
  jobs = []
  for i in range(config.max_page_chunks):
    chunk = page[i * config.page_chunk_chars : (i + 1) * config.page_chunk_chars]
    if not chunk:
      break
    header = f"<information>\n>>>> Page {i + 1} >>>>\n\n"
    jobs.append(
      ToolJob(
        f"{header}{chunk}\n</information>",
        f"{header}{chunk[: config.stub_chars]}\n</information>",
        f"page {i + 1}",
      )
    )
  return tuple(jobs)


class SearchTool(Tool):
  """`<search>query</search>`: the top documents of a search provider."""

  tag: ClassVar[str] = "search"
  description: ClassVar[str] = "a query to the search engine; returns the top documents"
  result_label: ClassVar[str] = "results"
  stat_name: ClassVar[str] = "searches"
  style: ClassVar[str] = "bold blue"
  cacheable: ClassVar[bool] = True

  def __init__(self, provider: SearchProvider | None = None) -> None:
    self.backend = provider

  @property
  def provider(self) -> str:
    return self.backend.name if self.backend is not None else "none"

  @property
  def available(self) -> bool:
    return self.backend is not None

  def request(self, argument: str, config: ToolBoxConfig) -> dict[str, Any] | None:
    query = normalize_query(argument)
    return {"query": query, "topk": config.topk} if query else None

  async def run(self, request: dict[str, Any], stats: CallStats) -> Any:
    assert self.backend is not None  # the ToolBox checks `available` first
    docs = await self.backend.search(request["query"], request["topk"], stats)
    return [d.to_json() for d in docs]

  def render(self, value: Any, config: ToolBoxConfig) -> Rendered:
    docs = tuple(Document.from_json(d) for d in value or [])
    shown = list(docs[: config.topk])
    job = search_job(shown, config.doc_chars, config.doc_sentences)
    if config.compact_search_results and shown:
      links = "\n".join(f"[Doc {k}]({d.url})" for k, d in enumerate(shown, 1))
      job = ToolJob(job.text, f"<information>\n{links}\n</information>", job.label)
    return Rendered(jobs=(job,), found=bool(docs), documents=docs)

  async def close(self) -> None:
    if self.backend is not None:
      await self.backend.close()


class AccessTool(Tool):
  """`<access>url</access>`: a page from a page provider, in chunks of one read turn each."""

  tag: ClassVar[str] = "access"
  description: ClassVar[str] = "a URL from the results; returns the page in chunks"
  result_label: ClassVar[str] = "page"
  stat_name: ClassVar[str] = "accesses"
  style: ClassVar[str] = "bold cyan"
  cacheable: ClassVar[bool] = True
  missing_is_policy: ClassVar[bool] = True

  def __init__(self, provider: AccessProvider | None = None) -> None:
    self.backend = provider

  @property
  def provider(self) -> str:
    return self.backend.name if self.backend is not None else "none"

  @property
  def available(self) -> bool:
    return self.backend is not None

  def request(self, argument: str, config: ToolBoxConfig) -> dict[str, Any] | None:
    try:
      url = normalize_url(argument)
    except ValueError as e:  # not a URL the parser takes (an unbalanced "[" reads as IPv6)
      raise InvalidArgument(f"malformed access URL: {e}") from e
    return {"url": url} if argument.strip() else None

  async def run(self, request: dict[str, Any], stats: CallStats) -> Any:
    assert self.backend is not None  # the ToolBox checks `available` first
    return await self.backend.access(request["url"], stats)

  def render(self, value: Any, config: ToolBoxConfig) -> Rendered:
    page = value if isinstance(value, str) and value else None
    return Rendered(jobs=page_jobs(page, config), found=page is not None, page=page)

  async def close(self) -> None:
    if self.backend is not None:
      await self.backend.close()


# What `tools.registry` registers first, in this order (the protocol's extraction order).
BUILTIN_TOOLS: dict[str, type[Tool]] = {"search": SearchTool, "access": AccessTool}
