"""The episode view on a hand-built trajectory with what the tiny run lacks: a policy-side and an
environment-side tool failure, a compaction stub between two calls (so two training sequences),
and a weight update inside one generation (two versions in one call)."""

from __future__ import annotations

import io
from html.parser import HTMLParser

import numpy as np
from rich.console import Console

from asearcher_jax.agent.context import Removal
from asearcher_jax.agent.trajectory import LLMCall, ToolEvent, Trajectory
from asearcher_jax.tokenizer import Tokenizer
from asearcher_jax.views import episode as ev
from asearcher_jax.views import html, runs, terminal


def _call(tok, index, prompt_ids, text, versions):
  out = np.asarray(tok.encode(text), np.int32)
  vs = np.asarray([versions[0]] * (out.size // 2) + [versions[1]] * (out.size - out.size // 2))
  return LLMCall(
    index=index, kind="act", input_ids=np.asarray(prompt_ids, np.int32), output_ids=out,
    logprobs=-np.linspace(0.01, 4.0, out.size), versions=vs, stop_reason="stop",
    max_new_tokens=64, text=text,
  )  # fmt: skip


def _episode() -> tuple[Trajectory, Tokenizer]:
  tok = Tokenizer.qwen2()
  p0 = tok.encode("Question: who? <think>")
  c0 = _call(tok, 0, p0, "plan</think><search>who q</search>", (3, 4))
  seen = [*p0, *c0.output_ids.tolist(), *tok.encode("<information>lots</information>")]
  c1 = _call(tok, 1, seen, "<access>http://x</access>", (4, 4))
  stub = tok.encode("[compacted]")
  c2 = _call(tok, 2, [*p0, *stub], "<think>so</think><answer>Ann</answer>", (4, 4))
  tools = [
    ToolEvent(after_call=0, name="search", argument="who q", text="<information>lots",
              stats={"provider": "local", "found": True}),
    ToolEvent(after_call=1, name="access", argument="http://x", text="", environment_failure=True,
              stats={"error": "timeout"}),
  ]  # fmt: skip
  rm = Removal(policy="summarize", label="old turns", offset=len(p0),
               removed=np.arange(10, dtype=np.int32), inserted=np.asarray(stub, np.int32),
               before_call=2)  # fmt: skip
  traj = Trajectory(agent="asearcher", question="who?", qid="q7", answers=["Ann"],
                    calls=[c0, c1, c2], tools=tools, removals=[rm], pred_answer="Ann",
                    finish_reason="answer")  # fmt: skip
  return traj, tok


def test_turns_blocks_failures_and_compaction():
  traj, tok = _episode()
  turns = ev.turns(traj, tok)
  assert [b.kind for b in turns[0].blocks] == ["think", "search", "results"]
  assert [b.kind for b in turns[1].blocks] == ["access", "failure", "compaction"]
  assert "environment failure: timeout" in turns[1].blocks[1].note
  assert turns[1].blocks[2].text == "[compacted]" and "10 tokens removed" in turns[1].blocks[2].note
  assert [b.kind for b in turns[2].blocks] == ["think", "answer"]
  assert [r["failure"] for r in ev.tool_rows(traj)] == ["", "environment"]
  bad = ToolEvent(
    after_call=0, name="access", argument="nope", text="", stats={"invalid_call": True}
  )
  assert ev.tool_attribution(bad) == "policy"
  ep = runs.Episode(id="x", source="train", trajectory=traj, score=None, em=None)
  assert ep.tool_failures == 1 and runs.worst([ep], 1) == [ep]
  assert runs.select([ep], tool_failures=True) == [ep] and not runs.select([ep], correct=False)
  parts = ev.reward_parts(traj, stored=0.9)
  assert parts["em"] == 1.0 and parts["stored_score"] == 0.9 and parts["format_ok"]


def test_two_sequences_every_token_once_html_and_terminal():
  traj, tok = _episode()
  seqs = traj.training_sequences()
  assert len(seqs) == 2  # the compaction broke the prefix

  class P(HTMLParser):
    def __init__(self):
      super().__init__()
      self.spans = []

    def handle_starttag(self, tag, attrs):
      a = dict(attrs)
      if tag == "span" and "data-mask" in a:
        self.spans.append((int(a["data-seq"]), int(a["data-id"]), int(a["data-mask"]),
                           int(a["data-version"])))  # fmt: skip

  p = P()
  p.feed(html.episode_html(runs.Episode(id="x", source="train", trajectory=traj, score=1.0,
                                        em=1.0), tok)._repr_html_())  # fmt: skip
  want = [(i, *t) for i, s in enumerate(seqs)
          for t in zip(s["tokens"].tolist(), s["loss_mask"].tolist(), s["versions"].tolist())]  # fmt: skip
  assert p.spans == want
  assert {v for _, _, m, v in p.spans if m} == {3, 4}  # the update mid-generation shows
  ep = runs.Episode(id="x", source="train", trajectory=traj, score=1.0, em=1.0)
  for text, s in zip(terminal.tokens_text(ep, tok), seqs):
    assert [sp.style for sp in text.spans] == [
      terminal.token_style(m, v) for m, v in zip(s["loss_mask"].tolist(), s["versions"].tolist())
    ]
  console = Console(file=io.StringIO(), width=120, record=True)
  terminal.print_episode(ep, console, tok)
  out = console.export_text()
  assert "failure" in out and "compaction" in out and "sequence 1" in out


def test_tokens_that_split_a_character_show_their_bytes_and_still_join_to_the_text():
  """The model can sample byte tokens that are part of a character, or stray bytes that are no
  character: each is drawn as its vocabulary entry, never as an empty or replacement glyph."""
  tok = Tokenizer.qwen2()
  emoji = [tok.token_to_id(c) for c in "ðŁĻĤ"]  # the four bytes of U+1F642, one token each
  stray = [tok.token_to_id("ð")]  # a lead byte with nothing after it
  out = [*tok.encode("a"), *emoji, *tok.encode(" b"), *stray, *tok.encode("c")]
  assert None not in out
  call = LLMCall(
    index=0, kind="act", input_ids=np.asarray(tok.encode("Q:"), np.int32),
    output_ids=np.asarray(out, np.int32), logprobs=np.full(len(out), -0.5),
    versions=np.zeros(len(out), np.int32), stop_reason="stop", max_new_tokens=64, text="",
  )  # fmt: skip
  traj = Trajectory(agent="search-r1", question="q", answers=["a"], calls=[call])
  (rows,) = ev.token_rows(traj, tok)
  shown = [r.text for r in rows[len(call.input_ids) :]]
  assert shown == ["a", "ð", "Ł", "Ļ", "Ĥ", " b", "ð", "c"]
  assert all(t and "\ufffd" not in t for t in shown)
  # Together the four byte tokens are the emoji; the stray byte is a replacement character.
  assert tok.decode(out) == "a\U0001f642 b\ufffdc"
