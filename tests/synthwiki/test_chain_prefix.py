"""Chain prefixes (`questions.chain_prefix`): the first h hops of a chain are a question of their
own, unique in the world, through the same start (name or description) and the same pages."""

from __future__ import annotations

import json

import pytest

from asearcher_jax.apps import long_warm_start
from asearcher_jax.apps import quickstart as pipeline
from asearcher_jax.apps.world import WorldFiles
from asearcher_jax.errors import AsearcherError
from asearcher_jax.synthwiki.questions import chain_prefix, hop_leaks, resolve, write_questions
from asearcher_jax.synthwiki.wiki import SynthWikiConfig, build_synthwiki

# Long, hop-isolated chains like the long-horizon world's, stepwise so that a prefix's text can
# be checked against the chain's own ("follow a, then b, then c" -> "follow a, then b").
WORLD = SynthWikiConfig(
  seed=3, questions_per_hop=(0, 0, 0, 25, 25), num_comparisons=5, isolate_hops=True,
  question_style="stepwise",
)  # fmt: skip


@pytest.fixture(scope="module")
def sw():
  return build_synthwiki(WORLD)


def test_prefixes_are_unique_shorter_chains_of_the_same_start(sw):
  chains = [q for q in sw.questions if q.kind == "chain"]
  made = 0
  for q in chains:
    steps = q.question.removesuffix(". What do you reach?").split(", then ")
    for h in range(1, q.hops):
      p = chain_prefix(sw.world, q, h, "stepwise")
      if p is None:
        continue
      made += 1
      assert resolve(sw.world, p) == {p.answer} == {q.bridges[h - 1]}
      assert not hop_leaks(sw.world, p)
      assert p.question == ", then ".join(steps[:h]) + ". What do you reach?"
      assert (p.hops, p.relations, p.bridges) == (h, q.relations[:h], q.bridges[:h])
      assert (p.start, p.constraints, p.split) == (q.start, q.constraints, q.split)
      assert p.gold_titles == q.gold_titles[:h] and p.id == f"{q.id}-p{h}"
  assert made >= 0.9 * sum(q.hops - 1 for q in chains)  # nearly every prefix is unique
  assert any(q.constraints for q in chains)  # described starts were among them


def test_no_prefix_of_a_comparison_nor_of_the_whole_chain(sw):
  chain = next(q for q in sw.questions if q.kind == "chain")
  comparison = next(q for q in sw.questions if q.kind == "comparison")
  assert chain_prefix(sw.world, comparison, 1) is None
  assert chain_prefix(sw.world, chain, chain.hops) is None
  assert chain_prefix(sw.world, chain, 0) is None


def test_rl_pool_adds_the_prefixes_of_its_own_split(sw, tmp_path):
  write_questions(sw.train, tmp_path / "train.jsonl")
  write_questions(sw.test, tmp_path / "test.jsonl")
  files = WorldFiles(
    root=tmp_path, corpus=tmp_path / "c", train=tmp_path / "train.jsonl",
    test=tmp_path / "test.jsonl", tokenizer=tmp_path / "t", index=tmp_path / "i", digest="",
  )  # fmt: skip
  plain = pipeline.rl_pool(files, "train", None)
  pool = pipeline.rl_pool(files, "train", None, prefix_hops=(1, 2), sw=sw)
  assert pool[: len(plain)] == plain
  added = pool[len(plain) :]
  chains = {q.id for q in sw.train if q.kind == "chain"}
  assert {it.id.rsplit("-p", 1)[0] for it in added} <= chains
  assert {it.bucket for it in added} == {"chain-1", "chain-2"}
  rows = [json.loads(x) for x in (tmp_path / "rl_prefixes_train.jsonl").read_text().splitlines()]
  assert [r["id"] for r in rows] == [it.id for it in added]
  assert {r["split"] for r in rows} == {"train"}
  only = pipeline.rl_pool(files, "train", None, ("chain-1",), prefix_hops=(1, 2), sw=sw)
  assert {it.bucket for it in only} == {"chain-1"} and len(only) == len(chains)
  with pytest.raises(AsearcherError, match="needs the world"):
    pipeline.rl_pool(files, "train", None, prefix_hops=(1,))
  with pytest.raises(AsearcherError, match=r"SynthWikiRL\.prefix_hops must be hop counts >= 1"):
    pipeline.rl_pool(files, "train", None, prefix_hops=(0, 1), sw=sw)
  with pytest.raises(AsearcherError, match="no pooled chain is longer"):
    pipeline.rl_pool(files, "train", None, prefix_hops=(9,), sw=sw)


def test_the_warm_start_expert_plays_the_train_chains_then_their_prefixes(sw):
  assert long_warm_start.expert_questions(sw, ()) == sw.train
  questions = long_warm_start.expert_questions(sw, (1, 2))
  assert questions[: len(sw.train)] == sw.train
  extra = questions[len(sw.train) :]
  assert {q.hops for q in extra} == {1, 2} and {q.split for q in extra} == {"train"}
  long_ids = {q.id for q in sw.train if q.kind == "chain"}
  assert {q.id.rsplit("-p", 1)[0] for q in extra} <= long_ids
  assert len({q.id for q in questions}) == len(questions)
  with pytest.raises(AsearcherError, match=r"LongWarmStart\.prefix_hops must be hop counts >= 1"):
    long_warm_start.expert_questions(sw, (0,))
  with pytest.raises(AsearcherError, match="no train chain is longer"):
    long_warm_start.expert_questions(sw, (9,))
