"""A hand-built toy world (people, cities, guilds) with exact facts, its pages and its oracle.

Fact sentences follow fixed templates (as SynthWiki's do), so `parse` reads them back out of any
text and `TripleOracle` checks questions against the world exactly.
"""

from __future__ import annotations

import re

from asearcher_jax.synthesis.links import LinkGraph
from asearcher_jax.synthesis.oracle import TripleOracle
from asearcher_jax.tools.retrieval.corpus import PageStore

URL = "https://toy.world/"
TYPES = {
  **dict.fromkeys(["Aldo", "Bexa", "Corin", "Dilan", "Evra", "Fenn"], "person"),
  **dict.fromkeys(["Brin", "Calder", "Dova", "Esk"], "city"),
  **dict.fromkeys(["Ordo", "Pyla", "Quill"], "guild"),
}
FACTS = [
  ("Aldo", "born_in", "Brin"), ("Aldo", "member_of", "Ordo"), ("Aldo", "birth_year", "1953"),
  ("Bexa", "born_in", "Calder"), ("Bexa", "member_of", "Ordo"), ("Bexa", "birth_year", "1958"),
  ("Corin", "born_in", "Dova"), ("Corin", "member_of", "Pyla"), ("Corin", "birth_year", "1971"),
  ("Dilan", "born_in", "Brin"), ("Dilan", "member_of", "Quill"), ("Dilan", "birth_year", "1988"),
  ("Evra", "born_in", "Esk"), ("Evra", "member_of", "Pyla"), ("Evra", "birth_year", "1990"),
  ("Fenn", "born_in", "Calder"), ("Fenn", "member_of", "Quill"), ("Fenn", "birth_year", "1962"),
  ("Ordo", "based_in", "Brin"), ("Ordo", "founded_year", "1821"),
  ("Pyla", "based_in", "Dova"), ("Pyla", "founded_year", "1827"),
  ("Quill", "based_in", "Esk"), ("Quill", "founded_year", "1904"),
  ("Brin", "population", "12000"), ("Calder", "population", "4500"),
  ("Dova", "population", "87000"), ("Esk", "population", "23000"),
]  # fmt: skip
TEMPLATES = {
  "born_in": "{s} was born in {o}.",
  "birth_year": "{s} was born in the year {o}.",
  "member_of": "{s} is a member of {o}.",
  "based_in": "{s} is based in {o}.",
  "founded_year": "{s} was founded in the year {o}.",
  "population": "{s} has a population of {o}.",
}
_NAME = r"[A-Z][a-z]+"
_VALUE = {"born_in": _NAME, "member_of": _NAME, "based_in": _NAME}
_RES = {
  r: re.compile(
    r"(?<![A-Za-z])"
    + re.escape(t)
    .replace(re.escape("{s}"), f"(?P<s>{_NAME})")
    .replace(re.escape("{o}"), f"(?P<o>{_VALUE.get(r, r'[0-9]+')})")
  )
  for r, t in TEMPLATES.items()
}


def sentence(fact: tuple[str, str, str]) -> str:
  s, r, o = fact
  return TEMPLATES[r].format(s=s, o=o)


def parse(text: str) -> list[tuple[str, str, str]]:
  """Every fact sentence in `text`, in order of appearance."""
  found = []
  for r, regex in _RES.items():
    found += [(m.start(), (m["s"], r, m["o"])) for m in regex.finditer(text)]
  return [f for _, f in sorted(found)]


def page_text(name: str) -> str:
  """The entity's page: its type, then every fact mentioning it (as subject or value)."""
  facts = [sentence(f) for f in FACTS if name in (f[0], f[2])]
  return f"{name}\n\n{name} is a {TYPES[name]}. " + " ".join(facts)


def url(name: str) -> str:
  return URL + name


def store() -> PageStore:
  s = PageStore()
  for name in TYPES:
    s.add(url=url(name), title=name, contents=page_text(name))
  return s


def graph() -> LinkGraph:
  return LinkGraph.from_mentions(store())


def oracle() -> TripleOracle:
  return TripleOracle(FACTS, parse, entities=TYPES)
