"""Where an episode's searches leave its chain (`synthwiki.chain_breaks`): each kind of break, at
the hop it happens, read from the episode's search queries alone."""

from __future__ import annotations

import pytest

from asearcher_jax.synthwiki.chain_breaks import (
  KINDS,
  episode_break,
  first_break,
  hops_searched,
  search_queries,
  tally,
)
from asearcher_jax.synthwiki.questions import Constraint, SynthQuestion

# Ana --trained by--> Bo --born in--> Kel --population--> 1200
CHAIN = SynthQuestion(
  id="q", question="?", answer="1200", kind="chain", hops=3, start="Ana", start_type="person",
  relations=("mentor", "born_in", "population"), bridges=("Bo", "Kel", "1200"),
)  # fmt: skip
INJECTED = SynthQuestion(
  **{**CHAIN.__dict__, "noun": "person",
     "constraints": (Constraint(relation="spouse", value="Dia"),)},
)  # fmt: skip
RIGHT = ["Ana trained by", "Bo born in", "Kel population"]


@pytest.mark.parametrize(
  ("question", "queries", "answered", "expected"),
  [
    (CHAIN, RIGHT, True, ("all hops searched", 3)),
    (CHAIN, RIGHT[:2], True, ("answered early", 2)),
    (CHAIN, RIGHT[:2], False, ("stopped", 2)),  # a turn or token limit
    (CHAIN, [], True, ("answered early", 0)),
    (CHAIN, ["Ana trained by", "Bx born in"], True, ("wrong entity", 1)),  # misread bridge
    (CHAIN, ["Ana born in"], True, ("wrong relation", 0)),  # misparsed question
    (CHAIN, ["Ana trained by", "Bo trained by"], True, ("wrong relation", 1)),  # lost count
    (CHAIN, ["Zed married to"], True, ("wrong entity and relation", 0)),
    # An injected start: describing searches first, then the chain.
    (INJECTED, ["person married to Dia", "Dia", *RIGHT], True, ("all hops searched", 3)),
    (INJECTED, ["person married to Dia"], True, ("start not identified", 0)),
    (INJECTED, ["person married to Dia", "Dia trained by"], True, ("wrong entity", 0)),
  ],
)  # fmt: skip
def test_first_break(question, queries, answered, expected):
  assert first_break(question, queries, answered=answered) == expected


def test_hops_searched_is_the_share_of_the_chain_before_its_first_wrong_search():
  def acts(*queries):
    return [f"<search> {x} </search>" for x in queries]

  assert hops_searched(CHAIN, acts(*RIGHT)) == 1.0
  # Accesses and answers are not searches; the count stops at the first wrong one.
  mixed = [*acts(RIGHT[0]), "<access> https://synthwiki.org/Bo </access>", *acts("Bo trained by")]
  assert hops_searched(CHAIN, [*mixed, *acts(*RIGHT[1:])]) == pytest.approx(1 / 3)
  assert hops_searched(CHAIN, [*acts(*RIGHT[:2]), "<answer> 1200 </answer>"]) == pytest.approx(
    2 / 3
  )
  assert hops_searched(CHAIN, [None, "<answer> 1200 </answer>"]) == 0.0  # a guess
  assert hops_searched(INJECTED, acts("person married to Dia", *RIGHT)) == 1.0
  assert hops_searched(SynthQuestion(**{**CHAIN.__dict__, "kind": "comparison"}), []) is None


def test_only_chains_break():
  comparison = SynthQuestion(**{**CHAIN.__dict__, "kind": "comparison"})
  with pytest.raises(ValueError, match="comparison"):
    first_break(comparison, [], answered=True)


def test_an_evaluation_record_is_read_through_its_act_turns():
  calls = [
    {"kind": "act", "action": "<search> Ana trained by </search>"},
    {"kind": "read", "action": "<search> Zed </search>"},  # a read turn's text is no action
    {"kind": "act", "action": "<access> https://synthwiki/Bo </access>"},
    {"kind": "act", "action": None},  # a format failure
    {"kind": "act", "action": "<search>Bo born in</search>"},
    {"kind": "act", "action": "<answer> 1200 </answer>"},
  ]
  record = {"finish_reason": "answer", "trajectory": {"calls": calls}}
  assert search_queries(c["action"] for c in calls) == ["Ana trained by", "Zed", "Bo born in"]
  assert episode_break(CHAIN, record) == ("answered early", 2)
  limit = {**record, "finish_reason": "turn_limit"}
  assert episode_break(CHAIN, limit) == ("stopped", 2)


def test_tally_counts_every_kind_by_hop():
  t = tally([("wrong entity", 0), ("wrong entity", 0), ("wrong relation", 2), ("stopped", 1)])
  assert t["episodes"] == 4 and set(t) == {"episodes", "hops", *KINDS}
  assert t["wrong entity"] == {"count": 2, "share": 0.5, "by_hop": {"0": 2}}
  assert t["wrong relation"]["by_hop"] == {"2": 1}
  assert sum(t[k]["count"] for k in KINDS) == 4
  assert tally([])["episodes"] == 0 and tally([])["stopped"]["share"] == 0.0


def test_tally_counts_the_hops_searched_right_of_those_attempted():
  # hop 0 wrong (1 attempted), hop 2 wrong (3: two right first), answered at hop 1 (1 right),
  # all 3 hops right: 8 attempted, 2 wrong.
  t = tally(
    [("wrong entity", 0), ("wrong relation", 2), ("answered early", 1), ("all hops searched", 3)]
  )
  assert t["hops"] == {"attempted": 8, "wrong": 2, "right_rate": 0.75}
  assert tally([("start not identified", 0)])["hops"]["right_rate"] == 0.0
  assert tally([])["hops"] == {"attempted": 0, "wrong": 0, "right_rate": None}
