"""What a tool is: a tag the model writes, a line for the prompt, and an async call.

The ToolBox, the tag protocol, the views, the trajectory's counters and the evaluation report all
read tools through this class and `tools.registry`, so a tool written outside the package (a code
executor, a calculator) is registered by name and needs no edit of theirs. The built-in `search`
and `access` tools (`tools.builtin`) are tools like any other; they override the lower hooks
(`request`, `run`, `render`) to keep ASearcher's cache keys and renderings exact.

Failure attribution is the ToolBox's: an exception out of `run` is an environment failure (the
trajectory is excluded, not scored), `InvalidArgument` is the policy's mistake (`invalid_call`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from asearcher_jax.tools.http_retry import CallStats
from asearcher_jax.tools.search import Document


class InvalidArgument(Exception):
  """The model asked for something the tool cannot take (the policy's mistake, not an outage)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolBoxConfig:
  """What the agent sees (ASearcher's base-model agent defaults) and overall bounds."""

  # Documents per search.
  topk: int = 5
  # Characters of each document shown.
  doc_chars: int = 5000
  # Sentences of each document shown after its first line (its title), a search engine's snippet
  # that leaves the rest of the page to `access`; 0: the whole document (up to doc_chars).
  doc_sentences: int = 0
  # Characters of a page kept before chunking.
  max_page_chars: int = 250_000
  # Characters per page chunk (one read turn each).
  page_chunk_chars: int = 25_000
  # Chunks per page at most.
  max_page_chunks: int = 10
  # Characters of a chunk kept in its compacted stub.
  stub_chars: int = 100
  # Seconds one tool call may take in all (retries included) before it is an environment failure.
  call_timeout_s: float = 600.0
  # Compact search results after their read turn to a list of their URLs (the original keeps
  # them in full; long-horizon runs need this or a history tail).
  compact_search_results: bool = False
  # Characters of a generic tool's output shown (its stub keeps `stub_chars`).
  output_chars: int = 10_000


@dataclasses.dataclass(frozen=True)
class ToolJob:
  """One read turn: `text` is shown in full once, `short_text` stays in the context afterwards;
  `label` names it in views ("search", "page 3", a tool's tag)."""

  text: str
  short_text: str
  label: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rendered:
  """A tool's value as the agent reads it: read jobs, whether anything was found, and the
  documents or page behind them (kept on the result for agents that re-render or cite)."""

  jobs: tuple[ToolJob, ...]
  found: bool
  documents: tuple[Document, ...] = ()
  page: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolOutput:
  """What a simple tool's `call` may return instead of a plain string."""

  # The text the agent reads (wrapped in <information> by the default rendering).
  text: str
  # Whether the call produced anything useful (views and counters read it).
  found: bool = True


def information(text: str) -> str:
  """Tool text as every tool result is shown: between `<information>` tags."""
  return f"<information>\n{text}\n</information>"


class Tool:
  """A tool the agent calls as `<tag>argument</tag>`.

  A simple tool sets `tag` and `description` and writes `call`; the class attributes below tell
  the views and the cache what to do with it. One instance serves every episode of a ToolBox, so
  `call` must be safe to run concurrently.
  """

  # The tag the model writes (`<tag>argument</tag>`); also the tool's name in stats and views.
  tag: ClassVar[str] = ""
  # One line for the prompt: what the tool does and what its argument is.
  description: ClassVar[str] = ""
  # What views call a result block of this tool ("results", "page", "output").
  result_label: ClassVar[str] = "output"
  # Terminal style of the tool's tag in `asearcher inspect`.
  style: ClassVar[str] = "bold yellow"
  # Calls go through the record/replay cache (their value must be JSON).
  cacheable: ClassVar[bool] = False
  # Its per-episode call count in evaluation stats and reports; "": "<tag>_calls".
  stat_name: ClassVar[str] = ""
  # "Nothing found" is the policy's mistake (a URL that does not exist), not just an empty result.
  missing_is_policy: ClassVar[bool] = False

  @property
  def provider(self) -> str:
    """The name stats, the cache and the cost budget know this tool's backend by."""
    return self.tag

  @property
  def available(self) -> bool:
    """False when the tool has no backend configured (an environment failure, not the policy's)."""
    return True

  def request(self, argument: str, config: ToolBoxConfig) -> dict[str, Any] | None:
    """The normalised request (the cache key); None for an empty argument. Both None and
    `InvalidArgument` (a malformed argument) are the policy's mistake."""
    argument = argument.strip()
    return {"argument": argument} if argument else None

  async def call(self, argument: str) -> str | ToolOutput:
    """Runs the tool on the model's (stripped) argument; what it returns is shown to the model."""
    raise NotImplementedError(f"tool {self.tag!r} implements neither call nor run")

  async def run(self, request: dict[str, Any], stats: CallStats) -> Any:
    """The JSON value of one call (what the cache stores); `stats.attempts` counts tries."""
    stats.attempts += 1
    out = await self.call(request["argument"])
    if isinstance(out, str):
      out = ToolOutput(text=out, found=bool(out.strip()))
    return {"text": out.text, "found": out.found}

  def render(self, value: Any, config: ToolBoxConfig) -> Rendered:
    """Read jobs from a value (None: the call failed); the default shows the text in one turn,
    cut to `output_chars`, and keeps a `stub_chars` stub once it has been read."""
    text = value.get("text", "") if isinstance(value, dict) else ""
    found = bool(value.get("found")) if isinstance(value, dict) else False
    if not text:
      text = f"No output from {self.tag}."
    shown = text[: config.output_chars]
    stub = shown[: config.stub_chars]
    return Rendered(
      jobs=(ToolJob(information(shown), information(stub), self.tag),),
      found=found,
    )

  async def close(self) -> None:
    """Releases what the tool holds (sessions, processes)."""
    return None
