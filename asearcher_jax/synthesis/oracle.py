"""Ground-truth checks for worlds whose facts are known exactly (SynthWiki, toy worlds in tests).

On real wiki pages, "is this statement true?" and "is the answer the only one?" can only be asked
of an LLM. In a procedural world they have exact answers, which both gate what a run writes and
measure how often the LLM checks are right. The `Oracle` protocol is all the loop needs;
`TripleOracle` implements it for any world that is a set of (subject, relation, value) facts plus a
parser that reads the world's fact sentences back out of text -- which is what SynthWiki has
(`synthwiki.world.parse_facts` / `render_fact`).

How a question becomes a query: its statements are parsed into triples; every entity named in a
statement but not in the question text (the answer, and bridge entities that injection replaced
by a description) is a variable, every other name a constant. A value that fuzzing replaced by a
vaguer phrase is a variable restricted by `vague_matches`; a value the question no longer mentions
at all is an unrestricted variable (the question dropped that condition). The answers are the
bindings of the answer variable that make every triple a world fact; a valid question has
exactly one, its answer. Dropping a condition only widens the answer set, so the oracle errs
towards rejecting, never towards accepting an ambiguous question.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

Triple = tuple[str, str, str]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fuzz:
  """A fuzzing edit: the precise `original` detail now reads as `vague` in the question."""

  original: str
  vague: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class OracleQuery:
  """What the oracle needs of a candidate question."""

  question: str
  answer: str
  statements: tuple[str, ...]
  fuzzes: tuple[Fuzz, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class OracleVerdict:
  """The world's verdict on one candidate.

  Attributes:
    ok: every statement is a world fact and the answer set is exactly {answer}.
    reason: why not ("oracle_false_statement", "oracle_unverifiable", "oracle_wrong_answer",
      "oracle_not_unique"), "" when ok.
    answers: every answer the world admits (empty when unverifiable).
    false_statements: statements that are not world facts.
  """

  ok: bool
  reason: str = ""
  answers: tuple[str, ...] = ()
  false_statements: tuple[str, ...] = ()


class Oracle(Protocol):
  """Exact checks against a world's ground truth (see module docstring)."""

  def statement_true(self, statement: str) -> bool | None:
    """True/False when the statement parses into world facts; None when it cannot be read."""
    ...

  def answers(self, query: OracleQuery) -> set[str] | None:
    """Every entity or value satisfying all the question's constraints (None: unverifiable)."""
    ...

  def same(self, a: str, b: str) -> bool:
    """Whether two answer strings name the same world entity or value."""
    ...


def check(oracle: Oracle, query: OracleQuery) -> OracleVerdict:
  """The full verdict: statements true, then the answer set is exactly {answer}."""
  false = []
  for s in query.statements:
    truth = oracle.statement_true(s)
    if truth is None:
      return OracleVerdict(ok=False, reason="oracle_unverifiable")
    if not truth:
      false.append(s)
  if false:
    return OracleVerdict(ok=False, reason="oracle_false_statement", false_statements=tuple(false))
  found = oracle.answers(query)
  if found is None:
    return OracleVerdict(ok=False, reason="oracle_unverifiable")
  answers = tuple(sorted(found))
  if not any(oracle.same(a, query.answer) for a in found):
    return OracleVerdict(ok=False, reason="oracle_wrong_answer", answers=answers)
  if len(found) > 1:
    return OracleVerdict(ok=False, reason="oracle_not_unique", answers=answers)
  return OracleVerdict(ok=True, answers=answers)


_NUM = re.compile(r"-?\d[\d,]*")


def _num(text: str) -> int | None:
  m = _NUM.search(text)
  return int(m.group().replace(",", "")) if m else None


def vague_matches(original: str, vague: str, value: str) -> bool | None:
  """Whether `value` fits the vague description that replaced `original` (None: cannot tell).

  Understands decades ("the 1950s"), centuries ("the 19th century"), ranges ("between 100 and
  200"), bounds ("before 1900", "more than 5,000") and "about N" (within 10%)."""
  v = _num(value)
  if v is None:
    return None
  low = vague.lower()
  if m := re.search(r"(\d{3,4})s\b", low):
    start = int(m.group(1))
    width = 100 if start % 100 == 0 and "century" in low else 10
    return start <= v < start + width
  if m := re.search(r"(\d{1,2})(st|nd|rd|th) century", low):
    c = int(m.group(1))
    return (c - 1) * 100 < v <= c * 100
  nums = [int(x.replace(",", "")) for x in _NUM.findall(low)]
  if "between" in low and len(nums) >= 2:
    return min(nums[:2]) <= v <= max(nums[:2])
  if nums and any(w in low for w in ("before", "less than", "fewer than", "under", "below")):
    return v < nums[0]
  if nums and any(w in low for w in ("after", "more than", "over", "above")):
    return v > nums[0]
  if nums and any(w in low for w in ("about", "around", "roughly", "approximately")):
    return abs(v - nums[0]) <= 0.1 * abs(nums[0])
  return None


def _mentions(text: str, name: str) -> bool:
  return re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text, flags=re.I) is not None


class TripleOracle:
  """An `Oracle` over a world given as facts, plus the parser of its fact sentences.

  Args:
    facts: every (subject, relation, value) fact of the world; values that are entity names
      must be spelled as the entities' names.
    parse: text -> the triples its sentences state (SynthWiki: `parse_facts`).
    entities: the world's entity names (default: every fact subject).
    kind_relation: the relation naming an entity's kind ("city", "guild"), if the world has one:
      when the question says the kind of a hidden entity ("the city governed by X"), the
      variable is restricted to that kind, as the question is.
  """

  def __init__(
    self,
    facts: Iterable[Triple],
    parse: Callable[[str], Sequence[Triple]],
    *,
    entities: Iterable[str] | None = None,
    kind_relation: str | None = None,
  ) -> None:
    self.facts = set(facts)
    self.kind_relation = kind_relation
    self._kinds: dict[str, set[str]] = {}
    for s, r, v in self.facts:
      if r == kind_relation:
        self._kinds.setdefault(s, set()).add(v)
    self.parse = parse
    self.entities = set(entities) if entities is not None else {s for s, _, _ in self.facts}
    self._by_rel: dict[str, list[tuple[str, str]]] = {}
    for s, r, v in self.facts:
      self._by_rel.setdefault(r, []).append((s, v))

  def same(self, a: str, b: str) -> bool:
    return " ".join(a.lower().split()) == " ".join(b.lower().split())

  def statement_true(self, statement: str) -> bool | None:
    triples = self.parse(statement)
    if not triples:
      return None
    return all(t in self.facts for t in triples)

  def answers(self, query: OracleQuery) -> set[str] | None:
    triples = [t for s in query.statements for t in self.parse(s)]
    if not triples:
      return None
    answer_var = "?answer"
    fuzz_of = {f.original: f for f in query.fuzzes if _mentions(query.question, f.vague)}

    def term(x: str) -> tuple[str, Callable[[str], bool] | None]:
      if self.same(x, query.answer):
        return answer_var, None
      if x in self.entities:
        return (x, None) if _mentions(query.question, x) else (f"?{x}", None)
      if _mentions(query.question, x):
        return x, None
      f = fuzz_of.get(x)
      if f is not None:
        return f"?{x}", lambda v, f=f: bool(vague_matches(f.original, f.vague, v))
      return f"?{x}", None  # the question no longer states this value

    atoms, preds = [], {}
    for s, r, v in triples:
      (ts, ps), (tv, pv) = term(s), term(v)
      for t, p in ((ts, ps), (tv, pv)):
        if p is not None:
          preds[t] = p
      atoms.append((ts, r, tv))
      for name, t in ((s, ts), (v, tv)):  # "the city ...": a hidden entity keeps its kind
        for kind in self._kinds.get(name, ()) if t.startswith("?") else ():
          if _mentions(query.question, kind) and (t, self.kind_relation, kind) not in atoms:
            atoms.append((t, self.kind_relation, kind))
    if not any(answer_var in (a[0], a[2]) for a in atoms):
      return None
    for f in fuzz_of.values():
      if not any(f.original in s for s in query.statements):
        return None  # a fuzz of a detail no statement holds: nothing to check it against
      if vague_matches(f.original, f.vague, f.original) is None:
        return None  # a vague phrase this oracle cannot evaluate ("a certain guild")
    out: set[str] = set()
    self._solve(atoms, preds, {}, answer_var, out)
    return out

  def _solve(self, atoms, preds, binding: dict[str, str], goal: str, out: set[str]) -> None:
    if not atoms:
      out.add(binding[goal])
      return

    def bound(t: str) -> bool:
      return not t.startswith("?") or t in binding

    # Most-bound atom first keeps the join small.
    i = max(range(len(atoms)), key=lambda k: bound(atoms[k][0]) + bound(atoms[k][2]))
    s, r, v = atoms[i]
    rest = atoms[:i] + atoms[i + 1 :]
    for fs, fv in self._by_rel.get(r, ()):
      new = dict(binding)
      ok = True
      for t, val in ((s, fs), (v, fv)):
        if not t.startswith("?"):
          ok = ok and t == val
        elif t in new:
          ok = ok and new[t] == val
        else:
          if t in preds and not preds[t](val):
            ok = False
          new[t] = val
      if ok:
        self._solve(rest, preds, new, goal, out)
