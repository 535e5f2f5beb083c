"""SynthWiki: every question's answer is unique and reachable through the rendered pages,
injection and fuzzing keep one answer, generation is deterministic, splits are disjoint, and the
world tokenizer keeps names whole and round-trips any text."""

from __future__ import annotations

import dataclasses
import random
import re
import time

import pytest

from asearcher_jax.agent import AsearcherAgentConfig, prompts
from asearcher_jax.agent.asearcher import AsearcherAgent
from asearcher_jax.data.qa import load_qa_file
from asearcher_jax.synthwiki.tokenizer import (
  AGENT_TAGS,
  build_world_tokenizer,
  save_world_tokenizer,
)
from asearcher_jax.synthwiki.wiki import (
  KINDS,
  RELATIONS,
  TINY,
  SynthWikiConfig,
  build_synthwiki,
  fact_table,
  prepare_synthwiki,
  read_questions,
  resolve,
)
from asearcher_jax.tokenizer import ENDOFTEXT, IM_END, IM_START, Tokenizer
from asearcher_jax.tools.retrieval.corpus import load_passages


@pytest.fixture(scope="module")
def tiny():
  return build_synthwiki(TINY)


@pytest.fixture(scope="module")
def quick():
  return build_synthwiki(SynthWikiConfig())


def _fits(noun: str, kind: str) -> bool:
  return kind in KINDS.get(noun, (noun,))


def answer_from_corpus(table: dict[tuple[str, str], str], q) -> str:
  """Follows the question through facts read from the rendered pages alone (no world graph)."""
  if q.kind == "comparison":
    a, b, direction = q.compare
    va, vb = int(table[(a, q.relations[0])]), int(table[(b, q.relations[0])])
    assert va != vb
    return a if (va < vb) == (direction == "min") else b
  cur = q.start
  if q.constraints:  # the description must pick out exactly one page
    subjects = sorted({s for (s, r) in table if r == "kind" and _fits(q.noun, table[(s, r)])})
    fits = [
      s for s in subjects if all(c.matches(table.get((s, c.relation))) for c in q.constraints)
    ]
    assert fits == [q.start], (q.question, fits)
  titles = [cur]
  for rel in q.relations:
    cur = table[(cur, rel)]
    titles.append(cur)
  assert tuple(titles[:-1]) == q.gold_titles
  return cur


@pytest.mark.parametrize("name", ["tiny", "quick"])
def test_every_answer_is_unique_and_reachable_in_the_corpus(name, request):
  sw = request.getfixturevalue(name)
  table = fact_table(sw.world.corpus_rows())
  assert len(sw.questions) > 100
  for q in sw.questions:
    assert resolve(sw.world, q) == {q.answer}, q.question
    assert answer_from_corpus(table, q) == q.answer, q.question
    if q.kind == "chain":
      assert q.answer not in q.question.replace("?", " ").split()
    assert len(q.gold_ids) == len(q.gold_titles) >= 1


def test_injection_and_fuzzing_keep_exactly_one_answer(quick):
  injected = [q for q in quick.questions if "injection" in q.ops]
  fuzzed = [q for q in injected if "fuzzing" in q.ops]
  assert len(injected) > 50 and len(fuzzed) > 20
  for q in injected:
    assert q.start not in q.question and q.constraints
    assert not RELATIONS[q.constraints[0].relation].is_attribute  # about a linked entity
    assert resolve(quick.world, q) == {q.answer}
  for q in fuzzed:
    (c,) = [c for c in q.constraints if c.fuzzy]
    assert not re.search(rf"\b{c.value}\b", q.question)  # 1873 -> the 1870s
    assert c.value_text() in q.question
    assert c.matches(c.value)


def test_questions_are_compositional_and_typed(quick):
  q3 = next(q for q in quick.questions if q.hops == 3 and not q.constraints)
  assert (
    q3.question.count(" of ") + q3.question.count(" belongs to") + q3.question.count(" is in") >= 2
  )
  kinds = {q.kind for q in quick.questions}
  assert kinds == {"chain", "comparison"}
  comp = next(q for q in quick.questions if q.kind == "comparison")
  assert comp.compare[0] in comp.question and comp.compare[1] in comp.question


def test_stepwise_questions_list_the_search_steps_in_order_of_the_same_chains():
  nested = build_synthwiki(TINY)
  stepwise = build_synthwiki(dataclasses.replace(TINY, question_style="stepwise"))
  chains = [(a, b) for a, b in zip(nested.questions, stepwise.questions, strict=True)
            if a.kind == "chain"]  # fmt: skip
  assert len(chains) > 100
  for a, b in chains:  # the same chain and answer, written as the searches it takes
    assert (a.relations, a.answer, a.gold_ids) == (b.relations, b.answer, b.gold_ids)
    steps = ", then ".join(RELATIONS[r].words for r in b.relations)
    assert b.question.endswith(f", follow {steps}. What do you reach?")
    assert a.question != b.question and b.answer not in b.question.split()
    assert resolve(stepwise.world, b) == {b.answer}
  assert dataclasses.replace(TINY, question_style="stepwise") != TINY
  with pytest.raises(ValueError, match="question_style"):
    dataclasses.replace(TINY, question_style="flat")


def test_same_seed_same_bytes_different_seed_differs(tmp_path):
  a, b = build_synthwiki(TINY), build_synthwiki(TINY)
  assert a.digest() == b.digest()
  pa, pb = a.write(tmp_path / "a"), b.write(tmp_path / "b")
  for key in pa:
    assert pa[key].read_bytes() == pb[key].read_bytes()
  other = build_synthwiki(SynthWikiConfig(**{**TINY.__dict__, "seed": 1}))
  assert other.digest() != a.digest()
  names_a = {e.name for e in a.world.entities.values()}
  assert names_a != {e.name for e in other.world.entities.values()}


def test_train_and_test_share_no_question_nor_chain(quick):
  train, test = quick.train, quick.test
  assert train and test and len(train) + len(test) == len(quick.questions)
  assert not {q.question for q in train} & {q.question for q in test}
  assert not {q.id for q in train} & {q.id for q in test}
  assert not {(q.start, q.relations) for q in train} & {(q.start, q.relations) for q in test}
  assert not {q.start for q in train} & {q.start for q in test}  # test starts are unseen


def test_sixteen_hop_chains():
  sw = build_synthwiki(
    SynthWikiConfig(questions_per_hop=(0,) * 15 + (6,), num_comparisons=0, injection_prob=0.5)
  )
  table = fact_table(sw.world.corpus_rows())
  assert len(sw.questions) == 6
  for q in sw.questions:
    assert q.hops == 16 and len(q.relations) == 16 and len(set(q.gold_titles)) == 16
    assert answer_from_corpus(table, q) == q.answer
    assert resolve(sw.world, q) == {q.answer}


def test_sizes_and_speed():
  t0 = time.perf_counter()
  sw = build_synthwiki(SynthWikiConfig())
  assert time.perf_counter() - t0 < 3.0
  assert 200 <= len(sw.world.entities) <= 400
  tiny = build_synthwiki(TINY)
  assert 40 <= len(tiny.world.entities) <= 60
  words = [len(r["contents"].split()) for r in sw.world.corpus_rows()]
  assert max(words) <= 60 and min(words) >= 15
  with pytest.raises(ValueError):
    SynthWikiConfig(test_fraction=1.0)


def test_written_files_are_read_by_the_corpus_and_qa_readers(tiny, tmp_path):
  paths = tiny.write(tmp_path)
  passages = load_passages([paths["corpus"]])
  assert len(passages) == len(tiny.world.entities)
  p = passages[0]
  assert p.title == tiny.world.entities[p.id].name and p.url.endswith(p.title)
  assert p.text == tiny.world.passage(tiny.world.entities[p.id])
  qa = load_qa_file(paths["train"])
  assert [e.id for e in qa] == [q.id for q in tiny.train]
  assert [e.answers for e in qa] == [(q.answer,) for q in tiny.train]
  assert read_questions(paths["test"]) == tiny.test


def test_prepare_writes_data_and_tokenizer(tmp_path):
  paths = prepare_synthwiki(tmp_path, TINY)
  assert sorted(paths) == ["corpus", "test", "tokenizer", "train", "world"]
  tok = Tokenizer.from_dir(paths["tokenizer"])
  name = build_synthwiki(TINY).world.entities["person-0"].name
  assert len(tok.encode(f" {name}")) == 1


def test_link_graph_follows_the_facts(tiny):
  world = tiny.world
  for eid in world.ids:
    text = world.passage(world.entities[eid])
    for linked in world.links(eid):
      assert world.entities[linked].name in text


# -- the world tokenizer ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tiny, tmp_path_factory):
  out = save_world_tokenizer(
    build_world_tokenizer(tiny.world, tiny.questions), tmp_path_factory.mktemp("tok")
  )
  return Tokenizer.from_dir(out)


def test_entity_names_and_tags_are_single_tokens(tiny, tok):
  assert tok.vocab_size < 4000
  for e in tiny.world.entities.values():
    for text in (e.name, f" {e.name}", f"<search> {e.name} </search>", f'"{e.name}"'):
      ids = tok.encode(text)
      assert sum(tok.decode([i]).strip() == e.name for i in ids) == 1, (text, ids)
  for special in (IM_START, IM_END, ENDOFTEXT, *AGENT_TAGS):
    assert len(tok.encode(special)) == 1, special
  assert tok.eos_id == tok.token_to_id(IM_END) and tok.pad_id == tok.token_to_id(ENDOFTEXT)


def test_round_trips_corpus_agent_text_and_arbitrary_text(tiny, tok):
  rng = random.Random(0)
  texts = [r["contents"] for r in tiny.world.corpus_rows()]
  texts += [prompts.synthwiki_prompt(q.question) for q in tiny.questions]
  texts.append(
    "<think>\nok</think>\n<search> x </search>\n\n<information>\n[Doc 1](u):\n</information>"
  )
  texts.append("Ünïcödé 中文 emoji 🙂 tabs\t\r\n  double  spaces <|im_start|>assistant\n")
  for _ in range(50):
    texts.append("".join(chr(rng.randrange(32, 0x3000)) for _ in range(rng.randrange(1, 60))))
  for text in texts:
    assert tok.decode(tok.encode(text)) == text


def test_tokenizer_is_deterministic(tiny, tmp_path):
  a = save_world_tokenizer(build_world_tokenizer(tiny.world, tiny.questions), tmp_path / "a")
  b = save_world_tokenizer(build_world_tokenizer(tiny.world, tiny.questions), tmp_path / "b")
  assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_tokenizer_max_hops_keeps_the_tokenizer_of_the_shorter_world(tmp_path):
  # No comparisons: they are drawn after the chains, so longer chains would change them.
  short = build_synthwiki(dataclasses.replace(TINY, num_comparisons=0, shuffle=True))
  longer = build_synthwiki(
    dataclasses.replace(short.world.config, questions_per_hop=(40, 40, 30, 40, 40))
  )
  assert {q.hops for q in longer.questions} - {q.hops for q in short.questions} == {4, 5}
  kept = dataclasses.replace(longer.world.config, tokenizer_max_hops=3)
  kept_sw = build_synthwiki(kept)
  assert {q.question for q in kept_sw.tokenizer_questions} == {q.question for q in short.questions}
  paths = prepare_synthwiki(tmp_path / "kept", kept)
  ours = save_world_tokenizer(build_world_tokenizer(short.world, short.questions), tmp_path / "t")
  assert (paths["tokenizer"] / "tokenizer.json").read_bytes() == (
    ours / "tokenizer.json"
  ).read_bytes()
  moved = build_world_tokenizer(longer.world, longer.questions)  # without the knob
  assert moved.vocab_size != Tokenizer.from_dir(ours).vocab_size
  with pytest.raises(ValueError, match="tokenizer_max_hops"):
    dataclasses.replace(TINY, tokenizer_max_hops=0)


def test_compact_prompt_is_selected_by_name(tok):
  config = AsearcherAgentConfig(prompt="synthwiki")
  agent = AsearcherAgent(client=None, tokenizer=tok, toolbox=None, config=config)  # type: ignore[arg-type]
  text = agent.prompt("Who founded Vorasin?", False)
  assert text == prompts.synthwiki_prompt("Who founded Vorasin?")
  assert text.endswith("Question: Who founded Vorasin?\n<think>\n") and len(tok.encode(text)) < 80
  assert AsearcherAgentConfig().prompt == "train"
  with pytest.raises(ValueError):
    AsearcherAgentConfig(prompt="tiny")
