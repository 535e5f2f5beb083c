"""Corpora in their common on-disk formats, read into one passage schema, plus the page store.

Retrieval corpora come in a few shapes that all mean "a titled piece of Wikipedia text":
wiki-18 jsonl (`{"id", "contents": "\\"Title\\"\\ntext", "url"?}`, the Search-R1/FlashRAG/ASearcher
convention), lists of `{"title", "text"}` (HippoRAG, 2Wiki) and HotpotQA-style dicts
`{title: [sentence, ...]}`. Everything is read into `Passage`; `access` serves whole pages, which
are the passages of one URL joined in corpus order (or rows of a separate pages file).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from asearcher_jax.errors import AsearcherError

_ASSETS = Path(__file__).resolve().parents[2] / "assets"
# The shipped corpus: HotpotQA-100 gold+distractor paragraphs, then 2Wiki and wiki-18 passages.
DEFAULT_CORPUS_FILES: tuple[str, ...] = (
  "corpus/hipporag_hotpotqa_train100_corpus.json.gz",
  "corpus/hipporag_2wikimultihopqa_corpus.json.gz",
  "corpus/flashrag_wiki18_sample1000.jsonl.gz",
)
WIKI_URL_PREFIX = "https://en.wikipedia.org/w/index.php?title="


class CorpusError(AsearcherError):
  """A corpus or pages file is missing, unreadable or in no known format."""


def default_corpus_paths() -> list[Path]:
  """The corpus shipped in the package (see DATA_LICENSES.md for provenance)."""
  return [_ASSETS / name for name in DEFAULT_CORPUS_FILES]


def asset_path(name: str) -> Path:
  """A file under the package's assets/ directory."""
  return _ASSETS / name


@dataclasses.dataclass(frozen=True, kw_only=True)
class Passage:
  """One retrievable unit. `id` is stable across rebuilds of the same files."""

  id: str
  title: str
  text: str
  url: str

  @property
  def contents(self) -> str:
    # The wiki-18 convention every Search-R1/ASearcher client reads.
    return f'"{self.title}"\n{self.text}'

  def to_row(self) -> dict[str, str]:
    """The document as the retrieval server returns it (clients read `contents` and `url`)."""
    return {"id": self.id, "title": self.title, "contents": self.contents, "url": self.url}


def wiki_url(title: str) -> str:
  """The URL form of ASearcher's local pages file (`index.php?title=Some%20Title`)."""
  return WIKI_URL_PREFIX + urllib.parse.quote(title, safe="")


def page_key(url: str) -> str:
  """A lookup key under which equivalent spellings of one page URL coincide.

  Agents write Wikipedia URLs as `/wiki/A_B`, `index.php/A_B` or `index.php?title=A%20B`; all
  map to one key. Other URLs lose only surrounding whitespace, the fragment and a trailing slash.
  """
  url = url.strip()
  if url.startswith(WIKI_URL_PREFIX):  # the form `wiki_url` writes: every passage of a corpus
    rest = url[len(WIKI_URL_PREFIX) :]  # without urls, so it must cost microseconds, not tens
    if not any(c in rest for c in "&#;="):
      title = urllib.parse.unquote_plus(rest).replace("_", " ").strip()
      if title:
        return f"wiki:en.wikipedia.org:{title}"
  parts = urllib.parse.urlsplit(url)
  host = parts.netloc.lower()
  if host.endswith("wikipedia.org"):
    title = None
    if parts.path.startswith("/wiki/"):
      title = parts.path[len("/wiki/") :]
    elif parts.path.startswith("/w/index.php/"):
      title = parts.path[len("/w/index.php/") :]
    elif parts.path == "/w/index.php":
      query = urllib.parse.parse_qs(parts.query)
      title = query.get("title", [None])[0]
      if title is not None:
        title = urllib.parse.quote(title)
    if title:
      title = urllib.parse.unquote(title).replace("_", " ").strip()
      return f"wiki:{host}:{title}"
  path = parts.path.rstrip("/")
  return urllib.parse.urlunsplit((parts.scheme.lower(), host, path, parts.query, ""))


def file_sha256(path: Path) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def _check_file(path: Path) -> None:
  if not path.exists():
    raise CorpusError(f"corpus file not found: {path}")
  if path.is_dir():
    raise CorpusError(f"{path} is a directory, not a corpus file (.jsonl / .json, optionally .gz)")


def corpus_sha256(paths: Sequence[Path]) -> str:
  """One checksum over the files' bytes, in order (recorded in the index manifest)."""
  digest = hashlib.sha256()
  for path in paths:
    _check_file(Path(path))
    digest.update(file_sha256(path).encode())
  return digest.hexdigest()


def _open_text(path: Path) -> io.TextIOBase:
  _check_file(path)
  if path.suffix == ".gz":
    return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
  return open(path, encoding="utf-8")


def _base_suffix(path: Path) -> str:
  return Path(path.stem).suffix if path.suffix == ".gz" else path.suffix


def source_name(path: Path) -> str:
  """The file name without .json/.jsonl/.gz: the prefix of generated passage ids."""
  name = path.name
  for ext in (".gz", ".jsonl", ".json"):
    name = name.removesuffix(ext)
  return name


def _text_of(value: Any) -> str:
  if isinstance(value, str):
    return value
  if isinstance(value, list) and all(isinstance(s, str) for s in value):
    return "".join(value)  # HotpotQA sentences carry their own leading spaces
  raise ValueError(f"expected a string or a list of sentences, got {type(value).__name__}")


def _passage_from_row(row: Any, default_id: str) -> Passage:
  if not isinstance(row, Mapping):
    raise ValueError(f"expected an object, got {type(row).__name__}")
  if "contents" in row:
    contents = _text_of(row["contents"])
    first, _, rest = contents.partition("\n")
    title = row.get("title") or first.strip().strip('"')
    text = rest if rest else contents
  elif "title" in row and ("text" in row or "sentences" in row):
    title = row["title"]
    text = _text_of(row.get("text", row.get("sentences")))
  else:
    raise ValueError(f"no 'contents' nor 'title'+'text' fields (keys: {sorted(row)[:8]})")
  if not isinstance(title, str):
    raise ValueError("title is not a string")
  pid = row.get("id", row.get("_id", default_id))
  url = row.get("url") or wiki_url(title)
  return Passage(id=str(pid), title=title, text=text.strip(), url=str(url))


def iter_passages(path: Path) -> Iterator[Passage]:
  """Passages of one file; the format follows from the extension and the JSON shape."""
  path = Path(path)
  source = source_name(path)
  try:
    with _open_text(path) as f:
      if _base_suffix(path) == ".jsonl":
        for lineno, line in enumerate(f, 1):
          if not line.strip():
            continue
          try:
            yield _passage_from_row(json.loads(line), f"{source}:{lineno - 1}")
          except (ValueError, json.JSONDecodeError) as e:
            raise CorpusError(f"{path}:{lineno}: {e}") from None
        return
      data = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError, EOFError) as e:
    raise CorpusError(f"cannot read corpus file {path}: {e}") from None
  if isinstance(data, dict):  # HotpotQA style: title -> sentences (or text)
    items: Iterable[Any] = ({"title": t, "text": s} for t, s in data.items())
  elif isinstance(data, list):
    items = data
  else:
    raise CorpusError(f"{path}: expected a list of passages or a title -> text dict")
  for i, row in enumerate(items):
    try:
      yield _passage_from_row(row, f"{source}:{i}")
    except ValueError as e:
      raise CorpusError(f"{path}: entry {i}: {e}") from None


def load_passages(paths: Sequence[Path]) -> list[Passage]:
  """All passages of the files in order; empty passages are skipped, duplicate ids refused."""
  passages: list[Passage] = []
  seen: dict[str, Path] = {}
  for path in paths:
    for p in iter_passages(Path(path)):
      if not p.text and not p.title:
        continue
      if p.id in seen:
        raise CorpusError(f"duplicate passage id {p.id!r} in {path} (first in {seen[p.id]})")
      seen[p.id] = Path(path)
      passages.append(p)
  if not passages:
    raise CorpusError(f"no passages in {', '.join(str(p) for p in paths)}")
  return passages


def iter_page_rows(path: Path) -> Iterator[dict[str, str]]:
  """The rows `{url, contents, title}` of a pages file, one at a time."""
  with _open_text(Path(path)) as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
        yield {"url": row["url"], "contents": _text_of(row["contents"]),
               "title": row.get("title", "")}  # fmt: skip
      except (ValueError, KeyError, TypeError) as e:
        raise CorpusError(f"{path}:{lineno}: bad page row: {e}") from None


class PageStore:
  """url -> full page text, looked up by `page_key` so URL spelling variants hit."""

  def __init__(self, pages: Iterable[Mapping[str, str]] = ()) -> None:
    self._rows: dict[str, dict[str, str]] = {}
    for row in pages:
      self.add(url=row["url"], contents=row["contents"], title=row.get("title", ""))

  def add(self, *, url: str, contents: str, title: str = "") -> None:
    self._rows[page_key(url)] = {"url": url, "title": title, "contents": contents}

  def get(self, url: str) -> dict[str, str] | None:
    """The page row (`{"url", "title", "contents"}`) or None when the URL is unknown."""
    return self._rows.get(page_key(url))

  def __len__(self) -> int:
    return len(self._rows)

  def rows(self) -> Iterator[dict[str, str]]:
    return iter(self._rows.values())

  @classmethod
  def from_passages(cls, passages: Iterable[Passage]) -> PageStore:
    """One page per URL: the title, then the distinct passage texts in corpus order."""
    grouped: dict[str, tuple[Passage, list[str]]] = {}
    for p in passages:
      key = page_key(p.url)
      if key not in grouped:
        grouped[key] = (p, [])
      texts = grouped[key][1]
      if p.text and p.text not in texts:
        texts.append(p.text)
    store = cls()
    for first, texts in grouped.values():
      store.add(
        url=first.url, title=first.title, contents=f"{first.title}\n\n" + "\n\n".join(texts)
      )
    return store

  @classmethod
  def from_file(cls, path: Path) -> PageStore:
    """A pages file: jsonl rows `{url, contents, title?}` (ASearcher's wiki_webpages.jsonl)."""
    store = cls()
    for row in iter_page_rows(path):
      store.add(**row)
    return store

  def save(self, path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
      for row in self._rows.values():
        f.write(json.dumps(row, ensure_ascii=False) + "\n")
