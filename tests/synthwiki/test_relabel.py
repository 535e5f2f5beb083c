"""Expert relabelling (`synthwiki.relabel`): the expert's turn for the policy's own contexts, kept
only where the policy's turn differs, token-exact on the recorded input ids."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from asearcher_jax.apps import long_dagger
from asearcher_jax.apps import long_horizon as lh
from asearcher_jax.apps.world import RetrievalThread, generate_expert_trajectories, prepare_world
from asearcher_jax.sft import data as sft_data
from asearcher_jax.synthwiki import relabel
from asearcher_jax.synthwiki.expert import ExpertConfig, SynthWikiExpert
from asearcher_jax.synthwiki.wiki import SynthWikiConfig
from asearcher_jax.tokenizer import Tokenizer

TINY_LONG = SynthWikiConfig(
  num_people=20, num_places=12, num_organisations=10, num_works=8,
  questions_per_hop=(0, 0, 0, 6, 6), num_comparisons=0, isolate_hops=True, shuffle=True,
)  # fmt: skip
PAGES = ExpertConfig(read_pages=True, max_attempts=4)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  """(world, its files on disk)."""
  return prepare_world(tmp_path_factory.mktemp("relabel") / "world", TINY_LONG)


def _episodes(sw, files, tok, expert: ExpertConfig):
  """`expert`'s train episodes over the world's real BM25 server."""
  with RetrievalThread(files.index) as server:
    return asyncio.run(generate_expert_trajectories(
      sw.world, sw.train, tokenizer=tok, retrieval_address=server.address, expert=expert,
      agent_config=lh.PAGES_AGENT, concurrency=8,
    ))  # fmt: skip


@pytest.fixture(scope="module")
def page_run(world):
  """(world, tokenizer, the perfect page-reading expert's train episodes)."""
  sw, files = world
  tok = Tokenizer.from_dir(files.tokenizer)
  return sw, tok, _episodes(sw, files, tok, PAGES)


def _expert(sw, tok) -> SynthWikiExpert:
  return SynthWikiExpert(sw.world, sw.train, tok, PAGES)


def test_the_expert_agrees_with_its_own_episodes(page_run):
  sw, tok, trajs = page_run
  out = relabel.relabel(trajs, _expert(sw, tok))
  stats = out.stats()
  assert out.trajectories == [] and stats["corrections"] == 0
  assert stats["act"]["agreement"] == 1.0 and stats["read"]["agreement"] == 1.0
  assert stats["act"]["calls"] == sum(c.kind == "act" for t in trajs for c in t.calls)


def _corrupt(traj, tok, index: int, text: str):
  """`traj` with call `index`'s output replaced by `text` (the policy's mistake)."""
  calls = list(traj.calls)
  ids = np.asarray(tok.encode(text), np.int32)
  calls[index] = dataclasses.replace(
    calls[index], output_ids=ids, logprobs=np.zeros(ids.size, np.float32),
    versions=np.zeros(ids.size, np.int32), text=text,
  )  # fmt: skip
  return dataclasses.replace(traj, calls=calls)


def test_a_wrong_turn_is_corrected_with_the_experts_turn_on_the_same_input(page_run):
  sw, tok, trajs = page_run
  traj = next(t for t in trajs if t.score == 1.0 and len(t.calls) > 4)
  act = next(i for i, c in enumerate(traj.calls) if i > 0 and c.kind == "act")
  read = next(i for i, c in enumerate(traj.calls) if c.kind == "read")
  bad = _corrupt(traj, tok, act, "\n<search> Nobody founded </search>")
  bad = _corrupt(bad, tok, read, "Nothing here.</think>")
  out = relabel.relabel([bad], _expert(sw, tok))
  assert out.stats()["corrections"] == 2
  assert out.stats()["act"]["differ"] == 1 and out.stats()["read"]["differ"] == 1
  first = "note" if read < act else "search: wrong entity and relation"
  assert out.stats()["first_disagreement"] == {first: 1}  # one episode, one first
  only = relabel.relabel([bad], _expert(sw, tok), first_only=True)
  assert only.stats()["act"] == out.stats()["act"] and only.stats()["corrections"] == 1
  assert only.trajectories[0].calls[0].kind == ("read" if read < act else "act")
  (fixed,) = out.trajectories
  assert fixed.qid == traj.qid and fixed.extra["relabelled_from"] == traj.qid
  by_kind = {c.kind: c for c in fixed.calls}
  for kind, i in (("act", act), ("read", read)):
    # the label is the expert's own turn there: the original episode's output, same input ids
    np.testing.assert_array_equal(by_kind[kind].input_ids, traj.calls[i].input_ids)
    assert tok.decode(by_kind[kind].output_ids.tolist()) == tok.decode(
      traj.calls[i].output_ids.tolist()
    )
  # loss on the labels only (here the corrupted episode's later inputs still hold the original
  # turns, so the two corrections merge into one sequence by the prefix rule)
  seqs = fixed.training_sequences()
  assert sum(int(s["loss_mask"].sum()) for s in seqs) == sum(c.output_ids.size for c in fixed.calls)
  _, kept = sft_data.to_sequences([fixed], row_len=4096)
  assert kept.loss_tokens == sum(c.output_ids.size for c in fixed.calls)


def test_unreadable_contexts_are_counted_not_labelled(page_run):
  sw, tok, trajs = page_run
  other = SynthWikiExpert(sw.world, sw.test, tok, PAGES)  # knows none of the train questions
  out = relabel.relabel(trajs[:3], other)
  stats = out.stats()
  assert out.trajectories == []
  assert stats["act"]["calls"] > 0 and stats["act"]["agree"] == stats["act"]["differ"] == 0


@pytest.mark.parametrize(
  ("kind", "policy", "expert", "what"),
  [
    ("read", "Ab is a member of Cd.</think>", "Ab is led by Ef.</think>", "note"),
    ("act", "\n<search> Ab member of </search>", "\n<search> Ab led by </search>",
     "search: wrong relation"),
    ("act", "\n<search> Xy led by </search>", "\n<search> Ab led by </search>",
     "search: wrong entity"),
    ("act", "\n<search> Xy born in </search>", "\n<search> Ab led by </search>",
     "search: wrong entity and relation"),
    ("act", "\n<answer> Cd </answer>", "\n<search> Ab led by </search>",
     "answer instead of search"),
    ("act", "\n<access> u/Xy </access>", "\n<access> u/Ab </access>", "access: another page"),
    ("act", "I think", "\n<access> u/Ab </access>", "no action instead of access"),
  ],
)  # fmt: skip
def test_disagreements_are_named(kind, policy, expert, what):
  assert relabel.disagreement(kind, policy, expert) == what


def test_a_labeller_without_the_give_up_corrects_only_the_guesses(world):
  """Episodes of an expert that guesses after one hop: its own labeller agrees with every turn
  but the guess (it draws its own); the round's labeller without the give-up
  (`DaggerStage(labeller_gives_up=False)`) corrects each early answer with the turn that goes on
  along the chain, and nothing else."""
  sw, files = world
  tok = Tokenizer.from_dir(files.tokenizer)
  giving_up = dataclasses.replace(PAGES, give_up_after_hops=(1, 1))
  trajs = _episodes(sw, files, tok, giving_up)  # every chain here has 4 or 5 hops
  same = relabel.relabel(trajs, SynthWikiExpert(sw.world, sw.train, tok, giving_up)).stats()
  # its own labeller gives up at the same turn, with a guess of its own (another draw)
  assert set(same["first_disagreement"]) <= {"answer: another value"}
  assert same["read"]["differ"] == 0 and same["corrections"] == same["act"]["differ"]
  no_give_up = long_dagger.labeller_config(
    giving_up, long_dagger.DaggerStage(labeller_gives_up=False)
  )
  assert no_give_up == dataclasses.replace(giving_up, give_up_after_hops=None)
  assert long_dagger.labeller_config(giving_up, long_dagger.DaggerStage()) == giving_up
  guessing = dataclasses.replace(giving_up, p_guess=0.3, p_misread=0.1)  # only the give-up goes
  assert long_dagger.labeller_config(
    guessing, long_dagger.DaggerStage(labeller_gives_up=False)
  ) == dataclasses.replace(guessing, p_guess=0.0, give_up_after_hops=None)
  out = relabel.relabel(trajs, SynthWikiExpert(sw.world, sw.train, tok, no_give_up)).stats()
  assert out["episodes"] == len(trajs) > 0  # every episode gave up early: one correction each
  assert out["corrections"] == out["act"]["differ"] == len(trajs)
  assert out["read"]["differ"] == 0
  assert all(what.startswith("answer instead of") for what in out["first_disagreement"])
  # keeping the policy's guesses (`DaggerStage.keep_guesses`): the same labeller corrects nothing
  kept = relabel.relabel(
    trajs, SynthWikiExpert(sw.world, sw.train, tok, no_give_up), keep_guesses=True
  )
  assert kept.trajectories == [] and kept.stats()["corrections"] == 0
  assert kept.stats()["act"]["guesses_kept"] == len(trajs)
  assert kept.stats()["act"]["calls"] == out["act"]["calls"]  # a kept guess is still a call
  assert kept.stats()["act"]["differ"] == 0 and kept.stats()["first_disagreement"] == {}


def test_one_search_episodes_are_relabelled_and_a_wrong_relation_is_named(world):
  """The default long-horizon agent (whole pages in the results, one search a hop, no `access`):
  the expert agrees with its own episodes, and a search for the wrong relation on a later hop
  is corrected with the hop's right search on the same input ids."""
  sw, files = world
  tok = Tokenizer.from_dir(files.tokenizer)
  with RetrievalThread(files.index) as server:
    trajs = asyncio.run(generate_expert_trajectories(
      sw.world, sw.train, tokenizer=tok, retrieval_address=server.address,
      expert=ExpertConfig(), agent_config=lh.LONG_AGENT, concurrency=8,
    ))  # fmt: skip
  expert = SynthWikiExpert(sw.world, sw.train, tok, ExpertConfig())
  same = relabel.relabel(trajs, expert).stats()
  assert same["corrections"] == 0 and same["act"]["agreement"] == same["read"]["agreement"] == 1
  assert not any("access" in c.text for t in trajs for c in t.calls if c.kind == "act")
  traj = next(t for t in trajs if t.score == 1.0 and len(t.calls) > 4)
  act = [i for i, c in enumerate(traj.calls) if c.kind == "act"][2]  # the third hop's search
  entity = traj.calls[act].text.split("<search>")[1].split()[0]
  bad = _corrupt(traj, tok, act, f"\n<search> {entity} nothing related </search>")
  out = relabel.relabel([bad], expert)
  assert out.stats()["first_disagreement"] == {"search: wrong relation": 1}
  (fixed,) = out.trajectories
  (label,) = fixed.calls
  np.testing.assert_array_equal(label.input_ids, traj.calls[act].input_ids)
  assert tok.decode(label.output_ids.tolist()) == tok.decode(traj.calls[act].output_ids.tolist())
