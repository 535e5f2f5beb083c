"""SynthWiki's world: fictional entities with typed relations and attributes, rendered as pages.

Every entity has an invented single-word name (syllables drawn from a seeded generator), so a
model cannot know any fact without retrieving it and BM25 finds a page from its name alone. Each
fact is rendered by one fixed sentence template, and `parse_facts` reads the same templates back
out of any text: the tests check questions against the rendered corpus rather than the graph, and
the scripted expert extracts bridge entities from the retrieved text in its context with it.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

TYPES = ("person", "place", "organisation", "work")
URL_PREFIX = "https://synthwiki.org/"
COLOURS = (
  "red",
  "blue",
  "green",
  "amber",
  "violet",
  "silver",
  "golden",
  "crimson",
  "teal",
  "ivory",
  "black",
  "white",
)
KINDS = {
  "person": ("painter", "engineer", "poet", "merchant", "sailor", "scholar", "singer", "judge"),
  "organisation": ("guild", "company", "university", "society", "order", "bank"),
}
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "th", "dr", "kr")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "io")
_CODAS = ("n", "r", "l", "k", "m", "th", "x", "z", "nd", "rk")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Relation:
  """One typed fact kind and every way it is written.

  Attributes:
    name: the relation's id (`born_in`, `founded_year`, ...).
    subject: the entity type it is a fact about.
    target: the entity type of its value, or the value kind of an attribute (year, number, colour).
    sentence: how the corpus states it (`{s}` subject name, `{o}` value).
    noun: noun phrase for a chain step (`{x}` is the previous phrase); None for attributes.
    ask: the question when this is the chain's last step.
    phrase: the relative-clause fragment an injected constraint uses (`{o}` the value).
    words: the words of `sentence` a searcher adds to the subject's name.
  """

  name: str
  subject: str
  target: str
  sentence: str
  noun: str | None
  ask: str
  phrase: str
  words: str

  @property
  def is_attribute(self) -> bool:
    return self.target not in TYPES


def _r(name, subject, target, sentence, noun, ask, phrase, words) -> Relation:
  return Relation(
    name=name,
    subject=subject,
    target=target,
    sentence=sentence,
    noun=noun,
    ask=ask,
    phrase=phrase,
    words=words,
  )


RELATIONS: dict[str, Relation] = {
  r.name: r
  for r in (
    _r("born_in", "person", "place", "{s} was born in {o}.", "the birthplace of {x}",
       "Where was {x} born?", "born in {o}", "born in"),
    _r("birth_year", "person", "year", "{s} was born in the year {o}.", None,
       "In which year was {x} born?", "born in {o}", "born year"),
    _r("member_of", "person", "organisation", "{s} is a member of {o}.",
       "the organisation {x} belongs to", "Which organisation does {x} belong to?",
       "belonging to {o}", "member of"),
    _r("spouse", "person", "person", "{s} is married to {o}.", "the spouse of {x}",
       "Who is {x} married to?", "married to {o}", "married to"),
    _r("mentor", "person", "person", "{s} was trained by {o}.", "the mentor of {x}",
       "Who trained {x}?", "trained by {o}", "trained by"),
    _r("favourite_colour", "person", "colour", "The favourite colour of {s} is {o}.", None,
       "What is the favourite colour of {x}?", "whose favourite colour is {o}",
       "favourite colour"),
    _r("located_in", "place", "place", "{s} is located in {o}.", "the country {x} is in",
       "In which country is {x}?", "located in {o}", "located in"),
    _r("capital", "place", "place", "The capital of {s} is {o}.", "the capital of {x}",
       "What is the capital of {x}?", "whose capital is {o}", "capital"),
    _r("governed_by", "place", "person", "{s} is governed by {o}.", "the governor of {x}",
       "Who governs {x}?", "governed by {o}", "governed by"),
    _r("population", "place", "number", "{s} has a population of {o}.", None,
       "What is the population of {x}?", "with a population of {o}", "population"),
    _r("settled_year", "place", "year", "{s} was settled in the year {o}.", None,
       "In which year was {x} settled?", "settled in {o}", "settled year"),
    _r("founded_by", "organisation", "person", "{s} was founded by {o}.", "the founder of {x}",
       "Who founded {x}?", "founded by {o}", "founded by"),
    _r("based_in", "organisation", "place", "{s} is based in {o}.", "the home city of {x}",
       "Where is {x} based?", "based in {o}", "based in"),
    _r("led_by", "organisation", "person", "{s} is led by {o}.", "the leader of {x}",
       "Who leads {x}?", "led by {o}", "led by"),
    _r("founded_year", "organisation", "year", "{s} was founded in the year {o}.", None,
       "In which year was {x} founded?", "founded in {o}", "founded year"),
    _r("members", "organisation", "number", "{s} has {o} members.", None,
       "How many members does {x} have?", "with {o} members", "members"),
    _r("emblem", "organisation", "colour", "The emblem of {s} is {o}.", None,
       "What colour is the emblem of {x}?", "with a {o} emblem", "emblem colour"),
    _r("directed_by", "work", "person", "{s} was directed by {o}.", "the director of {x}",
       "Who directed {x}?", "directed by {o}", "directed by"),
    _r("written_by", "work", "person", "{s} was written by {o}.", "the author of {x}",
       "Who wrote {x}?", "written by {o}", "written by"),
    _r("produced_by", "work", "organisation", "{s} was produced by {o}.", "the producer of {x}",
       "Who produced {x}?", "produced by {o}", "produced by"),
    _r("published_by", "work", "organisation", "{s} was published by {o}.",
       "the publisher of {x}", "Who published {x}?", "published by {o}", "published by"),
    _r("set_in", "work", "place", "{s} is set in {o}.", "the setting of {x}",
       "Where is {x} set?", "set in {o}", "set in"),
    _r("release_year", "work", "year", "{s} was released in the year {o}.", None,
       "In which year was {x} released?", "released in {o}", "released year"),
  )
}  # fmt: skip
INTRO = "{s} is {o}."  # o: "a guild", "an engineer"
_NAME_RE = r"[A-Z][a-z]+"
_VALUE_RE = {
  "year": r"\d{3,4}",
  "number": r"\d+",
  "colour": "|".join(COLOURS),
  **{t: _NAME_RE for t in TYPES},
}


def _template_regex(template: str, target: str) -> re.Pattern[str]:
  pattern = re.escape(template)
  pattern = pattern.replace(re.escape("{s}"), f"(?P<s>{_NAME_RE})")
  pattern = pattern.replace(re.escape("{o}"), f"(?P<o>{_VALUE_RE[target]})")
  return re.compile(r"(?<![A-Za-z])" + pattern)


_FACT_RES = {name: _template_regex(r.sentence, r.target) for name, r in RELATIONS.items()}
_INTRO_RE = re.compile(r"(?<![A-Za-z])(?P<s>[A-Z][a-z]+) is an? (?P<o>[a-z]+)\.")


@dataclasses.dataclass(frozen=True)
class Fact:
  """A (subject name, relation, value) triple read from text; `pos` orders facts in the text."""

  subject: str
  relation: str
  value: str
  pos: int = 0


def parse_facts(text: str) -> list[Fact]:
  """Every fact sentence in `text` (corpus, search results, notes), in order of appearance.

  The relation `kind` holds intro sentences ("Vorasin is a guild.").
  """
  out = [Fact(m["s"], "kind", m["o"], m.start()) for m in _INTRO_RE.finditer(text)]
  for name, regex in _FACT_RES.items():
    out += [Fact(m["s"], name, m["o"], m.start()) for m in regex.finditer(text)]
  return sorted(out, key=lambda f: (f.pos, f.relation))


def render_fact(subject: str, relation: str, value: Any) -> str:
  """The one sentence that states a fact (what `parse_facts` reads back)."""
  if relation == "kind":
    article = "an" if str(value)[:1] in "aeio" else "a"
    return INTRO.format(s=subject, o=f"{article} {value}")
  return RELATIONS[relation].sentence.format(s=subject, o=value)


@dataclasses.dataclass(kw_only=True)
class Entity:
  """One fictional entity. `facts` maps relation -> value (entity id or attribute value)."""

  id: str
  name: str
  type: str
  kind: str
  facts: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SynthWikiConfig:
  """Size and shape of a SynthWiki world and of its question set (defaults: the quickstart)."""

  # Seed of everything: the same seed gives a byte-identical world, corpus and question set.
  seed: int = 0
  # Entities per type.
  num_people: int = 120
  num_places: int = 48
  num_organisations: int = 40
  num_works: int = 48
  # Probability that an optional relation (member_of, spouse, mentor, led_by, ...) is present.
  relation_prob: float = 0.85
  # Questions wanted per hop count: entry i is the number of (i + 1)-hop chain questions.
  questions_per_hop: tuple[int, ...] = (300, 300, 200, 120)
  # Longer chains appended after all the others (entry i: (len(questions_per_hop) + i + 1)-hop
  # chains), from their own random stream and unshuffled, so that the other questions, their
  # order, ids and splits are exactly those of the world without them: an RL pool can get chains
  # longer than any evaluated ones while the first N held-out questions stay the same.
  appended_questions_per_hop: tuple[int, ...] = ()
  # Comparison questions ("Which was founded earlier, A or B?").
  num_comparisons: int = 120
  # Probability that a chain's last step asks for an attribute (a year, number or colour).
  attribute_prob: float = 0.4
  # Probability that a chain question's start entity is described by injected facts instead of
  # being named; at most `max_injections` facts are injected (fewer when already unique).
  injection_prob: float = 0.25
  max_injections: int = 3
  # Probability that an injected question then has one precise value fuzzed (1873 -> the 1870s).
  fuzz_prob: float = 0.7
  # A description's precise facts fit at most this many entities, so that one search (top-k
  # documents) can list every candidate; a vague value cannot be searched for.
  max_candidates: int = 3
  # Fraction of entities whose questions (as start entity) go to the test split.
  test_fraction: float = 0.2
  # Generation attempts per wanted question before settling for fewer (small worlds run dry).
  attempts_per_question: int = 40
  # Chains whose every hop needs its own search: among the chain's entities (and an injected
  # start's constraint entities), each page mentions only the next one (`questions.hop_leaks`).
  isolate_hops: bool = False
  # Shuffle the questions before numbering them, so the first N of a split mix every kind
  # (otherwise they come in hop order: 1-hop first).
  shuffle: bool = False
  # How a chain question is written: "nested" (each step wraps the last noun phrase: "the mentor
  # of the leader of the organisation Gazor belongs to", read inside out) or "stepwise" (the
  # steps in the order they are searched: "Starting from Gazor, follow led by, then trained by.
  # What do you reach?"). Both need one search per hop; stepwise leaves out the parsing.
  question_style: str = "nested"
  # Only questions of at most this many hops train the world tokenizer (None: all of them), so a
  # world given longer chains keeps the tokenizer, and so the checkpoints, of the shorter one.
  tokenizer_max_hops: int | None = None

  def __post_init__(self) -> None:
    if min(self.num_people, self.num_places, self.num_organisations) < 4 or self.num_works < 1:
      raise ValueError("a world needs >= 4 people, places and organisations and >= 1 work")
    for name in ("relation_prob", "attribute_prob", "injection_prob", "fuzz_prob"):
      if not 0 <= getattr(self, name) <= 1:
        raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
    if self.question_style not in ("nested", "stepwise"):
      raise ValueError(
        f"question_style must be 'nested' or 'stepwise', got {self.question_style!r}"
      )
    if not 0 <= self.test_fraction < 1:
      raise ValueError(f"test_fraction must be in [0, 1), got {self.test_fraction}")
    counts = (*self.questions_per_hop, *self.appended_questions_per_hop, self.num_comparisons)
    if any(n < 0 for n in counts):
      raise ValueError("question counts must be >= 0")
    if self.tokenizer_max_hops is not None and self.tokenizer_max_hops < 1:
      raise ValueError(f"tokenizer_max_hops must be >= 1 or None, got {self.tokenizer_max_hops}")

  @property
  def num_entities(self) -> int:
    return self.num_people + self.num_places + self.num_organisations + self.num_works


# CI-sized world (~50 entities) with 1-3-hop questions.
TINY = SynthWikiConfig(
  num_people=20,
  num_places=12,
  num_organisations=10,
  num_works=8,
  questions_per_hop=(40, 40, 30),
  num_comparisons=20,
)


def make_names(rng: random.Random, n: int) -> list[str]:
  """n distinct invented names; none is a prefix of another or an English-looking stem."""
  names: list[str] = []
  seen: set[str] = set()
  while len(names) < n:
    syl = rng.choice((2, 2, 3))
    word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syl))
    word += rng.choice(_CODAS)
    if (
      len(word) > 11 or word in seen or any(word.startswith(s) or s.startswith(word) for s in seen)
    ):
      continue
    seen.add(word)
    names.append(word.capitalize())
  return names


class World:
  """Entities by id, names, the link graph and the rendered pages."""

  def __init__(self, entities: Iterable[Entity], config: SynthWikiConfig) -> None:
    self.config = config
    self.entities: dict[str, Entity] = {e.id: e for e in entities}
    self.by_name: dict[str, Entity] = {e.name: e for e in self.entities.values()}
    # Entity ids in creation order (never a set: iteration order must not depend on hashing).
    self.ids: list[str] = list(self.entities)
    self.by_type: dict[str, list[Entity]] = {t: [] for t in TYPES}
    for e in self.entities.values():
      self.by_type[e.type].append(e)

  def value_text(self, entity: Entity, relation: str) -> str:
    """The value of a fact as the corpus writes it (a name for entity-valued relations)."""
    value = entity.facts[relation]
    return self.entities[value].name if not RELATIONS[relation].is_attribute else str(value)

  def links(self, entity_id: str) -> list[str]:
    """Ids of the entities the page of `entity_id` mentions (its outgoing link graph edges)."""
    e = self.entities[entity_id]
    return sorted({v for r, v in e.facts.items() if not RELATIONS[r].is_attribute}, key=self._order)

  def _order(self, entity_id: str) -> int:
    return int(entity_id.rsplit("-", 1)[1])

  def passage(self, entity: Entity) -> str:
    """The page text: intro sentence, then one sentence per fact in relation order."""
    parts = [render_fact(entity.name, "kind", entity.kind)]
    for r in RELATIONS:
      if r in entity.facts:
        parts.append(render_fact(entity.name, r, self.value_text(entity, r)))
    return " ".join(parts)

  def corpus_rows(self) -> list[dict[str, str]]:
    """wiki-18 rows: `{"id", "contents": '"Title"\\ntext', "url"}`, one per entity."""
    return [
      {"id": e.id, "contents": f'"{e.name}"\n{self.passage(e)}', "url": URL_PREFIX + e.name}
      for e in self.entities.values()
    ]

  def write_corpus(self, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
      for row in self.corpus_rows():
        f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path

  def to_json(self) -> dict[str, Any]:
    return {
      "config": dataclasses.asdict(self.config),
      "entities": [dataclasses.asdict(e) for e in self.entities.values()],
    }


def _pick(rng: random.Random, items: list[Entity], exclude: Entity | None = None) -> Entity:
  while True:
    e = rng.choice(items)
    if e is not exclude:
      return e


def build_world(config: SynthWikiConfig) -> World:
  """The entities and their facts, drawn in a fixed order from one seeded generator."""
  rng = random.Random(f"synthwiki-world-{config.seed}")
  counts = {
    "person": config.num_people,
    "place": config.num_places,
    "organisation": config.num_organisations,
    "work": config.num_works,
  }
  names = make_names(rng, sum(counts.values()))
  ents: dict[str, list[Entity]] = {t: [] for t in TYPES}
  i = 0
  n_countries = max(2, config.num_places // 6)
  for t in TYPES:
    for j in range(counts[t]):
      if t == "place":
        kind = "country" if j < n_countries else "city"
      elif t == "work":
        kind = rng.choice(("film", "book"))
      else:
        kind = rng.choice(KINDS[t])
      ents[t].append(Entity(id=f"{t}-{i}", name=names[i], type=t, kind=kind))
      i += 1
  people, orgs, works = ents["person"], ents["organisation"], ents["work"]
  countries = [p for p in ents["place"] if p.kind == "country"]
  cities = [p for p in ents["place"] if p.kind == "city"]
  p_opt = config.relation_prob

  for k, city in enumerate(cities):  # every country gets at least one city
    country = countries[k] if k < len(countries) else rng.choice(countries)
    city.facts["located_in"] = country.id
  for country in countries:
    own = [c for c in cities if c.facts["located_in"] == country.id]
    country.facts["capital"] = rng.choice(own).id
  for place in ents["place"]:
    place.facts["governed_by"] = rng.choice(people).id
    place.facts["population"] = rng.randrange(2_000, 990_000)
    place.facts["settled_year"] = rng.randrange(900, 1800)
  order = people[:]
  rng.shuffle(order)
  for a, b in zip(order[0::2], order[1::2]):
    if rng.random() < p_opt:
      a.facts["spouse"], b.facts["spouse"] = b.id, a.id
  for person in people:
    person.facts["born_in"] = rng.choice(cities).id
    person.facts["birth_year"] = rng.randrange(1700, 1990)
    if rng.random() < p_opt:
      person.facts["member_of"] = rng.choice(orgs).id
    if rng.random() < p_opt:
      person.facts["mentor"] = _pick(rng, people, person).id
    person.facts["favourite_colour"] = rng.choice(COLOURS)
  for org in orgs:
    org.facts["founded_by"] = rng.choice(people).id
    org.facts["based_in"] = rng.choice(cities).id
    if rng.random() < p_opt:
      org.facts["led_by"] = rng.choice(people).id
    org.facts["founded_year"] = rng.randrange(1500, 1990)
    org.facts["members"] = rng.randrange(12, 9_000)
    org.facts["emblem"] = rng.choice(COLOURS)
  for work in works:
    if work.kind == "film":
      work.facts["directed_by"] = rng.choice(people).id
      if rng.random() < p_opt:
        work.facts["produced_by"] = rng.choice(orgs).id
    else:
      work.facts["written_by"] = rng.choice(people).id
      if rng.random() < p_opt:
        work.facts["published_by"] = rng.choice(orgs).id
    work.facts["set_in"] = rng.choice(ents["place"]).id
    work.facts["release_year"] = rng.randrange(1850, 2020)
  # Facts in relation order, so the rendered page and the JSON never depend on draw order.
  for e in (e for t in TYPES for e in ents[t]):
    e.facts = {r: e.facts[r] for r in RELATIONS if r in e.facts}
  return World((e for t in TYPES for e in ents[t]), config)


def fact_table(rows: Iterable[Mapping[str, str]]) -> dict[tuple[str, str], str]:
  """(subject, relation) -> value, read from corpus rows' text alone (no world needed)."""
  table: dict[tuple[str, str], str] = {}
  for row in rows:
    for f in parse_facts(row["contents"]):
      table[(f.subject, f.relation)] = f.value
  return table
