"""SynthWiki questions: k-hop chains walked through the world's graph, comparisons, and the data
synthesis agent's two operations, each checked against the world to keep one answer.

*Injection* replaces the start entity's name by facts about it ("the person born in Kelmar and
trained by Tamerin"), adding one fact at a time until exactly one entity fits. *Fuzzing* then makes
one precise value vague (1873 -> the 1870s, 45210 -> between 40000 and 50000) and is kept only if
the answer is still unique. Question text is compositional: each chain step wraps the previous
noun phrase ("the founder of the organisation Gazor belongs to"), or (`question_style`
"stepwise") lists the steps in search order.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from asearcher_jax.synthwiki.world import RELATIONS, Entity, SynthWikiConfig, World

# Comparable attributes: (question asking for the smaller value, for the larger value).
COMPARISONS: dict[str, tuple[str, str]] = {
  "birth_year": ("Who was born earlier, {a} or {b}?", "Who was born later, {a} or {b}?"),
  "settled_year": (
    "Which was settled earlier, {a} or {b}?",
    "Which was settled later, {a} or {b}?",
  ),
  "founded_year": (
    "Which was founded earlier, {a} or {b}?",
    "Which was founded later, {a} or {b}?",
  ),
  "release_year": (
    "Which was released earlier, {a} or {b}?",
    "Which was released later, {a} or {b}?",
  ),
  "population": (
    "Which has a smaller population, {a} or {b}?",
    "Which has a larger population, {a} or {b}?",
  ),
  "members": ("Which has fewer members, {a} or {b}?", "Which has more members, {a} or {b}?"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Constraint:
  """An injected fact about the start entity: `relation` has `value` (vague when `fuzzy`)."""

  relation: str
  value: str
  fuzzy: bool = False

  def _bucket(self) -> tuple[int, int]:
    v = int(self.value)
    if RELATIONS[self.relation].target == "year":
      return v // 10 * 10, v // 10 * 10 + 10
    width = 10 ** max(len(self.value) - 1, 1)
    return v // width * width, v // width * width + width

  def matches(self, actual: str | None) -> bool:
    if actual is None:
      return False
    if not self.fuzzy:
      return actual == self.value
    lo, hi = self._bucket()
    return actual.isdigit() and lo <= int(actual) < hi

  def value_text(self) -> str:
    if not self.fuzzy:
      return self.value
    lo, hi = self._bucket()
    if RELATIONS[self.relation].target == "year":
      return f"the {lo}s"
    return f"between {lo} and {hi}"

  def text(self) -> str:
    return RELATIONS[self.relation].phrase.format(o=self.value_text())

  @property
  def fuzzable(self) -> bool:
    return RELATIONS[self.relation].target in ("year", "number") and not self.fuzzy


@dataclasses.dataclass(frozen=True, kw_only=True)
class SynthQuestion:
  """One question with everything needed to check it and to play it.

  Attributes:
    id: stable id ("sw{seed}-{n}").
    question / answer: the text and the one gold answer.
    kind: "chain" or "comparison".
    hops: chain steps (pages to read after the start is known); 2 for a comparison.
    start: name of the start entity (comparison: the first of the two).
    start_type: its entity type.
    noun: the noun a described start is called by ("person", "city", "film"), else "".
    constraints: injected facts that describe the start instead of its name (empty: named).
    relations: the chain's relations in order (comparison: the compared attribute).
    bridges: the value after each step (names, the last may be an attribute value); for a
      comparison, the two entities' values.
    compare: comparison only: the two entity names and "min" or "max".
    ops: synthesis operations applied: "injection", "fuzzing".
    gold_ids / gold_titles: the pages that must be read (start and every bridge entity).
    split: "train" or "test".
  """

  id: str
  question: str
  answer: str
  kind: str
  hops: int
  start: str
  start_type: str
  noun: str = ""
  constraints: tuple[Constraint, ...] = ()
  relations: tuple[str, ...]
  bridges: tuple[str, ...]
  compare: tuple[str, ...] = ()
  ops: tuple[str, ...] = ()
  gold_ids: tuple[str, ...] = ()
  gold_titles: tuple[str, ...] = ()
  split: str = ""

  def to_row(self) -> dict[str, Any]:
    """A QA row `data.qa` reads (question, answer, golden_answers, id) plus the metadata."""
    d = dataclasses.asdict(self)
    d["golden_answers"] = [self.answer]
    return d

  @classmethod
  def from_row(cls, row: Mapping[str, Any]) -> SynthQuestion:
    d = {k: v for k, v in row.items() if k != "golden_answers"}
    d["constraints"] = tuple(Constraint(**c) for c in d.get("constraints", ()))
    for k in ("relations", "bridges", "compare", "ops", "gold_ids", "gold_titles"):
      d[k] = tuple(d.get(k, ()))
    return cls(**d)


def noun_of(entity: Entity) -> str:
  """What a described entity is called: its kind for places and works, else its type."""
  return entity.kind if entity.type in ("place", "work") else entity.type


def describe(noun: str, constraints: Sequence[Constraint]) -> str:
  parts = [c.text() for c in constraints]
  body = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
  return f"the {noun} {body}"


def candidates(
  world: World, start_type: str, noun: str, cons: Sequence[Constraint]
) -> list[Entity]:
  """Entities that fit a description (what injection and fuzzing must keep to exactly one)."""
  out = []
  for e in world.by_type[start_type]:
    if noun_of(e) != noun:
      continue
    if all(
      c.matches(world.value_text(e, c.relation) if c.relation in e.facts else None) for c in cons
    ):
      out.append(e)
  return out


def resolve(world: World, q: SynthQuestion) -> set[str]:
  """Every answer the world admits for `q` (a valid question has exactly one)."""
  if q.kind == "comparison":
    a, b, direction = q.compare
    rel = q.relations[0]
    va = int(world.value_text(world.by_name[a], rel))
    vb = int(world.value_text(world.by_name[b], rel))
    if va == vb:
      return {a, b}
    return {a if (va < vb) == (direction == "min") else b}
  if q.constraints:
    starts = candidates(world, q.start_type, q.noun, q.constraints)
  else:
    starts = [world.by_name[q.start]]
  answers = set()
  for e in starts:
    cur: Entity | None = e
    for i, rel in enumerate(q.relations):
      if cur is None or rel not in cur.facts:
        cur = None
        break
      if i == len(q.relations) - 1:
        answers.add(world.value_text(cur, rel))
      else:
        cur = world.entities[cur.facts[rel]]
  return answers


def mentions(entity: Entity) -> set[str]:
  """Ids of the entities the page of `entity` names (its entity-valued facts)."""
  return {v for r, v in entity.facts.items() if not RELATIONS[r].is_attribute}


def chain_entities(world: World, q: SynthQuestion) -> list[str]:
  """Ids of a chain's entities in order: the start, every bridge entity, the answer if an entity."""
  ids = [world.by_name[q.start].id]
  for rel, value in zip(q.relations, q.bridges):
    if not RELATIONS[rel].is_attribute:
      ids.append(world.by_name[value].id)
  return ids


def hop_leaks(world: World, q: SynthQuestion) -> list[str]:
  """Why one search could reveal two hops of chain `q` (empty: every hop needs its own search).

  A fact is stated only on its subject's page, so hop i + 1 can only come out of a search for hop
  i if that search returns the page of the next entity. The rule: among the chain's entities,
  the page of each names only its successor (no back-links, no shortcuts), and no page after the
  start names an entity of an injected description. A search by one entity's name then finds no
  later page of the chain through that name."""
  if q.kind != "chain":
    return []
  chain = chain_entities(world, q)
  names = {i: world.entities[i].name for i in chain}
  out = []
  for i, eid in enumerate(chain):
    allowed = {eid, *chain[i + 1 : i + 2]}
    extra = (mentions(world.entities[eid]) & set(chain)) - allowed
    if extra:
      out.append(f"{names[eid]} names chain entities {sorted(names[x] for x in extra)}")
  described = {
    world.by_name[c.value].id for c in q.constraints if not RELATIONS[c.relation].is_attribute
  }
  for eid in chain[1:]:
    extra = mentions(world.entities[eid]) & described
    if extra:
      out.append(f"{names[eid]} names entities of the start's description")
  return out


def _walk(
  world: World, rng: random.Random, start: Entity, k: int, p_attr: float, isolate: bool = False
):
  """k steps from `start` without revisiting an entity; (relations, entities/values) or None.
  With `isolate`, only steps that keep `hop_leaks`' rule (the page of the next entity names no
  earlier one, and no earlier page names it)."""
  seen = {start.id}
  named = set()  # entities named by the chain's pages before the current one
  cur, rels, path = start, [], []
  for step in range(k):
    hops = [r for r, v in cur.facts.items() if not RELATIONS[r].is_attribute and v not in seen]
    if isolate:
      hops = [
        r
        for r in hops
        if cur.facts[r] not in named and not mentions(world.entities[cur.facts[r]]) & seen
      ]
    if step == k - 1:
      attrs = [r for r in cur.facts if RELATIONS[r].is_attribute]
      if attrs and (not hops or rng.random() < p_attr):
        r = rng.choice(attrs)
        return [*rels, r], [*path, world.value_text(cur, r)]
    if not hops:
      return None
    r = rng.choice(hops)
    named |= mentions(cur)
    cur = world.entities[cur.facts[r]]
    seen.add(cur.id)
    rels.append(r)
    path.append(cur)
  return rels, path


def _chain_text(start_np: str, relations: Sequence[str], style: str = "nested") -> str:
  if style == "stepwise":
    steps = ", then ".join(RELATIONS[r].words for r in relations)
    return f"Starting from {start_np}, follow {steps}. What do you reach?"
  np = start_np
  for r in relations[:-1]:
    np = RELATIONS[r].noun.format(x=np)
  return RELATIONS[relations[-1]].ask.format(x=np)


def _inject(
  world: World,
  rng: random.Random,
  start: Entity,
  relations: Sequence[str],
  bridges: Sequence[str],
  config: SynthWikiConfig,
) -> tuple[list[Constraint], list[str]] | None:
  """Injection (then maybe fuzzing) on the start entity; None when no unique description."""
  noun = noun_of(start)
  pool = [
    Constraint(relation=r, value=world.value_text(start, r))
    for r in start.facts
    if r != relations[0] and world.value_text(start, r) not in bridges
  ]
  rng.shuffle(pool)
  # The first fact is about a linked entity: a description made of numbers alone cannot be
  # searched for (BM25 has no "between 80000 and 90000").
  pool.sort(key=lambda c: RELATIONS[c.relation].is_attribute)
  pool = pool[:1] + sorted(pool[1:], key=lambda _: rng.random())
  cons: list[Constraint] = []
  for c in pool[: config.max_injections]:
    cons.append(c)
    if len(candidates(world, start.type, noun, cons)) == 1:
      break
  else:
    return None
  ops = ["injection"]
  fuzzable = [i for i, c in enumerate(cons) if c.fuzzable]
  if fuzzable and rng.random() < config.fuzz_prob:
    i = rng.choice(fuzzable)
    fuzzed = [*cons[:i], dataclasses.replace(cons[i], fuzzy=True), *cons[i + 1 :]]
    extra = [c for c in pool if c not in cons]
    while len(candidates(world, start.type, noun, fuzzed)) > 1 and extra:
      fuzzed.append(extra.pop(0))  # re-inject until unique again (the agent's alternation)
    precise = [c for c in fuzzed if not c.fuzzy]
    if (
      len(candidates(world, start.type, noun, fuzzed)) == 1
      and len(candidates(world, start.type, noun, precise)) <= config.max_candidates
    ):
      cons, ops = fuzzed, ["injection", "fuzzing"]
  return cons, ops


def _chain_question(world: World, rng: random.Random, k: int, config: SynthWikiConfig):
  start = world.entities[rng.choice(world.ids)]
  walked = _walk(world, rng, start, k, config.attribute_prob, config.isolate_hops)
  if walked is None:
    return None
  rels, path = walked
  bridges = [p.name if isinstance(p, Entity) else p for p in path]
  cons: list[Constraint] = []
  ops: list[str] = []
  start_np = start.name
  if rng.random() < config.injection_prob:
    injected = _inject(world, rng, start, rels, [start.name, *bridges], config)
    if injected is None:
      return None
    cons, ops = injected
    start_np = describe(noun_of(start), cons)
  readers = [start, *[p for p in path[:-1]]]
  q = dict(
    question=_chain_text(start_np, rels, config.question_style),
    answer=bridges[-1],
    kind="chain",
    hops=k,
    start=start.name,
    start_type=start.type,
    noun=noun_of(start) if cons else "",
    constraints=tuple(cons),
    relations=tuple(rels),
    bridges=tuple(bridges),
    ops=tuple(ops),
    gold_ids=tuple(e.id for e in readers),
    gold_titles=tuple(e.name for e in readers),
  )
  if config.isolate_hops and hop_leaks(world, SynthQuestion(id="", **q)):
    return None  # an injected description named by a later page of the chain
  return q


def chain_prefix(
  world: World, q: SynthQuestion, hops: int, style: str = "nested"
) -> SynthQuestion | None:
  """The first `hops` steps of chain `q` as a question of its own (same start, same
  description, the chain's pages up to the bridge it ends at); None when `q` is not a longer
  chain or the shorter question is not unique in the world. Why: shorter chains through the
  same pages give reward to a policy that cannot yet finish the long ones (a curriculum), and
  they are held out exactly when `q` is, since the split follows the start entity."""
  if q.kind != "chain" or not 0 < hops < q.hops:
    return None
  start_np = describe(q.noun, q.constraints) if q.constraints else q.start
  out = dataclasses.replace(
    q,
    id=f"{q.id}-p{hops}",
    question=_chain_text(start_np, q.relations[:hops], style),
    answer=q.bridges[hops - 1],
    hops=hops,
    relations=q.relations[:hops],
    bridges=q.bridges[:hops],
    gold_ids=q.gold_ids[:hops],
    gold_titles=q.gold_titles[:hops],
  )
  if resolve(world, out) != {out.answer} or hop_leaks(world, out):
    return None
  return out


def chain_prefixes(
  world: World, questions: Iterable[SynthQuestion], hops: Sequence[int], style: str = "nested"
) -> list[SynthQuestion]:
  """`chain_prefix` of every question for each h in `hops` (h-major), the unique ones only."""
  questions = list(questions)
  made = [chain_prefix(world, q, h, style) for h in hops for q in questions]
  return [p for p in made if p is not None]


def _comparison_question(world: World, rng: random.Random):
  rel = rng.choice(sorted(COMPARISONS))
  pool = [e for e in world.by_type[RELATIONS[rel].subject] if rel in e.facts]
  a, b = rng.sample(pool, 2)
  va, vb = int(world.value_text(a, rel)), int(world.value_text(b, rel))
  if va == vb:
    return None
  direction = rng.choice(("min", "max"))
  template = COMPARISONS[rel][0 if direction == "min" else 1]
  winner = a if (va < vb) == (direction == "min") else b
  return dict(
    question=template.format(a=a.name, b=b.name),
    answer=winner.name,
    kind="comparison",
    hops=2,
    start=a.name,
    start_type=a.type,
    relations=(rel,),
    bridges=(str(va), str(vb)),
    compare=(a.name, b.name, direction),
    gold_ids=(a.id, b.id),
    gold_titles=(a.name, b.name),
  )


def _make(
  world: World,
  rng: random.Random,
  wanted: list[tuple[int, int]],
  config: SynthWikiConfig,
  seen: set[str],
) -> list[dict[str, Any]]:
  """Up to n new questions for each (hops, n) in `wanted` (0 hops: comparisons); `seen` holds
  the question texts made so far and grows."""
  made: list[dict[str, Any]] = []
  for k, n in wanted:
    got = 0
    for _ in range(n * config.attempts_per_question):
      if got >= n:
        break
      q = _comparison_question(world, rng) if k == 0 else _chain_question(world, rng, k, config)
      if q is None or q["question"] in seen:
        continue
      seen.add(q["question"])
      made.append(q)
      got += 1
  return made


def generate_questions(world: World, config: SynthWikiConfig | None = None) -> list[SynthQuestion]:
  """All questions, each verified unique against the world, split by start entity.

  A question goes to the test split when its start entity (a comparison's first entity) is a
  test entity, so train and test share no chain. Small worlds may yield fewer than asked.
  """
  config = config or world.config
  rng = random.Random(f"synthwiki-questions-{config.seed}")
  n_test = round(len(world.ids) * config.test_fraction)
  test_names = {world.entities[i].name for i in rng.sample(world.ids, n_test)}
  seen: set[str] = set()
  wanted = [(k + 1, n) for k, n in enumerate(config.questions_per_hop)]
  made = _make(world, rng, [*wanted, (0, config.num_comparisons)], config, seen)
  if config.shuffle:
    rng.shuffle(made)
  if config.appended_questions_per_hop:  # after the shuffle, from their own stream
    first = len(config.questions_per_hop) + 1
    appended = list(enumerate(config.appended_questions_per_hop, start=first))
    made += _make(world, random.Random(f"synthwiki-appended-{config.seed}"), appended, config, seen)
  out = []
  for i, q in enumerate(made):
    split = "test" if q["start"] in test_names else "train"
    out.append(SynthQuestion(id=f"sw{config.seed}-{i:05d}", split=split, **q))
  for q in out:  # the invariant every consumer relies on; a failure is a generator bug
    if resolve(world, q) != {q.answer}:
      raise AssertionError(f"question {q.id} does not have a unique answer: {q.question}")
    if config.isolate_hops and hop_leaks(world, q):
      raise AssertionError(f"question {q.id} leaks hops: {hop_leaks(world, q)}")
  return out


def write_questions(questions: Iterable[SynthQuestion], path: str | Path) -> Path:
  """QA jsonl (`data.qa.load_qa_file` reads it; the metadata rides along)."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    for q in questions:
      f.write(json.dumps(q.to_row(), ensure_ascii=False) + "\n")
  return path


def read_questions(path: str | Path) -> list[SynthQuestion]:
  with open(path, encoding="utf-8") as f:
    return [SynthQuestion.from_row(json.loads(line)) for line in f if line.strip()]
