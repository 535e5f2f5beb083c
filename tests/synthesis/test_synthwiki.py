"""SynthWiki as a synthesis world: the oracle agrees with SynthWiki's own resolver on every chain
question it generates (named or described start, fuzzed values, hidden bridges)."""

from __future__ import annotations

import dataclasses

from asearcher_jax.synthesis import Fuzz, OracleQuery, check
from asearcher_jax.synthesis.synthwiki_oracle import synthwiki_oracle, synthwiki_pages
from asearcher_jax.synthwiki.wiki import TINY, build_world, generate_questions, render_fact, resolve


def as_query(world, q) -> OracleQuery:
  """The statements a synthesis run would hold for `q`: each injected fact about the start
  (fuzzed ones with their vague text), then each chain step."""
  start = world.by_name[q.start]
  statements, fuzzes = [], []
  for c in q.constraints:
    actual = world.value_text(start, c.relation)
    statements.append(render_fact(q.start, c.relation, actual))
    if c.fuzzy:
      fuzzes.append(Fuzz(original=actual, vague=c.value_text()))
  prev = q.start
  for r, b in zip(q.relations, q.bridges, strict=True):
    statements.append(render_fact(prev, r, b))
    prev = b
  return OracleQuery(
    question=q.question, answer=q.answer, statements=tuple(statements), fuzzes=tuple(fuzzes)
  )


def test_oracle_matches_synthwiki_resolver():
  config = dataclasses.replace(TINY, injection_prob=0.8, fuzz_prob=1.0)
  world = build_world(config)
  oracle = synthwiki_oracle(world)
  chains = [q for q in generate_questions(world, config) if q.kind == "chain"]
  assert len(chains) > 50 and any(q.constraints for q in chains)
  assert any(c.fuzzy for q in chains for c in q.constraints)
  for q in chains:
    verdict = check(oracle, as_query(world, q))
    assert verdict.ok and set(verdict.answers) == resolve(world, q) == {q.answer}, q.question
  # Every sentence of every page is a world fact; a changed value is not.
  store, graph = synthwiki_pages(world)
  assert len(store) == len(world.entities) and graph.num_edges > len(world.entities)
  for row in store.rows():
    for sentence in row["contents"].split("\n\n", 1)[1].split(". "):
      assert oracle.statement_true(sentence.rstrip(".") + ".") is True
  q = next(q for q in chains if q.hops == 1 and not q.constraints)
  wrong = as_query(world, q)
  wrong = OracleQuery(question=wrong.question, answer=wrong.answer,
                      statements=(wrong.statements[0].replace(q.answer, "Nowhere"),))  # fmt: skip
  assert check(oracle, wrong).reason in ("oracle_false_statement", "oracle_unverifiable")
