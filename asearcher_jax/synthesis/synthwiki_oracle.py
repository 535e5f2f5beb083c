"""SynthWiki as a synthesis world: its pages, its real link graph and its exact oracle.

SynthWiki renders every fact with one sentence template and `parse_facts` reads them back, so a
`TripleOracle` over the world's (name, relation, value) facts checks synthesized questions exactly.
Imports of SynthWiki are local so this package does not depend on it being importable.
"""

from __future__ import annotations

from typing import Any

from asearcher_jax.synthesis.links import LinkGraph
from asearcher_jax.synthesis.oracle import TripleOracle
from asearcher_jax.tools.retrieval.corpus import PageStore


def synthwiki_oracle(world: Any) -> TripleOracle:
  """The exact oracle of a `synthwiki.world.World` (intro "kind" facts included)."""
  from asearcher_jax.synthwiki.world import parse_facts

  facts = []
  for e in world.entities.values():
    facts.append((e.name, "kind", e.kind))
    facts += [(e.name, r, world.value_text(e, r)) for r in e.facts]
  return TripleOracle(
    facts,
    lambda text: [(f.subject, f.relation, f.value) for f in parse_facts(text)],
    entities=[e.name for e in world.entities.values()],
    kind_relation="kind",
  )


def synthwiki_pages(world: Any) -> tuple[PageStore, LinkGraph]:
  """The world's pages (its wiki-18 corpus rows) and its link graph (both directions of every
  entity-valued fact, as the pages themselves link)."""
  store = PageStore()
  url_of = {}
  for row in world.corpus_rows():
    title, _, text = row["contents"].partition("\n")
    store.add(url=row["url"], title=title.strip('"'), contents=f"{title.strip(chr(34))}\n\n{text}")
    url_of[row["id"]] = row["url"]
  graph = LinkGraph()
  for eid in world.entities:
    graph.urls.setdefault(url_of[eid], url_of[eid])
    for other in world.links(eid):
      graph.add(url_of[eid], url_of[other])
  return store, graph
