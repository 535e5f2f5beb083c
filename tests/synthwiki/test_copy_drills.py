"""Copy drills (`synthwiki.copy_drills`): the expert's real first search turn with the start
renamed token-exactly, over every entity (held-out starts included), trained on that turn alone."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from asearcher_jax.apps import long_horizon as lh
from asearcher_jax.apps.world import RetrievalThread, generate_expert_trajectories, prepare_world
from asearcher_jax.sft import data as sft_data
from asearcher_jax.synthwiki import copy_drills
from asearcher_jax.synthwiki.expert import ExpertConfig
from asearcher_jax.synthwiki.wiki import SynthWikiConfig
from asearcher_jax.tokenizer import Tokenizer

TINY_LONG = SynthWikiConfig(
  num_people=20, num_places=12, num_organisations=10, num_works=8,
  questions_per_hop=(0, 0, 0, 8, 8, 8), num_comparisons=0, isolate_hops=True, shuffle=True,
)  # fmt: skip


def _expert_run(directory, expert: ExpertConfig, agent_config):
  """(world, tokenizer, the expert's train trajectories over the real BM25 server)."""
  sw, files = prepare_world(directory / "world", TINY_LONG)
  tok = Tokenizer.from_dir(files.tokenizer)
  with RetrievalThread(files.index) as server:
    trajs = asyncio.run(generate_expert_trajectories(
      sw.world, sw.train, tokenizer=tok, retrieval_address=server.address, expert=expert,
      agent_config=agent_config, concurrency=8,
    ))  # fmt: skip
  return sw, tok, trajs


@pytest.fixture(scope="module")
def expert_run(tmp_path_factory):
  expert = ExpertConfig(give_up_after_hops=(2, 3))
  return _expert_run(tmp_path_factory.mktemp("drills"), expert, lh.LONG_AGENT)


def test_drills_rename_the_start_in_the_first_turn_only(expert_run):
  sw, tok, trajs = expert_run
  questions = {q.id: q for q in sw.train}
  names = copy_drills.single_token_names(sw.world, tok)
  drills = copy_drills.copy_drills(trajs, questions, sw.world, tok, per_trajectory=3, seed=0)
  eligible = [
    t for t in trajs if not questions[t.qid].constraints and questions[t.qid].start in names
  ]
  assert eligible and len(drills) == 3 * len(eligible)  # named, single-token starts only
  renamed = 0
  for d in drills:
    src = questions[d.extra["copy_drill_of"]]
    new, old = names[d.extra["start"]], names[src.start]
    assert len(d.calls) == 1 and d.calls[0].kind == "act" and not d.tools
    out = d.calls[0].output_ids
    assert np.isin(out, new).any()  # the search names the drilled entity
    if new != old:
      renamed += 1
      assert not np.isin(d.calls[0].input_ids, old).any() and not np.isin(out, old).any()
      assert d.extra["start"] in tok.decode(out.tolist())
      assert d.extra["start"] in d.question and src.start not in d.question
  assert renamed > 0.8 * len(drills)
  # Held-out starts become copy targets, though no train question starts there.
  held_out = {q.start for q in sw.test} - {q.start for q in sw.train}
  assert held_out & {d.extra["start"] for d in drills}
  # Trained on that one turn: the loss covers exactly its output tokens.
  per, stats = sft_data.to_sequences(drills, row_len=1024)
  assert stats.sequences == len(drills)
  for d, seqs in zip(drills, per, strict=True):
    (seq,) = seqs
    assert seq["loss_mask"].sum() == d.calls[0].output_ids.size
  again = copy_drills.copy_drills(trajs, questions, sw.world, tok, per_trajectory=3, seed=0)
  assert [d.extra["start"] for d in again] == [d.extra["start"] for d in drills]
  other = copy_drills.copy_drills(trajs, questions, sw.world, tok, per_trajectory=3, seed=1)
  assert [d.extra["start"] for d in other] != [d.extra["start"] for d in drills]


@pytest.fixture(scope="module")
def page_expert_run(tmp_path_factory):
  expert = ExpertConfig(give_up_after_hops=(2, 3), read_pages=True, max_attempts=4)
  return _expert_run(tmp_path_factory.mktemp("page_drills"), expert, lh.PAGES_AGENT)


def test_page_drills_go_on_through_the_access_of_the_renamed_page(page_expert_run):
  sw, tok, trajs = page_expert_run
  questions = {q.id: q for q in sw.train}
  names = copy_drills.single_token_names(sw.world, tok)
  drills = copy_drills.copy_drills(trajs, questions, sw.world, tok, per_trajectory=2, seed=0)
  paged = [d for d in drills if len(d.calls) == 3]
  assert paged and len(paged) > 0.8 * len(drills)
  for d in paged:
    src = questions[d.extra["copy_drill_of"]]
    new, old = names[d.extra["start"]], names[src.start]
    act, read, access = d.calls
    assert (act.kind, read.kind, access.kind) == ("act", "read", "act") and not d.tools
    # The access opens the drilled entity's page: its URL holds the bare-name token.
    text = tok.decode(access.output_ids.tolist())
    assert "<access>" in text and text.rstrip().endswith("</access>")
    assert f"/{d.extra['start']} " in text and np.isin(access.output_ids, new[1]).any()
    if new != old:  # nothing of the old start is left, in any turn's input or output
      for c in d.calls:
        assert not np.isin(c.input_ids, old).any() and not np.isin(c.output_ids, old).any()
  # One training sequence per drill, its loss on the three turns' outputs.
  per, stats = sft_data.to_sequences(paged, row_len=1024)
  assert stats.sequences == len(paged)
  for d, (seq,) in zip(paged, per, strict=True):
    assert seq["loss_mask"].sum() == sum(c.output_ids.size for c in d.calls)


def test_described_starts_give_no_drills(expert_run):
  sw, tok, trajs = expert_run
  questions = {q.id: q for q in sw.train}
  described = [t for t in trajs if questions[t.qid].constraints]
  assert described  # the world injects some starts
  assert copy_drills.copy_drills(described, questions, sw.world, tok, per_trajectory=2) == []


def test_the_text_renames_whole_names_only():
  swapped = copy_drills._swap_name("Lamaex met Lam. Lam's aunt", "Lam", "Zed")
  assert swapped == "Lamaex met Zed. Zed's aunt"
