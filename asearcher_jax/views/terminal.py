"""Terminal views (rich) for `asearcher inspect`: the same episode view as the HTML one, drawn
with styles instead of CSS. Each token of the training-sequence view is one styled span whose
style is `token_style(mask, version)`, so a test can read the drawn text back span by span.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from asearcher_jax.tokenizer import Tokenizer
from asearcher_jax.tools import registry as tool_registry
from asearcher_jax.views import episode as ev
from asearcher_jax.views.runs import Episode

# Generated tokens cycle through these backgrounds by policy version; context tokens are dim.
VERSION_BACKGROUNDS = ("blue", "magenta", "green", "yellow", "cyan", "red")
CONTEXT_STYLE = "dim"
# Blocks that are not a tool's: a tool's tag takes its `Tool.style`, its results are dim.
BLOCK_STYLES = {
  "think": "magenta", "answer": "bold green", "text": "white", "compaction": "yellow",
  "failure": "bold red",
}  # fmt: skip
RESULT_STYLE = "dim"


def block_style(kind: str) -> str:
  """The style of a block: its own, its tool's (`Tool.style`), dim for tool results, or none."""
  if kind in BLOCK_STYLES:
    return BLOCK_STYLES[kind]
  cls = tool_registry.get(kind)
  if cls is not None:
    return cls.style
  if kind == "output" or any(
    tool_registry.get(t).result_label == kind for t in tool_registry.tags()
  ):
    return RESULT_STYLE
  return ""


def token_style(mask: int, version: int) -> str:
  """The style of one token: dim for context, black on a per-version background if generated."""
  if not mask:
    return CONTEXT_STYLE
  return f"black on {VERSION_BACKGROUNDS[version % len(VERSION_BACKGROUNDS)]}"


def _fmt(x: object) -> str:
  if isinstance(x, float):
    return f"{x:.3g}"
  return "-" if x is None else str(x)


def _clip(text: str, n: int) -> str:
  return text if len(text) <= n else text[: n - 1] + "…"


def header(e: Episode) -> Panel:
  t = e.trajectory
  lines = Text()
  lines.append(f"{t.question}\n", style="bold")
  lines.append(f"answer: {t.pred_answer!r}   gold: {' | '.join(t.answers)}\n")
  verdict = {True: ("correct", "green"), False: ("wrong", "red"), None: ("unscored", "yellow")}
  word, colour = verdict[e.correct]
  lines.append(word, style=f"bold {colour}")
  lines.append(
    f"   score {_fmt(e.score)}   {e.turns} turns   {e.tool_calls} tool calls   "
    f"{e.tool_failures} tool failures   finish {t.finish_reason}"
  )
  if e.version is not None:
    lines.append(f"   v{e.version}   {'trained' if e.accepted else 'group rejected'}")
  return Panel(lines, title=f"{e.id} ({e.source})", title_align="left")


def turns_view(e: Episode, tokenizer: Tokenizer | None = None, *, width: int = 600) -> Group:
  parts: list[RenderableType] = []
  for turn in ev.turns(e.trajectory, tokenizer):
    c = turn.call
    body = Text()
    for b in turn.blocks:
      body.append(f"{b.kind}: ", style=f"bold {block_style(b.kind)}")
      if b.note:
        body.append(f"[{b.note}] ", style="italic")
      body.append(_clip(b.text, width) + "\n", style=block_style(b.kind))
    title = (
      f"call {c.index} · {c.kind} · {c.input_ids.size} in / {c.output_ids.size} out · "
      f"stop {c.stop_reason}"
    )
    if c.format_problems:
      title += " · format: " + "; ".join(c.format_problems)
    parts.append(Panel(body, title=title, title_align="left", border_style="blue"))
  return Group(*parts)


def tokens_text(e: Episode, tokenizer: Tokenizer | None = None) -> list[Text]:
  """One Text per training sequence, one span per token (newlines drawn as ↵ plus a break)."""
  out = []
  for seq in ev.token_rows(e.trajectory, tokenizer):
    text = Text()
    for r in seq:
      text.append(r.text.replace("\n", "\u21b5\n"), style=token_style(r.mask, r.version))
    out.append(text)
  return out


def reward_table(e: Episode) -> Table:
  """The reward and its parts, one per row."""
  t = Table(title="reward", show_header=False, title_justify="left")
  t.add_column("part", style="bold")
  t.add_column("value")
  for k, v in ev.reward_parts(e.trajectory, e.score).items():
    t.add_row(k, _fmt(v))
  return t


def tools_table(e: Episode) -> Table:
  t = Table(title="tool calls", title_justify="left")
  rows = ev.tool_rows(e.trajectory)
  for k in rows[0] if rows else ("tool",):
    t.add_column(k)
  for r in rows:
    style = "red" if r["failure"] else ""
    t.add_row(*(_clip(_fmt(v), 60) for v in r.values()), style=style)
  return t


def print_episode(
  e: Episode, console: Console, tokenizer: Tokenizer | None = None, *, tokens: bool = True
) -> None:
  console.print(header(e))
  console.print(reward_table(e))
  console.print(turns_view(e, tokenizer))
  if e.trajectory.tools:
    console.print(tools_table(e))
  if tokens:
    legend = Text("tokens: ")
    legend.append("context", style=CONTEXT_STYLE)
    for v in ev.versions_of(ev.token_rows(e.trajectory)):
      legend.append(" ")
      legend.append(f"v{v}", style=token_style(1, v))
    console.print(legend)
    for i, (text, info) in enumerate(
      zip(tokens_text(e, tokenizer), ev.sequence_summary(e.trajectory))
    ):
      console.print(
        f"[bold]sequence {i}[/]: {info['tokens']} tokens, {info['generated']} generated, "
        f"versions {info['versions']}, stop {info['stop']}"
      )
      console.print(text)


def print_table(episodes: Sequence[Episode], console: Console, title: str = "episodes") -> None:
  t = Table(title=title, title_justify="left")
  t.add_column("id", no_wrap=True)  # whole, so it can be copied into --episode
  for col in ("question", "answer", "gold", "em", "score", "turns", "tools", "fail"):
    t.add_column(col, overflow="fold")
  for e in episodes:
    s = e.summary()
    style = "green" if e.correct else ("red" if e.correct is False else "")
    t.add_row(
      s["id"], _clip(s["question"], 60), _clip(str(s["answer"]), 30), _clip(s["gold"], 30),
      _fmt(s["em"]), _fmt(s["score"]), str(s["turns"]), str(s["tool_calls"]),
      str(s["tool_failures"]), style=style,
    )  # fmt: skip
  console.print(t)
