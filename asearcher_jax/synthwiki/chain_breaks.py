"""Where an agent's searches leave a chain question's chain: the hop, and what went wrong there.

Accuracy by hop count says that long chains fail, not why. A chain question of k hops needs the
searches "<entity_i> <relation words_i>" in order (the start entity, then each bridge), so an
episode's search queries show the first hop it got wrong, and how:

- "wrong entity": the relation's words are right, the entity is not (a copy error: the start
  misread from the question, or a bridge misread from the results);
- "wrong relation": the entity is right, the relation is not (the question misparsed, or the
  agent lost count of the hops);
- "wrong entity and relation": neither;
- "start not identified": an injected start ("the person born in Kelmar and ...") whose
  identifying searches never led to a first hop's search;
- "answered early": no wrong search, but it answered before searching every hop;
- "stopped": no wrong search, but the episode ended on a limit or an error before the last hop;
- "all hops searched": every hop searched right (the answer may still be misread).

An injected start is first identified by searches that describe it (queries that do not end with
the first hop's relation words); those come before the first hop's search and are not counted
against it.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from asearcher_jax.synthwiki.questions import SynthQuestion
from asearcher_jax.synthwiki.world import RELATIONS

KINDS = (
  "wrong entity", "wrong relation", "wrong entity and relation", "start not identified",
  "answered early", "stopped", "all hops searched",
)  # fmt: skip
# The kinds that are a hop searched wrong (the others end a chain without a wrong search).
WRONG_KINDS = KINDS[:4]
_SEARCH = re.compile(r"<search>\s*(.*?)\s*</search>", re.S)


def search_queries(actions: Iterable[str | None]) -> list[str]:
  """The queries of an episode's actions, in order (accesses and answers are not searches)."""
  return [m.group(1) for a in actions if a for m in [_SEARCH.search(a)] if m]


def first_break(q: SynthQuestion, queries: Sequence[str], *, answered: bool) -> tuple[str, int]:
  """(kind, hop) of the first hop (0-based) an episode did not search right; see the module
  docstring for the kinds. `answered`: the episode ended with an answer (not on a limit)."""
  if q.kind != "chain":
    raise ValueError(f"{q.id} is a {q.kind} question, not a chain")
  entities = [q.start, *q.bridges[:-1]]
  words = [RELATIONS[r].words for r in q.relations]
  hop = 0
  for query in queries:
    if hop == len(entities):
      break
    tokens = query.split()
    entity_ok, relation_ok = entities[hop] in tokens, query.endswith(words[hop])
    if entity_ok and relation_ok:
      hop += 1
    elif hop == 0 and q.constraints and not relation_ok:
      continue  # identifying an injected start
    elif entity_ok:
      return "wrong relation", hop
    else:
      return ("wrong entity" if relation_ok else "wrong entity and relation"), hop
  if hop == len(entities):
    return "all hops searched", hop
  if hop == 0 and q.constraints:
    return "start not identified", hop
  return ("answered early" if answered else "stopped"), hop


def hops_searched(q: SynthQuestion, actions: Iterable[str | None]) -> float | None:
  """The fraction of chain `q`'s hops an episode's actions searched right, in order, before its
  first wrong search (None for a question that is not a chain): the progress an RL reward can
  credit per hop (`rl.scoring.progress_scorer`)."""
  if q.kind != "chain":
    return None
  _, hop = first_break(q, search_queries(actions), answered=True)
  return hop / q.hops


def tally(breaks: Iterable[tuple[str, int]]) -> dict[str, Any]:
  """{"episodes": n, kind: {"count", "share", "by_hop": {hop: count}}} over every kind, and
  "hops": how many hops the episodes attempted and got wrong. Its `right_rate` is what bounds
  long chains: at a rate r, a k-hop chain is searched right about r**k of the time, however
  persistent the agent."""
  items = list(breaks)
  by_kind: dict[str, collections.Counter] = {k: collections.Counter() for k in KINDS}
  for kind, hop in items:
    by_kind[kind][hop] += 1
  n = len(items)
  out: dict[str, Any] = {"episodes": n}
  for kind, hops in by_kind.items():
    count = sum(hops.values())
    out[kind] = {
      "count": count,
      "share": count / n if n else 0.0,
      "by_hop": {str(h): c for h, c in sorted(hops.items())},
    }
  wrong = sum(kind in WRONG_KINDS for kind, _ in items)
  attempted = sum(hop + (kind in WRONG_KINDS) for kind, hop in items)  # the hops before, right
  out["hops"] = {
    "attempted": attempted,
    "wrong": wrong,
    "right_rate": 1 - wrong / attempted if attempted else None,
  }
  return out


def episode_break(q: SynthQuestion, record: Mapping[str, Any]) -> tuple[str, int]:
  """`first_break` of one evaluation record (`evaluation` writes one JSON per question and run:
  its trajectory's calls carry the parsed `action`, and `finish_reason` says how it ended)."""
  actions = [c.get("action") for c in record["trajectory"]["calls"] if c.get("kind") == "act"]
  return first_break(q, search_queries(actions), answered=record["finish_reason"] == "answer")
