"""The rollout controller with real agents over a scripted engine and in-memory tools: groups are
admitted under the staleness rule (eta = 0 is synchronous batching), scored, centred, filtered
and queued; environment failures are retried or dropped, never trained as zero; timeouts,
pause/resume, the checkpointable cursor, and an event loop that stays responsive while a push
waits for room."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import pytest

from asearcher_jax.agent import AsearcherAgent, AsearcherAgentConfig
from asearcher_jax.agent.trajectory import Trajectory
from asearcher_jax.data.qa import QAExample
from asearcher_jax.rl.replay import ReplayConfig, ReplayQueue
from asearcher_jax.rl.rollout import (
  AgentSource,
  DataCursor,
  RolloutConfig,
  RolloutController,
)
from asearcher_jax.rl.scoring import score_group
from asearcher_jax.rl.staleness import StalenessConfig, StalenessManager
from asearcher_jax.testing import ScriptedClient, fake_toolbox
from asearcher_jax.tokenizer import Tokenizer

ITEMS = [
  QAExample(id=f"q{i}", dataset="t", question=f"Capital number {i}?", answers=("Paris",))
  for i in range(6)
]
AGENT = AsearcherAgentConfig(max_turns=4, max_new_tokens=64, max_tokens=4096)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
  return Tokenizer.qwen2()


def wait_for(pred: Callable[[], bool], timeout: float = 10.0) -> None:
  deadline = time.monotonic() + timeout
  while not pred():
    if time.monotonic() > deadline:
      raise AssertionError("condition not reached")
    time.sleep(0.01)


def factory(tok, scripts: Callable[[int], list[str]], *, delay_s: float = 0.0, toolbox=None):
  """Agents whose episode k replays scripts(k) through its own scripted client."""
  counter = itertools.count()
  return AgentSource(
    factory=lambda client, box: AsearcherAgent(
      client=client, tokenizer=tok, toolbox=box, config=AGENT
    ),
    client=lambda group: ScriptedClient(tok, scripts(next(counter)), delay_s=delay_s),
    toolbox=toolbox or fake_toolbox(),
    stop_token_ids=tok.stop_token_ids,
  )


def alternating(k: int) -> list[str]:
  """Right answer on even episodes, wrong on odd ones: every group of 2 has variance."""
  return ["<answer>Paris</answer>" if k % 2 == 0 else "<answer>Rome</answer>"]


def controller(tok, scripts, *, eta=0, b=2, n=2, concurrent=None, capacity=64, items=ITEMS, **cfg):
  staleness = StalenessManager(
    StalenessConfig(batch_groups=b, max_staleness=eta, max_concurrent=concurrent)
  )
  replay = ReplayQueue(ReplayConfig(capacity=capacity))
  delay = cfg.pop("delay_s", 0.0)
  toolbox = cfg.pop("toolbox", None)
  ctl = RolloutController(
    config=RolloutConfig(group_size=n, shuffle=False, admit_poll_s=0.05, **cfg),
    items=items,
    agents=factory(tok, scripts, delay_s=delay, toolbox=toolbox),
    staleness=staleness,
    replay=replay,
  )
  return ctl, staleness, replay


def test_eta0_admits_exactly_b_groups_per_version_and_centres_rewards(tok):
  ctl, staleness, replay = controller(tok, alternating, eta=0, b=2, concurrent=8)
  ctl.start()
  try:
    wait_for(lambda: len(replay) == 2 and staleness.stats()["running"] == 0)
    time.sleep(0.2)  # nothing more may start: synchronous batching
    assert len(replay) == 2 and staleness.capacity() == 0
    groups = replay.take(2, timeout=1, current_version=0)
    for g in groups:
      assert sorted(g.advantages) == [-0.5, 0.5]  # F1 1 and 0, centred on the group mean
      assert g.metadata["scores"] in ([1.0, 0.0], [0.0, 1.0])
      assert g.created_version == 0 and len(g.trajectories) == 2
    assert [g.group_id for g in groups] == ["e0/i0/q0", "e0/i1/q1"]  # cursor order, oldest first
    staleness.set_version(1)  # the learner published: B more groups
    wait_for(lambda: len(replay) == 2 and staleness.stats()["running"] == 0)
    assert [g.created_version for g in replay.take(2, timeout=1)] == [1, 1]
  finally:
    ctl.stop()
  m = ctl.metrics()
  assert m["rollout/groups_accepted"] == 4 and m["rollout/episodes"] == 8
  assert m["rollout/accuracy"] == 0.5 and m["rollout/turns"] == 1.0


def test_zero_variance_groups_are_rejected_and_free_their_slot(tok):
  ctl, staleness, replay = controller(tok, lambda k: ["<answer>Paris</answer>"], eta=0, b=1)
  ctl.start()
  try:
    wait_for(lambda: staleness.stats()["rejected"] >= 3)
  finally:
    ctl.stop()
  assert len(replay) == 0 and staleness.stats()["accepted"] == 0
  m = ctl.metrics()
  assert m["rollout/groups_zero_variance"] >= 3 and "rollout/groups_accepted" not in m
  assert replay.metrics()["replay/len_le_1024/rejected"] >= 6  # per trajectory


def test_environment_failures_are_retried_never_scored(tok):
  # Episode 0 searches during an outage; its rerun (episode 2) answers right; episode 1 is wrong.
  def scripts(k: int) -> list[str]:
    if k == 0:
      return ["<search>outage now</search>"]
    return ["<answer>Paris</answer>" if k == 2 else "<answer>Rome</answer>"]

  ctl, _, replay = controller(tok, scripts, eta=0, b=1, env_failure_policy="retry")
  ctl.start()
  try:
    wait_for(lambda: len(replay) == 1)
  finally:
    ctl.stop()
  (g,) = replay.take(1, timeout=1)
  assert sorted(g.metadata["scores"]) == [0.0, 1.0] and len(g.trajectories) == 2
  m = ctl.metrics(reset=False)
  assert m["rollout/env_failures"] == 1 and m["rollout/episode_retries"] == 1


def test_tool_call_means_and_counters_stay_apart(tok):
  # Every episode searches once, then answers: 1 tool call per trajectory, in every window.
  def scripts(k: int) -> list[str]:
    answer = "Paris" if k % 2 == 0 else "Rome"
    return ["<search>capital</search>", f"<answer>{answer}</answer>"]

  ctl, staleness, replay = controller(tok, scripts, eta=0, b=2)
  ctl.start()
  try:
    wait_for(lambda: len(replay) == 2 and staleness.stats()["running"] == 0)
  finally:
    ctl.stop()
  m = ctl.metrics()
  assert m["rollout/tool_calls"] == 1.0 and m["rollout/tool_calls_total"] == 4
  # A window without trajectories has no per-trajectory means; the cumulative counters remain
  # under their own names (a shared key once plotted the running total as a per-trajectory mean).
  after = ctl.metrics()
  assert "rollout/tool_calls" not in after and "rollout/turns" not in after
  assert after["rollout/tool_calls_total"] == 4 and after["rollout/trajectories"] == 4


def test_dropped_environment_failure_leaves_too_few_to_train(tok):
  # With "drop", the failed episode is excluded: one scored trajectory is no group.
  def scripts(k: int) -> list[str]:
    return ["<search>outage now</search>"] if k % 2 == 0 else ["<answer>Rome</answer>"]

  ctl, staleness, replay = controller(tok, scripts, eta=0, b=1, env_failure_policy="drop")
  ctl.start()
  try:
    wait_for(lambda: staleness.stats()["rejected"] >= 2)
  finally:
    ctl.stop()
  assert len(replay) == 0
  m = ctl.metrics()
  assert m["rollout/env_failures"] >= 2 and "rollout/episode_retries" not in m
  assert m["rollout/groups_too_few_scored"] >= 2 and "rollout/groups_zero_variance" not in m


def test_episode_timeout_is_an_attributed_failure(tok):
  ctl, staleness, replay = controller(
    tok, alternating, eta=0, b=1, delay_s=5.0, episode_timeout_s=0.2, max_env_retries=0
  )
  ctl.start()
  try:
    wait_for(lambda: staleness.stats()["rejected"] >= 1)
  finally:
    ctl.stop()
  m = ctl.metrics()
  assert m["rollout/episode_timeouts"] >= 2 and len(replay) == 0


def test_pause_resume_and_stop_release_every_slot(tok):
  ctl, staleness, replay = controller(tok, alternating, eta=3, b=1, delay_s=0.05)
  ctl.pause()
  ctl.start()
  try:
    time.sleep(0.3)
    assert staleness.stats()["running"] == 0 and len(replay) == 0  # paused: nothing admitted
    ctl.resume()
    wait_for(lambda: len(replay) >= 1)
  finally:
    ctl.stop()
  s = staleness.stats()
  assert s["running"] == 0  # cancelled groups gave their slots back
  assert s["accepted"] == len(replay) <= 4  # (eta + 1) * B


def test_event_loop_stays_responsive_while_a_push_waits_for_room(tok):
  ctl, staleness, replay = controller(tok, alternating, eta=5, b=1, capacity=1)
  ctl.start()
  try:
    wait_for(lambda: len(replay) == 1)
    wait_for(lambda: staleness.stats()["running"] >= 1)  # the next group waits to push
    time.sleep(0.2)
    t0 = time.perf_counter()
    ctl.run_coroutine(_noop(), timeout=2)
    assert time.perf_counter() - t0 < 0.5
    replay.commit([g.group_id for g in replay.take(1, timeout=1)])  # room: the push completes
    wait_for(lambda: len(replay) == 1 and staleness.stats()["accepted"] >= 2)
  finally:
    ctl.stop()


async def _noop() -> int:
  return threading.get_ident()


def test_cursor_state_round_trips_and_skips_queued_items(tok):
  ctl, _, _ = controller(tok, alternating)
  for _ in range(8):  # past an epoch boundary
    ctl._next_group()
  ctl._journals.clear()  # nothing in flight: only the cursor matters here
  state = ctl.state_dict()
  assert state["cursor"]["epoch"] == 1 and state["cursor"]["offset"] == 2
  assert state["inflight"] == []
  other, _, _ = controller(tok, alternating)
  other.load_state_dict(state, queued_ids=["e1/i2/q2"])
  assert [other._next_group().key for _ in range(2)] == ["e1/i3", "e1/i4"]  # e1/i2 is queued


def test_cursor_shuffles_per_epoch_deterministically():
  a, b = DataCursor(5, shuffle=True, seed=3), DataCursor(5, shuffle=True, seed=3)
  first = [a.next()[1] for _ in range(10)]
  assert first == [b.next()[1] for _ in range(10)]
  assert sorted(first[:5]) == list(range(5)) and sorted(first[5:]) == list(range(5))
  with pytest.raises(ValueError):
    DataCursor(5, shuffle=True, seed=4).load_state_dict(a.state_dict())


def test_score_group_scores_usable_episodes_then_centres_and_filters():
  def traj(answer: str, failed: bool = False) -> Trajectory:
    return Trajectory(agent="a", question="q", pred_answer=answer, environment_failure=failed)

  seen = []

  def scorer(trajs):
    seen.append(len(trajs))
    return [1.0 if t.pred_answer == "Paris" else 0.0 for t in trajs]

  # A failed episode and one that never ran are not scored (not trained as zero); the rest centre.
  out = score_group([traj("Paris"), traj("Paris", failed=True), None, traj("Rome")], scorer)
  assert seen == [2] and out.usable == 2 and out.rejection is None
  assert out.scores == [1.0, None, None, 0.0]
  assert out.advantages == [0.5, None, None, -0.5] and out.keep == [0, 3]
  # All equal: no signal. One usable episode: no baseline.
  same = score_group([traj("Paris"), traj("Paris")], scorer)
  assert same.rejection == "groups_zero_variance" and same.keep == []
  alone = score_group([traj("Paris"), traj("Rome", failed=True)], scorer)
  assert alone.rejection == "groups_too_few_scored" and alone.scores == [1.0, None]
  # The scorer may exclude a trajectory itself (None).
  excl = score_group([traj("Paris"), traj("Rome"), traj("x")], lambda ts: [1.0, 0.0, None])
  assert excl.keep == [0, 1] and excl.advantages[2] is None
