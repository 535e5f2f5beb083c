"""The views over a real tiny run: an episode of the RL run drawn as HTML and in the terminal shows
every token of its training sequences exactly once with its loss mask and policy version; the
training export agrees token for token with the replay log the learner trained from; and
`asearcher inspect` lists, draws and selects episodes, and fails in one line on bad input."""

from __future__ import annotations

import io
import re
from html.parser import HTMLParser

import numpy as np
import pytest
from rich.console import Console

from asearcher_jax import main as cli
from asearcher_jax.agent.trajectory import Trajectory
from asearcher_jax.apps import inspect as inspect_cmd
from asearcher_jax.rl.episodes import EPISODES_FILE, read_episodes
from asearcher_jax.rl.replay import GROUPS_LOG, _read_records, decode_group
from asearcher_jax.views import html, runs, terminal

pytestmark = pytest.mark.slow  # the tiny run: a CI-size quickstart (minutes on a shared CPU)


class _Tokens(HTMLParser):
  """Collects the token spans (class 'tok') with their data attributes and text."""

  def __init__(self) -> None:
    super().__init__()
    self.tokens: list[dict] = []
    self._in = False

  def handle_starttag(self, tag, attrs):
    a = dict(attrs)
    if tag == "span" and "tok" in (a.get("class") or "").split():
      self.tokens.append({**a, "text": ""})
      self._in = True

  def handle_endtag(self, tag):
    if tag == "span":
      self._in = False

  def handle_data(self, data):
    if self._in:
      self.tokens[-1]["text"] += data


def _train_episode(run: runs.RunDir) -> runs.Episode:
  """A trained training episode with tool calls and more than one call (the richest one)."""
  train = [e for e in run.episodes if e.source == "train" and e.accepted]
  assert train, "the tiny run exported no trained episode"
  return max(train, key=lambda e: (e.tool_calls > 0, e.turns))


def test_an_rl_episode_shows_every_token_once_with_its_mask_and_version(tiny_run):
  run = runs.RunDir(tiny_run)
  ep = _train_episode(run)
  seqs = ep.trajectory.training_sequences()
  assert ep.turns >= 1 and sum(int(s["loss_mask"].sum()) for s in seqs) > 0
  tok = run.tokenizer
  assert tok is not None  # the run keeps its vocabulary (rl/tokenizer)

  # HTML: one span per token, in order, carrying exactly the sequence's id, mask and version.
  page = html.episode_html(ep, tok)._repr_html_()
  parser = _Tokens()
  parser.feed(page)
  drawn = parser.tokens
  assert len(drawn) == sum(s.num_tokens for s in seqs)
  i = 0
  for si, s in enumerate(seqs):
    for pos, (t, m, v) in enumerate(zip(s["tokens"], s["loss_mask"], s["versions"])):
      d = drawn[i]
      assert (int(d["data-seq"]), int(d["data-pos"])) == (si, pos)
      assert (int(d["data-id"]), int(d["data-mask"]), int(d["data-version"])) == (t, m, v)
      assert d["text"].replace("\u21b5", "") == tok.decode([int(t)]) or d[
        "text"
      ] == tok.id_to_token(int(t))
      assert ("tok g" in d["class"]) == bool(m)
      i += 1
  # The text the agent actually saw and wrote is all there, in order, once per sequence. A token
  # that is only part of a character is drawn as its vocabulary entry, so each run of such tokens
  # is compared as the text the run decodes to together.
  html_text, i = "", 0
  for s in seqs:
    run: list[int] = []
    for t in s["tokens"].tolist():
      d = drawn[i]
      i += 1
      if "\ufffd" in tok.decode([t]) or tok.decode([t]) == "":
        run.append(t)
        continue
      html_text += tok.decode(run) if run else ""
      run = []
      html_text += d["text"].replace("\u21b5", "")
    html_text += tok.decode(run) if run else ""
  assert html_text == "".join(tok.decode(s["tokens"].tolist()) for s in seqs)

  # Terminal: one styled span per token, style = token_style(mask, version).
  texts = terminal.tokens_text(ep, tok)
  assert len(texts) == len(seqs)
  for text, s in zip(texts, seqs):
    assert len(text.spans) == s.num_tokens
    for span, m, v in zip(text.spans, s["loss_mask"], s["versions"]):
      assert span.style == terminal.token_style(int(m), int(v))
    assert text.plain.replace("\u21b5", "") == tok.decode(s["tokens"].tolist())
  console = Console(file=io.StringIO(), width=160, color_system="truecolor", record=True)
  terminal.print_episode(ep, console, tok)
  out = console.export_text()
  assert ep.id in out and "sequence 0" in out
  for turn_text in (c.text.strip() for c in ep.trajectory.calls):
    assert turn_text.replace("\n", "\u21b5\n")[:20] in out  # generated text, in the token view


def test_the_training_export_matches_the_replay_log_token_for_token(tiny_run):
  rl = tiny_run / "quickstart" / "rl"
  records = read_episodes(rl / EPISODES_FILE)
  assert records and all(r["trajectory"]["calls"] for r in records)
  raw, _ = _read_records(rl / "replay" / GROUPS_LOG)
  pushed = [decode_group(r) for r in raw]
  assert pushed  # the RL step trained on accepted groups
  for g in pushed:
    exported = [r for r in records if r["group_id"] == g.group_id and r["accepted"]]
    assert len(exported) == len(g.trajectories)
    for rec, seqs in zip(sorted(exported, key=lambda r: r["episode"]), g.trajectories):
      mine = Trajectory.from_json(rec["trajectory"]).training_sequences()
      for a, b in zip(mine, seqs, strict=True):
        for k in ("tokens", "loss_mask", "versions"):
          np.testing.assert_array_equal(a[k], np.asarray(b[k]))
  # Rejected groups are exported too (with their reason): a zero-variance group is visible.
  assert {r["accepted"] for r in records} <= {True, False}
  assert all(r["rejection"] is None for r in records if r["accepted"])


def test_inspect_lists_draws_and_selects(tiny_run, capsys):
  run = runs.RunDir(tiny_run)
  ep = _train_episode(run)
  assert inspect_cmd.main([str(tiny_run), "--width", "200"]) == 0
  listing = capsys.readouterr().out
  assert "training episodes:" in listing and re.search(r"evaluation runs: 2", listing)
  assert inspect_cmd.main([str(tiny_run), "--episode", ep.id, "--width", "200"]) == 0
  drawn = capsys.readouterr().out
  assert ep.id in drawn and "sequence 0" in drawn and "reward" in drawn
  pair = runs.compared(run.episodes)
  assert {e.source for e in pair} == {"eval:sft", "eval:rl"}
  assert inspect_cmd.main([str(tiny_run), "--question", pair[0].qid, "--width", "200"]) == 0
  assert capsys.readouterr().out.count(pair[0].trajectory.question[:30]) >= 2
  worst = runs.worst(run.episodes, 2)
  assert inspect_cmd.main([str(tiny_run), "--worst", "2", "--width", "200"]) == 0
  assert all(e.id[:25] in capsys.readouterr().out for e in worst[:1])
  # Through the one entry point (gin-bound arguments).
  assert cli.main(["inspect", f"--gin_param=inspect.inspect.run_dir='{tiny_run}'",
                   "--gin_param=inspect.inspect.worst=1", "--gin_param=inspect.inspect.width=200"]) == 0  # fmt: skip
  assert worst[0].id[:25] in capsys.readouterr().out


def test_inspect_bad_input_is_one_line(tiny_run, tmp_path, capsys):
  assert inspect_cmd.main([str(tiny_run), "--episode", "train:nope#0"]) == 1
  err = capsys.readouterr().err.strip()
  assert err.startswith("asearcher inspect: error: no episode 'train:nope#0'") and "\n" not in err
  assert inspect_cmd.main([str(tmp_path / "missing")]) == 1
  assert "does not exist" in capsys.readouterr().err
  assert inspect_cmd.main([str(tmp_path)]) == 1  # a directory with nothing to inspect
  assert "no episodes under" in capsys.readouterr().err
  assert inspect_cmd.main([str(tiny_run), "--worst", "0"]) == 2  # a config error, as via gin
  assert "(--worst) must be >= 1" in capsys.readouterr().err
