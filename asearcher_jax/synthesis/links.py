"""The entity link graph injection walks, and deterministic sampling of seed pages.

Injection must follow real links: a fact about a page the question's entity actually links to (or
is linked from) is what makes a question multi-hop rather than a bag of unrelated trivia. Corpora
with page links (ASearcher's `links` json: `url -> {"links": [...], "in_links": [...]}`) are read
as they are; corpora without them (HotpotQA paragraphs, wiki-18 passages, SynthWiki pages) get an
edge from a page to every other page whose title its text mentions. Titles are matched as whole
words and case-sensitively, a parenthetical disambiguation ("Mercury (planet)") is dropped for
matching, and a bare title shared by several pages links to none of them (ambiguous).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable
from pathlib import Path

from asearcher_jax.errors import AsearcherError
from asearcher_jax.tools.retrieval.corpus import PageStore, page_key

_WORD = re.compile(r"\w+(?:['’.-]\w+)*|[^\w\s]", re.UNICODE)
_PAREN = re.compile(r"\s*\([^)]*\)\s*$")
_MAX_TITLE_WORDS = 8


def _words(text: str) -> list[str]:
  return _WORD.findall(text)


class LinkGraph:
  """Directed page links keyed by `page_key`; `neighbours` is out- and in-links together."""

  def __init__(self) -> None:
    self.out: dict[str, set[str]] = {}
    self.into: dict[str, set[str]] = {}
    self.urls: dict[str, str] = {}  # key -> the URL as first seen

  def add(self, src: str, dst: str) -> None:
    a, b = page_key(src), page_key(dst)
    if a == b:
      return
    self.urls.setdefault(a, src)
    self.urls.setdefault(b, dst)
    self.out.setdefault(a, set()).add(b)
    self.into.setdefault(b, set()).add(a)

  def neighbours(self, url: str) -> list[str]:
    """URLs linked from or to `url`, sorted (so sampling from them is reproducible)."""
    k = page_key(url)
    keys = self.out.get(k, set()) | self.into.get(k, set())
    return sorted(self.urls[n] for n in keys)

  def degree(self, url: str) -> int:
    k = page_key(url)
    return len(self.out.get(k, set()) | self.into.get(k, set()))

  @property
  def num_edges(self) -> int:
    return sum(len(v) for v in self.out.values())

  @classmethod
  def from_links_file(cls, path: str | Path, store: PageStore | None = None) -> LinkGraph:
    """ASearcher's links json; with `store`, links to pages it does not hold are dropped."""
    try:
      data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
      raise AsearcherError(f"cannot read links file {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise AsearcherError(f"links file {path} is not JSON ({e})") from None
    if not isinstance(data, dict) or not all(isinstance(r, dict) for r in data.values()):
      raise AsearcherError(f"links file {path}: expected {{page: {{'links': [...]}}}}")
    graph = cls()
    for src, row in data.items():
      for dst in row.get("links", ()):
        if store is None or store.get(dst) is not None:
          graph.add(src, dst)
      for other in row.get("in_links", ()):
        if store is None or store.get(other) is not None:
          graph.add(other, src)
    return graph

  @classmethod
  def from_mentions(cls, store: PageStore) -> LinkGraph:
    """An edge from each page to every page whose (unambiguous) title its text mentions."""
    by_words: dict[tuple[str, ...], list[str]] = {}
    for row in store.rows():
      title = row.get("title") or row["contents"].split("\n", 1)[0].strip().strip('"')
      bare = _PAREN.sub("", title).strip()
      words = tuple(_words(bare))
      if not words or len(words) > _MAX_TITLE_WORDS or len(bare) < 3:
        continue
      if len(words) == 1 and not words[0][:1].isupper():
        continue  # a lower-case single word ("water") is too common to be a link
      urls = by_words.setdefault(words, [])
      if row["url"] not in urls:
        urls.append(row["url"])
    lengths = sorted({len(w) for w in by_words}, reverse=True)
    graph = cls()
    for row in store.rows():
      graph.urls.setdefault(page_key(row["url"]), row["url"])
      tokens = _words(row["contents"])
      for i in range(len(tokens)):
        for n in lengths:
          urls = by_words.get(tuple(tokens[i : i + n]))
          if urls and len(urls) == 1:
            graph.add(row["url"], urls[0])
    return graph

  def to_json(self) -> dict[str, dict[str, list[str]]]:
    """ASearcher's links format, so a graph built once can be saved and re-read."""
    out: dict[str, dict[str, list[str]]] = {}
    for k, url in self.urls.items():
      out[url] = {
        "links": sorted(self.urls[d] for d in self.out.get(k, ())),
        "in_links": sorted(self.urls[s] for s in self.into.get(k, ())),
      }
    return out


def sample_pages(
  store: PageStore, graph: LinkGraph, n: int, *, seed: int, min_degree: int = 1,
  min_chars: int = 100,
) -> list[str]:  # fmt: skip
  """`n` page URLs (fewer if the store has fewer) with at least `min_degree` links and
  `min_chars` of text, the same for the same store, graph and seed."""
  urls = sorted(
    r["url"]
    for r in store.rows()
    if graph.degree(r["url"]) >= min_degree and len(r["contents"]) >= min_chars
  )
  rng = random.Random(seed)
  return rng.sample(urls, min(n, len(urls)))


def pages_with_titles(store: PageStore) -> Iterable[tuple[str, str]]:
  """(url, title) of every page."""
  for row in store.rows():
    yield row["url"], row.get("title") or row["contents"].split("\n", 1)[0].strip()
