"""A scripted expert that plays the policy for the real `AsearcherAgent` on SynthWiki questions.

It is a `GenerationClient`: each call it decodes the context, works out from it where the episode
stands and writes the next turn in the ASearcher tag protocol, encoded with the world tokenizer
(so the agent records exactly the ids it returned and trajectories are token-exact). It may look
the question up to learn the chain's relations, but every bridge entity comes out of the
retrieved text in its context (`parse_facts`), and it notes each one in its read turn, because
pages are compacted after being read. When retrieval misses, it searches again with a different
query, then opens the page by URL, then gives up with a guess, as a policy would.

Imperfection (`ExpertConfig`) makes it guess early, write sloppy queries, skip a search or misread
a result, each with its own seeded probability, so a policy cloned from it has room to improve.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import random
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from asearcher_jax.agent.asearcher import AsearcherAgentConfig
from asearcher_jax.agent.protocol import ACT_STOPS, iter_matches
from asearcher_jax.agent.trajectory import Trajectory
from asearcher_jax.serving.types import GenerationResult, RecordedCall, SamplingParams
from asearcher_jax.synthwiki.questions import SynthQuestion
from asearcher_jax.synthwiki.world import (
  COLOURS,
  KINDS,
  RELATIONS,
  URL_PREFIX,
  World,
  parse_facts,
)
from asearcher_jax.tokenizer import Tokenizer

# What the expert writes besides fact sentences (also fed to the world tokenizer's training).
PLAN = "I need {what}."
FOUND = "{s} is the {noun} in question."
MISSING = "{s} is not in these results."
NO_MATCH = "No {noun} here matches."
# With `plan_notes`: the chain's relations still to follow, by their search words.
NEXT = "Next: {steps}."
# A tool call and the result it got, as the context holds them.
_CALL_RE = re.compile(r"<(search|access)>\s*(.*?)\s*</\1>\s*<information>(.*?)</information>", re.S)
_FOUND_RE = re.compile(r"(?<![A-Za-z])(?P<s>[A-Z][a-z]+) is the (?P<noun>[a-z]+) in question\.")
# The agent's budgets the quickstart uses: short turns, small context, 3 documents per search.
COMPACT_AGENT = AsearcherAgentConfig(
  prompt="synthwiki", topk=3, max_turns=40, max_tokens=4096, max_new_tokens=64
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertConfig:
  """How good the expert is; all probabilities 0 is the perfect expert."""

  # Seed of the expert's own choices (mixed with the request's sampling seed and the context).
  seed: int = 0
  # Per act turn before the chain is resolved: answer now with a guess.
  p_guess: float = 0.0
  # Per search: a sloppy query that leaves out the entity's name (retrieval then misses).
  p_sloppy_query: float = 0.0
  # Per read turn that found a bridge: also note the next hop without searching (made up).
  p_skip_search: float = 0.0
  # Per bridge found: note a wrong value seen in the results instead.
  p_misread: float = 0.0
  # Tool calls for one hop before giving up with a guess (search, search by name, open page).
  max_attempts: int = 3
  # Chains only, the long-horizon weakness: once this many hops are resolved, answer with a guess
  # instead of searching on; drawn per episode uniformly from [lo, hi] (the episode's sampling
  # seed and question pick it). Chains of at most that many hops are played out. None: never.
  give_up_after_hops: tuple[int, int] | None = None
  # Search results are snippets (the agent's `doc_sentences`: a page's title and first sentence),
  # so a hop is a search, then an `access` of the subject's page found in them, then the note;
  # a described start opens the results' pages of its kind until one matches.
  read_pages: bool = False
  # Chains only: the first turn lists the chain's relations in the order they are searched
  # (`NEXT`), and every note that resolves a hop ends with those still to follow, so the next
  # search's relation is copied from the latest note instead of counted out of the question's
  # nested phrase (a wrong relation was the commonest break of the page warm start's own
  # episodes, 2026-11-27). The agent needs room for it: ~3 tokens a relation in the first turn.
  plan_notes: bool = False

  def __post_init__(self) -> None:
    for name in ("p_guess", "p_sloppy_query", "p_skip_search", "p_misread"):
      if not 0 <= getattr(self, name) <= 1:
        raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
    if self.max_attempts < 1:
      raise ValueError("max_attempts must be >= 1")
    g = self.give_up_after_hops
    if g is not None and (len(g) != 2 or not 1 <= g[0] <= g[1]):
      raise ValueError(f"give_up_after_hops must be (lo, hi) with 1 <= lo <= hi, got {g}")

  @classmethod
  def imperfect(cls, level: float, *, seed: int = 0) -> ExpertConfig:
    """One knob for all four mistakes: level 0 is perfect, 1 is a poor searcher."""
    level = min(max(level, 0.0), 1.0)
    return cls(
      seed=seed,
      p_guess=0.25 * level,
      p_sloppy_query=0.5 * level,
      p_skip_search=0.3 * level,
      p_misread=0.3 * level,
    )


@dataclasses.dataclass
class _View:
  """The decoded context split into what the expert reads."""

  question: SynthQuestion
  gen: str  # everything after the prompt
  docs: str  # the tool results, concatenated
  notes: str  # `gen` with tool results blanked (positions kept)


def _noun_fits(noun: str, kind: str) -> bool:
  return kind in KINDS.get(noun, (noun,))


class SynthWikiExpert:
  """`GenerationClient` playing SynthWiki questions; stateless (everything comes from context)."""

  def __init__(
    self,
    world: World,
    questions: Iterable[SynthQuestion],
    tokenizer: Tokenizer,
    config: ExpertConfig | None = None,
    *,
    version: int = 0,
    record: bool = False,
  ) -> None:
    self.world = world
    self.tokenizer = tokenizer
    self.config = config or ExpertConfig()
    self.by_text = {q.question: q for q in questions}
    # The policy version stamped on every token.
    self.version = version
    # Every call as `testing.assert_token_exact` wants it (when `record`; one episode at a time).
    self.calls: list[RecordedCall] = []
    self.record = record

  # -- the GenerationClient interface ---------------------------------------------------------

  async def generate(
    self,
    token_ids: Sequence[int],
    sampling: SamplingParams,
    max_new_tokens: int,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] | None = None,
  ) -> GenerationResult:
    await asyncio.sleep(0)
    context = self.tokenizer.decode(token_ids)
    digest = hashlib.sha256(context.encode()).hexdigest()[:16]
    rng = random.Random(f"{self.config.seed}|{sampling.seed}|{digest}")
    read_turn = "</think>" in stop and not any(s in stop for s in ACT_STOPS)
    text = self.next_turn(context, read_turn=read_turn, rng=rng, episode_seed=sampling.seed)
    result = self._result(text, tuple(stop), max_new_tokens, stop_token_ids)
    if self.record:
      self.calls.append(RecordedCall(list(token_ids), result, tuple(stop), max_new_tokens))
    return result

  def _result(self, text, stop, max_new_tokens, stop_token_ids) -> GenerationResult:
    cut = min((text.find(s) + len(s) for s in stop if s in text), default=None)
    tokens = self.tokenizer.encode(text if cut is None else text[:cut])
    if cut is None:
      stops = self.tokenizer.stop_token_ids if stop_token_ids is None else tuple(stop_token_ids)
      tokens.append(stops[0] if stops else self.tokenizer.eos_id)
    reason = "stop"
    if len(tokens) > max_new_tokens:
      tokens, reason = tokens[:max_new_tokens], "length"
    return GenerationResult(
      tokens=tokens,
      logprobs=[0.0] * len(tokens),  # a deterministic policy: probability 1 per token
      versions=[self.version] * len(tokens),
      stop_reason=reason,
    )

  # -- reading the context --------------------------------------------------------------------

  def find_question(self, context: str) -> tuple[SynthQuestion, int]:
    """The question in the prompt and where its text ends (the world tells its chain)."""
    m = re.search(r"Question: (.*)\n", context) or re.search(r"User: \s*(.*?)\.? \n", context)
    if m is not None and m.group(1) in self.by_text:
      return self.by_text[m.group(1)], m.end(1)
    for text, q in self.by_text.items():  # any other prompt: the first known question in it
      at = context.find(text)
      if at >= 0:
        return q, at + len(text)
    raise ValueError("the context holds no known SynthWiki question")

  def view(self, context: str) -> _View:
    q, end = self.find_question(context)
    gen = context[end:]
    opened = gen.find("<think>")
    gen = gen[opened + len("<think>") :] if opened >= 0 else gen
    docs, notes = [], list(gen)
    for body, stop in iter_matches(gen, "<information>", "</information>"):
      docs.append(gen[body:stop])
      notes[body:stop] = " " * (stop - body)
    return _View(q, gen, "\n".join(docs), "".join(notes))

  @staticmethod
  def _facts(text: str) -> tuple[dict[tuple[str, str], str], int]:
    """(subject, relation) -> value (the last statement wins) and where the last one ends."""
    table, last = {}, 0
    for f in parse_facts(text):
      table[(f.subject, f.relation)] = f.value
      last = max(last, f.pos + 1)
    for m in _FOUND_RE.finditer(text):
      table[("?", m["noun"])] = m["s"]
      last = max(last, m.start() + 1)
    return table, last

  def need(self, q: SynthQuestion, known: dict[tuple[str, str], str]):
    """("answer", value) when resolved, else ("find", subject, relation) or ("identify",)."""
    if q.kind == "comparison":
      a, b, direction = q.compare
      rel = q.relations[0]
      for x in (a, b):
        if (x, rel) not in known:
          return ("find", x, rel)
      va, vb = known[(a, rel)], known[(b, rel)]
      if not (va.isdigit() and vb.isdigit()):
        return ("answer", a)
      return ("answer", a if (int(va) < int(vb)) == (direction == "min") else b)
    cur = q.start
    if q.constraints:
      if ("?", q.noun) not in known:
        return ("identify",)
      cur = known[("?", q.noun)]
    for i, rel in enumerate(q.relations):
      value = known.get((cur, rel))
      if value is None:
        return ("find", cur, rel)
      if i == len(q.relations) - 1:
        return ("answer", value)
      cur = value
    raise AssertionError("unreachable")

  # -- writing the next turn ------------------------------------------------------------------

  def next_turn(
    self, context: str, *, read_turn: bool, rng: random.Random, episode_seed: int | None = None
  ) -> str:
    v = self.view(context)
    if read_turn:
      return self._read(v, rng) + "</think>"
    known, last = self._facts(v.notes)
    need = self.need(v.question, known)
    first = not v.gen.strip()
    head = f"{self._plan(v.question, need)}</think>\n" if first else "\n"
    if need[0] == "answer":
      return f"{head}<answer> {need[1]} </answer>"
    patience = self.patience(v.question, episode_seed)
    if patience is not None and self.resolved_hops(v.question, known) >= patience:
      return f"{head}<answer> {self._guess(v, rng)} </answer>"
    if rng.random() < self.config.p_guess:
      return f"{head}<answer> {self._guess(v, rng)} </answer>"
    tail = v.notes[last:]
    attempts = tail.count("<search>") + tail.count("<access>")
    if attempts >= self.config.max_attempts:
      return f"{head}<answer> {self._guess(v, rng)} </answer>"
    if self.config.read_pages:
      page = self.page_to_open(v, need, last)
      if page is not None:
        return f"{head}<access> {URL_PREFIX}{page} </access>"
    return head + self._action(v.question, need, attempts, rng)

  def page_to_open(self, v: _View, need, last: int) -> str | None:
    """With `read_pages`: the page (a name) the latest search since the last note points to
    for `need` and that was not opened since; None: search instead."""
    calls = _CALL_RE.findall(v.gen[last:])
    searches = [info for tool, _, info in calls if tool == "search"]
    if not searches or need[0] == "answer":
      return None
    opened = {arg.removeprefix(URL_PREFIX) for tool, arg, _ in calls if tool == "access"}
    titles = [t for t in _titles(searches[-1]) if t not in opened]
    if need[0] == "find":
      return need[1] if need[1] in titles else None
    kinds = {f.subject: f.value for f in parse_facts(searches[-1]) if f.relation == "kind"}
    fits = [t for t in titles if _noun_fits(v.question.noun, kinds.get(t, ""))]
    return fits[0] if fits else None

  def patience(self, q: SynthQuestion, episode_seed: int | None) -> int | None:
    """Hops after which this episode gives up (`give_up_after_hops`); None: plays it out."""
    g = self.config.give_up_after_hops
    if g is None or q.kind != "chain":
      return None
    n = random.Random(f"{self.config.seed}|{episode_seed}|{q.id}").randint(g[0], g[1])
    return n if n < q.hops else None

  @staticmethod
  def resolved_hops(q: SynthQuestion, known: dict[tuple[str, str], str]) -> int:
    """Chain steps already resolved in the notes (0 while a described start is unidentified)."""
    cur = q.start
    if q.constraints:
      if ("?", q.noun) not in known:
        return 0
      cur = known[("?", q.noun)]
    for i, rel in enumerate(q.relations):
      if (cur, rel) not in known:
        return i
      cur = known[(cur, rel)]
    return len(q.relations)

  def _plan(self, q: SynthQuestion, need) -> str:
    if need[0] == "identify":
      return PLAN.format(what=f"the {q.noun} first") + self._next(q, 0)
    if q.kind == "comparison":
      return PLAN.format(what=f"facts about {q.compare[0]} and {q.compare[1]}")
    return PLAN.format(what=f"facts about {need[1]}") + self._next(q, 0)

  def _next(self, q: SynthQuestion, resolved: int) -> str:
    """With `plan_notes` on a chain: " Next: ..." listing the relations after `resolved` hops
    ("answer" when none is left); else ""."""
    if not self.config.plan_notes or q.kind != "chain":
      return ""
    steps = ", ".join(RELATIONS[r].words for r in q.relations[resolved:]) or "answer"
    return " " + NEXT.format(steps=steps)

  def _action(self, q: SynthQuestion, need, attempts: int, rng: random.Random) -> str:
    sloppy = rng.random() < self.config.p_sloppy_query
    if need[0] == "identify":  # search the facts (a vague value is no search term)
      parts = [c.text() for c in q.constraints if not c.fuzzy]
      if attempts == 1:
        parts = [c.value for c in q.constraints if not RELATIONS[c.relation].is_attribute]
      elif attempts >= 2:
        parts = [c.text() for c in q.constraints]
      if sloppy:
        parts = [parts[0].split()[0]]
      noun = q.noun if q.noun not in KINDS else ""  # "person" is no word of any page
      return f"<search> {' '.join([noun, *parts]).strip()} </search>"
    _, subject, rel = need
    words = RELATIONS[rel].words
    if attempts >= 2 and not sloppy:
      return f"<access> {URL_PREFIX}{subject} </access>"
    if sloppy:
      return f"<search> {words} </search>"
    return (
      f"<search> {subject} {words} </search>" if attempts == 0 else f"<search> {subject} </search>"
    )

  def _read(self, v: _View, rng: random.Random) -> str:
    """Notes every step the retrieved text resolves, starting where the notes stand."""
    known, _ = self._facts(v.notes)
    docs, _ = self._facts(v.docs)
    q = v.question
    out: list[str] = []
    found_any = False
    while True:
      need = self.need(q, known)
      if need[0] == "answer":
        break
      if need[0] == "identify":
        name = self._identify(q, docs)
        if name is None:
          pages = self.config.read_pages and self._latest_is_search(v)
          out.append(
            PLAN.format(what=f"the {q.noun} first") if pages else NO_MATCH.format(noun=q.noun)
          )
          break
        known[("?", q.noun)] = name
        out.append(FOUND.format(s=name, noun=q.noun))
        found_any = True
        continue
      _, subject, rel = need
      value = docs.get((subject, rel))
      if value is None:
        if found_any and rng.random() < self.config.p_skip_search:
          value = self._wrong(rel, None, docs, rng)  # "knows" it without searching: made up
        else:
          if not found_any:
            pages = self.config.read_pages and self._latest_is_search(v)
            on_page = pages and subject in _titles(_CALL_RE.findall(v.gen)[-1][2])
            out.append(
              PLAN.format(what=f"facts about {subject}") if on_page else MISSING.format(s=subject)
            )
          break
      elif rng.random() < self.config.p_misread:
        value = self._wrong(rel, value, docs, rng)
      known[(subject, rel)] = value
      out.append(RELATIONS[rel].sentence.format(s=subject, o=value))
      found_any = True
    tail = self._next(q, self.resolved_hops(q, known)) if found_any else ""
    return " ".join(out) + tail

  @staticmethod
  def _latest_is_search(v: _View) -> bool:
    calls = _CALL_RE.findall(v.gen)
    return bool(calls) and calls[-1][0] == "search"

  def _identify(self, q: SynthQuestion, docs: dict[tuple[str, str], str]) -> str | None:
    subjects = sorted({s for (s, r) in docs if r == "kind" and _noun_fits(q.noun, docs[(s, r)])})
    for s in subjects:
      if all(c.matches(docs.get((s, c.relation))) for c in q.constraints):
        return s
    return None

  def _wrong(self, rel: str, right: str | None, docs, rng: random.Random) -> str:
    """A plausible wrong value: another value of this relation in the results, else any."""
    seen = sorted({v for (_, r), v in docs.items() if r == rel and v != right})
    if seen:
      return rng.choice(seen)
    target = RELATIONS[rel].target
    if target == "colour":
      return rng.choice([c for c in COLOURS if c != right])
    if target == "year":
      return str(rng.randrange(1500, 1990))
    if target == "number":
      return str(rng.randrange(12, 900_000))
    return rng.choice(self.world.by_type[target]).name

  def _guess(self, v: _View, rng: random.Random) -> str:
    q = v.question
    docs, _ = self._facts(v.docs)
    if q.kind == "comparison":
      return rng.choice(q.compare[:2])
    return self._wrong(q.relations[-1], None, docs, rng)


def _titles(results: str) -> list[str]:
  """Names of the pages a search result links to, in rank order."""
  return re.findall(r"\]\(" + re.escape(URL_PREFIX) + r"([A-Z][a-z]+)\)", results)


def write_trajectories(trajectories: Iterable[Trajectory], path: str | Path) -> Path:
  """JSONL, one `Trajectory.to_json()` per line (what the SFT command reads)."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    for t in trajectories:
      f.write(json.dumps(t.to_json(), ensure_ascii=False) + "\n")
  return path


def read_trajectories(path: str | Path) -> list[Trajectory]:
  with open(path, encoding="utf-8") as f:
    return [Trajectory.from_json(json.loads(line)) for line in f if line.strip()]
