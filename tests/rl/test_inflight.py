"""In-flight episodes survive a restart: finished engine calls and tool results are replayed from
the journal saved with the checkpoint (no engine, no tools, original logprobs and versions), a
partially generated call continues from its saved tokens, and a diverging replay falls back to
live generation."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from flax import nnx

from asearcher_jax.agent import AsearcherAgent
from asearcher_jax.rl.inflight import (
  EpisodeJournal,
  JournalClient,
  JournalToolBox,
  tool_result_from_json,
  tool_result_to_json,
)
from asearcher_jax.rl.replay import ReplayConfig, ReplayQueue
from asearcher_jax.rl.rollout import AgentSource, RolloutConfig, RolloutController
from asearcher_jax.rl.staleness import StalenessConfig, StalenessManager
from asearcher_jax.serving.types import GenerationResult, SamplingParams
from asearcher_jax.testing import ScriptedClient, fake_toolbox
from asearcher_jax.tokenizer import Tokenizer
from asearcher_jax.tools.toolbox import ToolCall
from tests.rl.test_rollout import AGENT, ITEMS, wait_for
from tests.serving.conftest import kv_layout, make_driver, tiny_model, tokenizer  # noqa: F401

EOS = 99


class StreamingClient:
  """Driver-shaped: emits `output` (continuing whatever part of it the input already ends with)
  one token at a time; `progress(request_id)` reads the tokens so far, as the driver's does."""

  def __init__(self, base_len: int, output: list[int], version: int, step_s: float = 0.005):
    self.base_len, self.output, self.version, self.step_s = base_len, output, version, step_s
    self.requests: list[tuple[list[int], int]] = []
    self._live: dict[str, list[int]] = {}

  def progress(self, request_id: str):
    toks = self._live.get(request_id)
    if toks is None:
      return None
    return list(toks), [-0.5] * len(toks), [self.version] * len(toks)

  async def generate(
    self, token_ids, sampling, max_new_tokens, stop=(), stop_token_ids=None, *, request_id
  ):
    self.requests.append((list(token_ids), max_new_tokens))
    done = len(token_ids) - self.base_len
    toks = self._live.setdefault(request_id, [])
    for t in self.output[done : done + max_new_tokens]:
      await asyncio.sleep(self.step_s)
      toks.append(t)
      if t == EOS:
        break
    del self._live[request_id]
    reason = "stop" if toks and toks[-1] == EOS else "length"
    return GenerationResult(
      tokens=toks, logprobs=[-0.5] * len(toks), versions=[self.version] * len(toks),
      stop_reason=reason,
    )  # fmt: skip


async def test_partial_generation_continues_from_its_saved_tokens():
  prompt, output = [1, 2, 3], [*range(10, 30), EOS]
  old = StreamingClient(len(prompt), output, version=0, step_s=0.01)
  journal = EpisodeJournal()
  client = JournalClient(old, journal, default_stop_ids=[EOS])
  task = asyncio.create_task(client.generate(prompt, SamplingParams(), 64))
  while len(journal.snapshot()["partial"] or {"tokens": ()}["tokens"]) < 5:
    await asyncio.sleep(0.005)
  saved = json.loads(json.dumps(journal.snapshot()))  # what the checkpoint holds
  task.cancel()  # the crash
  k = len(saved["partial"]["tokens"])
  assert saved["partial"]["tokens"] == output[:k] and saved["calls"] == []

  new = StreamingClient(len(prompt), output, version=1)
  resumed = JournalClient(
    new, EpisodeJournal(), EpisodeJournal.from_snapshot(saved), default_stop_ids=[EOS]
  )
  result = await resumed.generate(prompt, SamplingParams(), 64)
  assert new.requests == [(prompt + output[:k], 64 - k)]  # continued, not regenerated
  assert result.tokens == output and result.stop_reason == "stop"
  assert result.versions == [0] * k + [1] * (len(output) - k)  # old tokens keep their version
  assert resumed.resumed_tokens == k and not resumed.mismatched


async def test_finished_calls_replay_without_the_engine_and_divergence_goes_live():
  prompt, output = [5, 6], [40, 41, EOS]
  first = StreamingClient(len(prompt), output, version=3, step_s=0)
  journal = EpisodeJournal()
  await JournalClient(first, journal).generate(prompt, SamplingParams(), 8)
  saved = EpisodeJournal.from_snapshot(json.loads(json.dumps(journal.snapshot())))

  engine = StreamingClient(len(prompt), output, version=4, step_s=0)
  replay = JournalClient(engine, EpisodeJournal(), saved)
  got = await replay.generate(prompt, SamplingParams(), 8)
  assert engine.requests == [] and got.versions == [3, 3, 3] and replay.replayed_calls == 1

  other = JournalClient(engine, EpisodeJournal(), saved)  # a different input: live from here on
  got = await other.generate([5, 7], SamplingParams(), 8)
  assert other.mismatched and len(engine.requests) == 1 and set(got.versions) == {4}


async def test_tool_results_round_trip_and_replay_in_order():
  box = fake_toolbox()
  journal = EpisodeJournal()
  live = JournalToolBox(box, journal)
  r1 = await live.execute(ToolCall("search", "alpha"))
  r2 = await live.execute(ToolCall("search", "beta"))
  assert box.search_provider.queries == ["alpha", "beta"]
  assert tool_result_from_json(tool_result_to_json(r1)) == r1
  saved = EpisodeJournal.from_snapshot(json.loads(json.dumps(journal.snapshot())))
  replay = JournalToolBox(box, EpisodeJournal(), saved)
  assert await replay.execute(ToolCall("search", "alpha")) == r1
  assert await replay.execute(ToolCall("search", "beta")) == r2
  assert box.search_provider.queries == ["alpha", "beta"] and replay.replayed_tools == 2
  await replay.execute(ToolCall("search", "gamma"))  # past the journal: live
  assert box.search_provider.queries[-1] == "gamma"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
  return Tokenizer.qwen2()


class GatedClient(ScriptedClient):
  """Searches, then (second call onwards) waits for `gate` before answering: the crash point."""

  def __init__(self, tok, k: int, gate: threading.Event | None, version: int):
    answer = "<answer>Paris</answer>" if k % 2 == 0 else "<answer>Rome</answer>"

    def policy(context: str, _: int) -> str:  # by context: replayed calls never reach it
      return (
        answer if "about capital of France" in context else "<search>capital of France</search>"
      )

    super().__init__(tok, policy, version=version)
    self.gate = gate

  async def generate(self, token_ids, *args, **kwargs):
    while self.calls and self.gate is not None and not self.gate.is_set():
      await asyncio.sleep(0.01)
    return await super().generate(token_ids, *args, **kwargs)


def run_controller(tok, *, gate, version, box, clients, state=None, start=True):
  counter = iter(range(10**6))

  def client(group: str) -> GatedClient:
    clients.append(GatedClient(tok, next(counter), gate, version))
    return clients[-1]

  agents = AgentSource(
    factory=lambda c, tools: AsearcherAgent(client=c, tokenizer=tok, toolbox=tools, config=AGENT),
    client=client,
    toolbox=box,
    stop_token_ids=tok.stop_token_ids,
  )

  staleness = StalenessManager(StalenessConfig(batch_groups=2, max_staleness=0))
  replay = ReplayQueue(ReplayConfig(capacity=16))
  ctl = RolloutController(
    config=RolloutConfig(group_size=2, shuffle=False, admit_poll_s=0.05),
    items=ITEMS, agents=agents, staleness=staleness, replay=replay,
  )  # fmt: skip
  if state is not None:
    ctl.load_state_dict(state)
  if start:
    ctl.start()
  return ctl, replay


def test_controller_checkpoint_resumes_running_groups_from_their_journals(tok):
  gate, box1, clients1 = threading.Event(), fake_toolbox(), []
  ctl, _ = run_controller(tok, gate=gate, version=0, box=box1, clients=clients1)
  try:

    def all_waiting() -> bool:
      groups = ctl.state_dict()["inflight"]
      return len(groups) == 2 and all(
        len(e["calls"]) == 1 and len(e["tools"]) == 1 for g in groups for e in g["episodes"]
      )

    wait_for(all_waiting)
    state = json.loads(json.dumps(ctl.state_dict()))  # the checkpoint (JSON, as Orbax saves it)
  finally:
    ctl.stop()  # the crash: both groups were mid-episode
  assert [g["key"] for g in state["inflight"]] == ["e0/i0", "e0/i1"]
  assert state["cursor"]["offset"] == 2 and len(box1.search_provider.queries) == 4

  box2, clients2 = fake_toolbox(), []
  ctl2, replay = run_controller(tok, gate=None, version=1, box=box2, clients=clients2, state=state)
  try:
    wait_for(lambda: len(replay) == 2)
  finally:
    ctl2.stop()
  groups = replay.take(2, timeout=1)
  assert sorted(g.group_id for g in groups) == ["e0/i0/q0", "e0/i1/q1"]  # the same items
  assert box2.search_provider.queries == []  # every search was replayed from the journal
  assert all(len(c.calls) == 1 for c in clients2)  # only the answer call reached the engine
  for g in groups:
    assert g.created_version == 0
    for traj in g.trajectories:
      gen = [v for s in traj for v, m in zip(s["versions"], s["loss_mask"]) if m]
      assert min(gen) == 0 and max(gen) == 1  # replayed search (v0), live answer (v1)
  m = ctl2.metrics()
  assert m["rollout/groups_resumed"] == 2 and m["rollout/resumed_llm_calls"] == 4
  assert m["rollout/resumed_tool_calls"] == 4 and "rollout/resumed_diverged" not in m


def test_groups_already_queued_are_not_resumed(tok):
  gate, clients = threading.Event(), []
  ctl, _ = run_controller(tok, gate=gate, version=0, box=fake_toolbox(), clients=clients)
  try:
    wait_for(lambda: len(ctl.state_dict()["inflight"]) == 2)
    state = ctl.state_dict()
    # A group that was pushed (and maybe trained) after the snapshot is excluded from it.
    assert [g["key"] for g in ctl.state_dict(exclude_groups=["e0/i0/q0"])["inflight"]] == ["e0/i1"]
  finally:
    ctl.stop()
  other, _ = run_controller(tok, gate=None, version=1, box=fake_toolbox(), clients=[], start=False)
  other.load_state_dict(state, queued_ids=["e0/i1/q1"])  # accepted before the crash
  assert [j.key for j in other._resume] == ["e0/i0"]


@pytest.mark.slow
def test_real_driver_partial_generation_survives_a_crash_and_continues_with_new_weights(
  make_driver,  # noqa: F811
):
  """The in-process driver's progress is journaled; after the crash a driver with new weights
  continues the saved tokens (old version) with its own greedy continuation (new version)."""
  old = make_driver(tiny_model(seed=0), slots=2, max_seq_len=128, buckets=(16, 32, 64, 128))
  prompt, greedy = [5, 9, 14, 3, 7], SamplingParams(temperature=0.0)

  async def crash() -> dict:
    journal = EpisodeJournal()
    client = JournalClient(old, journal)
    task = asyncio.create_task(client.generate(prompt, greedy, 80, stop_token_ids=[]))
    while len((journal.snapshot()["partial"] or {"tokens": ()})["tokens"]) < 10:
      assert not task.done()
      await asyncio.sleep(0.001)
    saved = json.loads(json.dumps(journal.snapshot()))
    task.cancel()
    return saved

  saved = asyncio.run(crash())
  partial = saved["partial"]
  k = len(partial["tokens"])
  assert 10 <= k < 80 and set(partial["versions"]) == {0}
  reference = asyncio.run(old.generate(prompt, greedy, 80, stop_token_ids=[]))
  assert partial["tokens"] == reference.tokens[:k]  # the tokens the old weights produced

  model = tiny_model(seed=1)
  new = make_driver(model, slots=2, max_seq_len=128, buckets=(16, 32, 64, 128))
  new.update_params(nnx.state(model, nnx.Param), version=1)
  resumed = JournalClient(new, EpisodeJournal(), EpisodeJournal.from_snapshot(saved))
  got = asyncio.run(resumed.generate(prompt, greedy, 80, stop_token_ids=[]))
  cont = asyncio.run(new.generate(prompt + partial["tokens"], greedy, 80 - k, stop_token_ids=[]))
  assert got.tokens == partial["tokens"] + cont.tokens and len(got.tokens) == 80
  assert got.versions == [0] * k + [1] * (80 - k)
  assert got.logprobs[:k] == pytest.approx(partial["logprobs"])
  assert resumed.resumed_tokens == k
