"""HTML views for notebooks: self-contained fragments (inline CSS, no JavaScript, no network), so
they render the same in Colab, Jupyter, a saved .html file and a headless browser.

Every token span of the training-sequence view carries its data (`data-seq`, `data-pos`,
`data-id`, `data-mask`, `data-version`, `data-logprob`), so what is drawn can be checked
against the trajectory it came from.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from asearcher_jax.tokenizer import Tokenizer
from asearcher_jax.tools import registry as tool_registry
from asearcher_jax.views import episode as ev
from asearcher_jax.views.runs import Episode

CSS = """
.asj{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;font-size:13px;color:#1d1d1f;
 max-width:1100px}
.asj h3{margin:6px 0 4px;font-size:15px}.asj h4{margin:10px 0 4px;font-size:13px;color:#444}
.asj .head{border:1px solid #ddd;border-radius:6px;padding:8px 10px;background:#fafafa}
.asj .chip{display:inline-block;border-radius:10px;padding:1px 8px;margin:2px 4px 2px 0;
 font-size:12px;background:#eee}
.asj .ok{background:#d7f5dd}.asj .bad{background:#fbd9d9}.asj .warn{background:#fff1c2}
.asj table{border-collapse:collapse;margin:4px 0}.asj td,.asj th{border:1px solid #e2e2e2;
 padding:2px 6px;text-align:left;vertical-align:top;font-size:12px}.asj th{background:#f3f3f3}
.asj .turn{border-left:3px solid #8aa4d6;margin:6px 0;padding:2px 8px}
.asj .turn .meta{color:#777;font-size:11px}
.asj .blk{margin:3px 0;padding:3px 6px;border-radius:4px;white-space:pre-wrap;
 font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px}
.asj .think{background:#f4f0fb}.asj .tool{background:#e3efff}
.asj .answer{background:#d7f5dd;font-weight:600}.asj .text{background:#f6f6f6}
.asj .result{background:#fcfcf4;color:#444;max-height:180px;overflow:auto}
.asj .compaction{background:#fff1c2}.asj .failure{background:#fbd9d9}
.asj .lbl{font-weight:600;font-family:system-ui,sans-serif;margin-right:6px}
.asj .seq{white-space:pre-wrap;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;
 line-height:1.65;border:1px solid #ddd;border-radius:6px;padding:6px;max-height:480px;overflow:auto}
.asj .tok{border-radius:2px}.asj .tok.c{color:#8a8a8a}
.asj .tok.g{color:#111;border-bottom:2px solid rgba(200,0,0,var(--lp));
 box-shadow:inset -1px 0 rgba(0,0,0,.18)}
.asj .cols{display:flex;gap:12px;align-items:flex-start}.asj .cols>div{flex:1;min-width:0}
"""


def _block_class(kind: str) -> str:
  """CSS classes of a block: its kind, plus `tool` for a registered tool's tag and `result` for
  a tool's result label (so a user's tool is drawn like the built-in ones)."""
  labels = {"output"} | {tool_registry.get(t).result_label for t in tool_registry.tags()}
  extra = " tool" if tool_registry.get(kind) is not None else " result" if kind in labels else ""
  return _e(kind) + extra


class Html:
  """An HTML fragment that notebooks display (`_repr_html_`) and that saves as a page."""

  def __init__(self, body: str) -> None:
    self.body = body

  def _repr_html_(self) -> str:
    return f"<style>{CSS}</style><div class='asj'>{self.body}</div>"

  def page(self, title: str = "asearcher") -> str:
    return (
      f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
      f"</head><body>{self._repr_html_()}</body></html>"
    )

  def save(self, path: str | Path, title: str = "asearcher") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(self.page(title), encoding="utf-8")
    return path


def _e(x: Any) -> str:
  return html.escape("" if x is None else str(x))


def _fmt(x: Any) -> str:
  if isinstance(x, float):
    return "-" if math.isnan(x) else f"{x:.3g}"
  return "-" if x is None else str(x)


def version_colour(version: int) -> str:
  """Background of a generated token: one hue per policy version (golden-angle steps, so
  neighbouring versions differ clearly)."""
  return f"hsl({(140 + version * 137) % 360},70%,84%)"


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
  if not rows:
    return "<p><i>none</i></p>"
  cols = list(columns or rows[0].keys())
  head = "".join(f"<th>{_e(c)}</th>" for c in cols)
  body = "".join(
    "<tr>" + "".join(f"<td>{_e(_fmt(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows
  )
  return f"<table><tr>{head}</tr>{body}</table>"


def _chips(e: Episode) -> str:
  c = e.correct
  cls = "ok" if c else ("bad" if c is False else "")
  parts = [
    f"<span class='chip {cls}'>EM {_fmt(e.em)}</span>",
    f"<span class='chip'>score {_fmt(e.score)}</span>",
    f"<span class='chip'>{e.turns} turns</span>",
    f"<span class='chip'>{e.tool_calls} tool calls</span>",
    f"<span class='chip {'bad' if e.tool_failures else ''}'>{e.tool_failures} tool failures</span>",
    f"<span class='chip'>finish: {_e(e.trajectory.finish_reason)}</span>",
  ]
  if e.version is not None:
    parts.append(f"<span class='chip'>started at v{e.version}</span>")
  if e.accepted is not None:
    parts.append(f"<span class='chip {'ok' if e.accepted else 'warn'}'>"
                 f"{'trained' if e.accepted else 'group rejected'}</span>")  # fmt: skip
  return "".join(parts)


def _header(e: Episode) -> str:
  t = e.trajectory
  return (
    f"<div class='head'><h3>{_e(e.id)}</h3><div>{_chips(e)}</div>"
    f"<div><b>Question</b> ({_e(e.source)}, {_e(t.qid)}): {_e(t.question)}</div>"
    f"<div><b>Answer</b>: {_e(t.pred_answer)} &nbsp; <b>Gold</b>: {_e(' | '.join(t.answers))}"
    "</div></div>"
  )


def turns_html(traj: Any, tokenizer: Tokenizer | None = None) -> str:
  out = []
  for turn in ev.turns(traj, tokenizer):
    c = turn.call
    meta = (
      f"call {c.index} · {c.kind} · {c.input_ids.size} in / {c.output_ids.size} out tokens · "
      f"stop {c.stop_reason} · {c.latency_s:.2f} s"
    )
    if c.versions.size:
      meta += f" · v{int(c.versions.min())}" + (
        f"-v{int(c.versions.max())}" if c.versions.max() != c.versions.min() else ""
      )
    if c.format_problems:
      meta += " · format: " + "; ".join(c.format_problems)
    blocks = []
    for b in turn.blocks:
      note = f" <span class='meta'>{_e(b.note)}</span>" if b.note else ""
      blocks.append(
        f"<div class='blk {_block_class(b.kind)}'><span class='lbl'>{_e(b.kind)}</span>{note}\n"
        f"{_e(b.text)}</div>"
      )
    out.append(f"<div class='turn'><div class='meta'>{_e(meta)}</div>{''.join(blocks)}</div>")
  return "".join(out)


def _token_span(r: ev.TokenRow) -> str:
  text = r.text.replace("\n", "\u21b5\n")
  title = f"id {r.token_id} · pos {r.pos}"
  if r.mask:
    lp = min(max(-r.logprob / 5.0, 0.0), 1.0)
    title += f" · v{r.version} · logprob {r.logprob:.3f}"
    style = f" style='background:{version_colour(r.version)};--lp:{lp:.2f}'"
    cls = "tok g"
  else:
    style, cls = "", "tok c"
  return (
    f"<span class='{cls}' data-seq='{r.seq}' data-pos='{r.pos}' data-id='{r.token_id}' "
    f"data-mask='{r.mask}' data-version='{r.version}' data-logprob='{r.logprob:.4f}' "
    f"title='{_e(title)}'{style}>{_e(text)}</span>"
  )


def tokens_html(traj: Any, tokenizer: Tokenizer | None = None) -> str:
  """Every token of every training sequence, once: grey = context (loss mask 0), coloured =
  generated (background: policy version; red underline: low behaviour logprob)."""
  rows = ev.token_rows(traj, tokenizer)
  legend = " ".join(
    f"<span class='chip' style='background:{version_colour(v)}'>v{v}</span>"
    for v in ev.versions_of(rows)
  )
  out = [
    "<div class='meta'>grey: context (loss mask 0, not trained) · coloured: generated "
    f"(trained), background = policy version {legend} · red underline: low logprob</div>"
  ]
  for si, (seq, info) in enumerate(zip(rows, ev.sequence_summary(traj))):
    out.append(
      f"<h4>sequence {si}: {info['tokens']} tokens, {info['generated']} generated, versions "
      f"{info['versions']}, stop {info['stop']}, calls {info['calls']}</h4>"
      f"<div class='seq'>{''.join(_token_span(r) for r in seq)}</div>"
    )
  return "".join(out)


def episode_html(e: Episode, tokenizer: Tokenizer | None = None, *, tokens: bool = True) -> Html:
  """One episode: header, reward and its parts, turns, tool calls, and (optionally) the training
  sequences token by token."""
  parts = ev.reward_parts(e.trajectory, e.score)
  body = [
    _header(e),
    "<h4>Reward</h4>",
    table([{k: v for k, v in parts.items() if k not in ("gold",)}]),
    "<h4>Turns</h4>",
    turns_html(e.trajectory, tokenizer),
    "<h4>Tool calls</h4>",
    table(ev.tool_rows(e.trajectory)),
  ]
  if e.trajectory.errors:
    body += ["<h4>Errors</h4>", table([{"error": x} for x in e.trajectory.errors])]
  if tokens:
    body += ["<h4>Training sequences</h4>", tokens_html(e.trajectory, tokenizer)]
  return Html("".join(body))


def episodes_table(episodes: Iterable[Episode], limit: int = 200) -> Html:
  """A browsable list: one row per episode (id, question, answer, score, turns, failures)."""
  rows = [e.summary() for e in episodes]
  cols = ["id", "source", "question", "answer", "gold", "em", "score", "turns", "tool_calls",
          "tool_failures", "finish", "version"]  # fmt: skip
  more = f"<p>... {len(rows) - limit} more</p>" if len(rows) > limit else ""
  return Html(f"<p>{len(rows)} episodes</p>" + table(rows[:limit], cols) + more)


def side_by_side(episodes: Sequence[Episode], tokenizer: Tokenizer | None = None) -> Html:
  """The same question under different policies (e.g. before and after RL), in columns."""
  cols = "".join(f"<div>{_header(e)}{turns_html(e.trajectory, tokenizer)}</div>" for e in episodes)
  return Html(f"<div class='cols'>{cols}</div>")


def html_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> Html:
  return Html(table(rows, columns))
