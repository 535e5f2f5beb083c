"""The tag protocol: what a generation asks for, and whether it is well formed.

Parsing never raises and never backtracks: every scan is `str.find` from left to right, so a 1 MB
generation with thousands of unclosed tags costs one pass. The extraction rule is ASearcher's
(for each tool tag in registration order, then answer, take the *last* complete non-greedy match;
execute the first of them), and the format gate is its `correct_format_fn` plus two stray-token
checks. The tool tags come from `tools.registry` (built-ins `search`, `access` first), or from the
agent's own ToolBox, so a registered tool is parsed without an edit here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from asearcher_jax.tools import registry

# A tool's tag (`tools.registry.tags()`) or ANSWER.
ActionKind = str
ANSWER = "answer"
READ_STOPS: tuple[str, ...] = ("</think>",)
# A new chat turn inside a generation means the model is writing the other side's lines.
ROLE_STRINGS: tuple[str, ...] = ("Assistant", "assistant", "<|im_start|>")


def action_tags(tools: Sequence[str] | None = None) -> tuple[str, ...]:
  """The tags a generation may act with: `tools` (default: every registered tool), then answer."""
  tools = registry.tags() if tools is None else tools
  return (*(t for t in tools if t != ANSWER), ANSWER)


def act_stops(tags: Sequence[str] | None = None) -> tuple[str, ...]:
  """The stop strings of an act turn: each action tag's closing tag."""
  return tuple(f"</{t}>" for t in (action_tags() if tags is None else tags))


def __getattr__(name: str) -> tuple[str, ...]:
  """`TOOL_TAGS` / `ACT_STOPS` read the registry when used (a tool registered later counts)."""
  if name == "TOOL_TAGS":
    return action_tags()
  if name == "ACT_STOPS":
    return act_stops()
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass(frozen=True)
class Action:
  """A complete `<kind>argument</kind>` tag; `argument` is stripped."""

  kind: ActionKind
  argument: str

  @property
  def tag(self) -> str:
    return f"<{self.kind}>{self.argument}</{self.kind}>"


@dataclasses.dataclass(frozen=True)
class FormatCheck:
  ok: bool
  # Human-readable reasons, empty when ok.
  problems: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Parsed:
  """One generation, parsed.

  Attributes:
    actions: the last complete match per tag kind, in the order of the tags (tools, answer).
    action: the one to execute (the first of `actions`), or None.
    think: the reasoning before the first `</think>` (a leading `<think>` dropped), or None.
    format: the format gate's verdict for this generation alone.
  """

  actions: tuple[Action, ...]
  action: Action | None
  think: str | None
  format: FormatCheck


def iter_matches(text: str, open_tag: str, close_tag: str) -> Iterator[tuple[int, int]]:
  """(content_start, content_end) of every non-greedy, non-overlapping match, left to right.

  Same matches as `re.finditer(open + "(.*?)" + close, text, re.DOTALL)`, in linear time.
  """
  pos = 0
  while True:
    start = text.find(open_tag, pos)
    if start < 0:
      return
    body = start + len(open_tag)
    end = text.find(close_tag, body)
    if end < 0:
      return
    yield body, end
    pos = end + len(close_tag)


def last_match(text: str, tag: str) -> str | None:
  """The stripped content of the last complete `<tag>…</tag>`, or None."""
  found = None
  for body, end in iter_matches(text, f"<{tag}>", f"</{tag}>"):
    found = (body, end)
  return None if found is None else text[found[0] : found[1]].strip()


def extract_actions(text: str, kinds: Sequence[ActionKind] | None = None) -> tuple[Action, ...]:
  out = []
  for kind in action_tags() if kinds is None else kinds:
    arg = last_match(text, kind)
    if arg is not None:
      out.append(Action(kind, arg))
  return tuple(out)


def extract_answer(text: str) -> str | None:
  return last_match(text, ANSWER)


def _balanced(text: str, tag: str) -> bool:
  """Opens and closes alternate, starting with an open and ending closed (no nesting).

  Each tag occurrence is found once (the next open and next close are cached), so this is
  linear even when one kind has run out.
  """
  open_tag, close_tag = f"<{tag}>", f"</{tag}>"
  o, c, depth = text.find(open_tag), text.find(close_tag), 0
  while o >= 0 or c >= 0:
    if o >= 0 and (c < 0 or o < c):
      depth += 1
      o = text.find(open_tag, o + len(open_tag))
    else:
      depth -= 1
      c = text.find(close_tag, c + len(close_tag))
    if depth not in (0, 1):
      return False
  return depth == 0


def check_format(
  text: str,
  *,
  max_tool_tags: int = 1,
  max_think_close: int | None = 1,
  role_strings: Sequence[str] = ROLE_STRINGS,
  tags: Sequence[str] | None = None,
) -> FormatCheck:
  """ASearcher's gate for one generation: balanced tags, at most one tool tag (every action tag
  together, answer included), no role strings, at most one `</think>`.

  "Balanced" is stricter than the original's count equality: `</search><search>` fails too.
  """
  problems = []
  tags = action_tags() if tags is None else tags
  for tag in tags:
    if not _balanced(text, tag):
      problems.append(f"unbalanced <{tag}> tags")
  n_tools = sum(text.count(f"<{tag}>") for tag in tags)
  if n_tools > max_tool_tags:
    problems.append(f"{n_tools} tool tags (at most {max_tool_tags})")
  for role in role_strings:
    if role in text:
      problems.append(f"role string {role!r}")
  if max_think_close is not None and text.count("</think>") > max_think_close:
    problems.append(f"{text.count('</think>')} </think> (at most {max_think_close})")
  return FormatCheck(not problems, tuple(problems))


def parse_think(text: str) -> str | None:
  end = text.find("</think>")
  if end < 0:
    return None
  head = text[:end]
  start = head.find("<think>")
  return (head[start + len("<think>") :] if start >= 0 else head).strip()


def parse(text: str, *, tags: Sequence[str] | None = None, **format_kwargs) -> Parsed:
  """Parse one generation against `tags` (default: `action_tags()`); never raises for any `str`
  (non-ASCII, stray specials, huge)."""
  tags = action_tags() if tags is None else tuple(tags)
  actions = extract_actions(text, tags)
  return Parsed(
    actions=actions,
    action=actions[0] if actions else None,
    think=parse_think(text),
    format=check_format(text, tags=tags, **format_kwargs),
  )
