"""The learnability curriculum: buckets that keep giving zero-variance groups are sampled less
(never never), within a bucket items follow a seeded walk, keys stay unique, the state
round-trips through JSON so a resumed run draws exactly what an uninterrupted one would, and
the rollout controller feeds it each group's outcome."""

from __future__ import annotations

import collections
import json

import pytest

from asearcher_jax.data.qa import QAExample
from asearcher_jax.rl.cursors import CurriculumCursor, DataCursor
from asearcher_jax.tokenizer import Tokenizer
from tests.rl.test_rollout import alternating, controller, wait_for


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
  return Tokenizer.qwen2()


BUCKETS = ["easy"] * 10 + ["hard"] * 30  # the uniform walk spends 75 % on "hard"


def draw(cur: CurriculumCursor, n: int, mixed: dict[str, bool]) -> collections.Counter:
  got = collections.Counter()
  for _ in range(n):
    _, index = cur.next()
    got[BUCKETS[index]] += 1
    cur.observe(index, mixed=mixed[BUCKETS[index]])
  return got


def test_buckets_without_signal_are_thinned_but_never_dropped():
  cur = CurriculumCursor(BUCKETS, seed=0, floor=0.05)
  assert cur.weights() == pytest.approx({"easy": 0.25, "hard": 0.75})  # prior: by size
  draw(cur, 200, {"easy": True, "hard": False})
  w = cur.weights()
  assert w["easy"] > 0.8 and 0 < w["hard"] < 0.2
  assert cur.mixed_rate("easy") > 0.9 and cur.mixed_rate("hard") < 0.1
  late = draw(cur, 400, {"easy": True, "hard": False})
  assert late["easy"] > 300 and late["hard"] > 0  # the floor keeps sampling "hard"
  # The policy improves on "hard": it comes back.
  draw(cur, 400, {"easy": False, "hard": True})
  assert cur.weights()["hard"] > 0.8


def test_walk_within_a_bucket_covers_it_and_keys_are_unique():
  cur = CurriculumCursor(BUCKETS, seed=1)
  keys, per_bucket = set(), collections.defaultdict(list)
  for _ in range(120):
    key, index = cur.next()
    assert key not in keys
    keys.add(key)
    per_bucket[BUCKETS[index]].append(index)
  easy = per_bucket["easy"]
  assert sorted(easy[:10]) == list(range(10))  # one shuffled epoch of the bucket, then the next


def test_state_round_trips_through_json_and_continues_identically():
  a = CurriculumCursor(BUCKETS, seed=2)
  draw(a, 50, {"easy": True, "hard": False})
  state = json.loads(json.dumps(a.state_dict()))
  b = CurriculumCursor(BUCKETS, seed=2)
  b.load_state_dict(state)
  assert [a.next() for _ in range(30)] == [b.next() for _ in range(30)]
  with pytest.raises(ValueError, match="does not match"):
    CurriculumCursor(BUCKETS, seed=3).load_state_dict(state)
  with pytest.raises(ValueError, match="does not match"):
    CurriculumCursor(BUCKETS, seed=2).load_state_dict(
      DataCursor(40, shuffle=True, seed=2).state_dict()
    )


def test_bad_arguments_are_refused():
  with pytest.raises(ValueError):
    CurriculumCursor([], seed=0)
  with pytest.raises(ValueError):
    CurriculumCursor(BUCKETS, seed=0, floor=0.0)
  with pytest.raises(ValueError):
    CurriculumCursor(BUCKETS, seed=0, decay=1.5)


def test_controller_reports_group_outcomes_to_the_curriculum(tok):
  # Items q0..q5 in two buckets; every group of two alternating episodes is mixed. decay = 1
  # keeps the counts exact.
  items = [
    QAExample(
      id=f"q{i}",
      dataset="t",
      question=f"Capital number {i}?",
      answers=("Paris",),
      bucket=f"b{i % 2}",
    )
    for i in range(6)
  ]
  ctl, staleness, replay = controller(
    tok, alternating, eta=0, b=2, concurrent=8, items=items, curriculum=True, curriculum_decay=1.0
  )
  assert isinstance(ctl.cursor, CurriculumCursor)
  ctl.start()
  try:
    wait_for(lambda: len(replay) == 2 and staleness.stats()["running"] == 0)
  finally:
    ctl.stop()
  assert sum(ctl.cursor._seen.values()) == 2 and sum(ctl.cursor._mixed.values()) == 2
  trained = {g.metadata["item"] for g in replay.take(2, timeout=1)}
  assert len(trained) == 2  # the two groups the curriculum drew, both observed as mixed
  m = ctl.metrics()
  assert {"curriculum/b0/weight", "curriculum/b1/mixed_rate"} <= set(m)
  assert m["curriculum/b0/weight"] + m["curriculum/b1/weight"] == pytest.approx(1.0)
  assert json.loads(json.dumps(ctl.state_dict()))["cursor"]["kind"] == "curriculum"
