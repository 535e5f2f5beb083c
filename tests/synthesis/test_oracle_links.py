"""The oracle on the toy world, vague descriptions, and the link graph on shipped HotpotQA."""

from __future__ import annotations

import json

import pytest

from asearcher_jax.apps.synth import load_store, seeds_from_pages
from asearcher_jax.synthesis import (
  Fuzz,
  LinkGraph,
  OracleQuery,
  check,
  sample_pages,
  vague_matches,
)
from asearcher_jax.testing import synth_toyworld as W
from asearcher_jax.tools.retrieval.corpus import PageStore


def q(question, answer, *statements, fuzzes=()):
  return OracleQuery(question=question, answer=answer, statements=statements, fuzzes=fuzzes)


def test_oracle_verdicts():
  o = W.oracle()
  assert o.statement_true("Aldo was born in Brin.") is True
  assert o.statement_true("Aldo was born in Esk.") is False
  assert o.statement_true("Aldo likes tea.") is None
  ok = check(o, q("Which city was Aldo born in?", "Brin", "Aldo was born in Brin."))
  assert ok.ok and ok.answers == ("Brin",)
  # A hidden bridge (the member of Ordo: Aldo or Bexa) is a variable: two cities qualify.
  amb = check(o, q("Which city was the member of Ordo born in?", "Brin",
                   "Aldo was born in Brin.", "Aldo is a member of Ordo."))  # fmt: skip
  assert amb.reason == "oracle_not_unique" and amb.answers == ("Brin", "Calder")
  # ... pinning the bridge by a precise fact makes it unique; fuzzing that fact undoes it.
  facts = ("Aldo was born in Brin.", "Aldo is a member of Ordo.", "Aldo was born in the year 1953.")
  pinned = check(o, q("Which city was the member of Ordo born in the year 1953 born in?", "Brin",
                      *facts))  # fmt: skip
  assert pinned.ok and pinned.answers == ("Brin",)
  fuzzed = check(o, q("Which city was the member of Ordo born in the 1950s born in?", "Brin",
                      *facts, fuzzes=(Fuzz(original="1953", vague="the 1950s"),)))  # fmt: skip
  assert fuzzed.answers == ("Brin", "Calder")  # Bexa (1958, Calder) fits the 1950s too
  dec = check(o, q("Which guild was founded in the 1900s?", "Quill",
                   "Quill was founded in the year 1904.",
                   fuzzes=(Fuzz(original="1904", vague="the 1900s"),)))  # fmt: skip
  assert dec.ok
  bad = check(o, q("Which city was Aldo born in?", "Esk", "Aldo was born in Esk."))
  assert bad.reason == "oracle_false_statement" and bad.false_statements
  wrong = check(o, q("Which city was Aldo born in?", "Calder", "Aldo was born in Brin."))
  assert wrong.reason == "oracle_unverifiable"  # the answer is in no statement
  vague = check(o, q("Which city was a certain person born in?", "Brin", "Aldo was born in Brin.",
                     fuzzes=(Fuzz(original="Aldo", vague="a certain person"),)))  # fmt: skip
  assert vague.reason == "oracle_unverifiable"
  assert check(o, q("Who?", "Brin", "no facts here")).reason == "oracle_unverifiable"


@pytest.mark.parametrize(
  ("vague", "value", "want"),
  [
    ("the 1950s", "1953", True), ("the 1950s", "1960", False), ("the 19th century", "1821", True),
    ("between 10,000 and 20,000", "12000", True), ("before 1900", "1904", False),
    ("more than 5000", "12000", True), ("about 12,000", "12500", True), ("somewhere", "1", None),
  ],
)  # fmt: skip
def test_vague_matches(vague, value, want):
  assert vague_matches("0", vague, value) is want


def test_link_graph_on_shipped_hotpotqa(tmp_path):
  store = load_store(None, None)
  assert len(store) > 900
  graph = LinkGraph.from_mentions(store)
  linked = [r["url"] for r in store.rows() if graph.degree(r["url"]) > 0]
  assert graph.num_edges > 200 and len(linked) > 100
  # Edges are real mentions: the target's title occurs in the source page.
  for src_key, dsts in list(graph.out.items())[:50]:
    src = store.get(graph.urls[src_key])
    for d in dsts:
      title = store.get(graph.urls[d])["title"].split(" (")[0]
      assert title in src["contents"]
  a = sample_pages(store, graph, 10, seed=3)
  assert a == sample_pages(store, graph, 10, seed=3) and a != sample_pages(store, graph, 10, seed=4)
  assert all(graph.degree(u) >= 1 for u in a)
  assert [s.id for s in seeds_from_pages(store, graph, 5, 1)] == [
    s.id for s in seeds_from_pages(store, graph, 5, 1)
  ]
  # Round trip through ASearcher's links format.
  path = tmp_path / "links.json"
  path.write_text(json.dumps(graph.to_json()))
  again = LinkGraph.from_links_file(path, store)
  assert again.num_edges == graph.num_edges
  assert again.neighbours(a[0]) == graph.neighbours(a[0])


def test_links_file_drops_unknown_pages():
  store = PageStore()
  for t in ("A", "B"):
    store.add(url=f"https://en.wikipedia.org/wiki/{t}", title=t, contents=f"{t} text")
  links = {
    "https://en.wikipedia.org/wiki/A": {
      "links": [
        "https://en.wikipedia.org/w/index.php?title=B",
        "https://en.wikipedia.org/wiki/Missing",
      ]
    }
  }
  import tempfile
  from pathlib import Path

  with tempfile.TemporaryDirectory() as d:
    p = Path(d) / "links.json"
    p.write_text(json.dumps(links))
    g = LinkGraph.from_links_file(p, store)
  assert g.num_edges == 1 and g.neighbours("https://en.wikipedia.org/wiki/B") == [
    "https://en.wikipedia.org/wiki/A"]  # fmt: skip
