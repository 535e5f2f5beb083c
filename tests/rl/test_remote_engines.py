"""`rl.remote.RemoteEngines` over two real servers (OpenAI facade + driver + weights watcher, in
this process on loopback): the start gate waits for every server to run the trainer's weights
and names the one that does not, and the fleet's figures are the sum of the servers'. Over
scripted servers: the rollout controller sends a group's episodes to one server and spreads the
groups, a new group goes to the least loaded live server."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
from flax import nnx

from asearcher_jax.agent import AsearcherAgent, AsearcherAgentConfig
from asearcher_jax.data.qa import QAExample
from asearcher_jax.errors import AsearcherError
from asearcher_jax.rl.remote import RemoteEngines
from asearcher_jax.rl.replay import ReplayConfig, ReplayQueue
from asearcher_jax.rl.rollout import AgentSource, RolloutConfig, RolloutController
from asearcher_jax.rl.staleness import StalenessConfig, StalenessManager
from asearcher_jax.serving.client import RemoteClientConfig
from asearcher_jax.serving.openai_api import OpenAIServer, OpenAIServerConfig
from asearcher_jax.serving.types import SamplingParams
from asearcher_jax.serving.weights_dir import DirectoryWeightWatcher
from asearcher_jax.testing import ScriptedClient, fake_toolbox
from asearcher_jax.tokenizer import Tokenizer
from tests.serving.conftest import kv_layout, make_driver, tiny_model, tokenizer  # noqa: F401

T = 60


@pytest.mark.slow
async def test_two_servers_one_weights_dir(tmp_path, make_driver):  # noqa: F811
  weights = tmp_path / "weights"
  trainer_model = tiny_model(seed=0)
  graphdef, params = nnx.split(trainer_model)
  drivers, watchers, servers, files = [], [], [], []
  for i, seed in enumerate((5, 9)):  # neither is the trainer's init
    driver = make_driver(tiny_model(seed=seed), slots=2 + i)
    watcher = DirectoryWeightWatcher(weights, driver, poll_s=0.02)
    server = OpenAIServer(
      driver, OpenAIServerConfig(port=0), health_extra=lambda w=watcher: {"weights": w.status()}
    )
    port = await asyncio.wait_for(server.start(), T)
    files.append(tmp_path / f"engine{i}.json")
    files[-1].write_text(json.dumps({"http": f"127.0.0.1:{port}"}))
    drivers.append(driver), watchers.append(watcher), servers.append(server)
  remote = RemoteEngines(
    files, weights, graphdef, client=RemoteClientConfig(timeout_s=T), poll_s=0.05
  )
  try:
    with pytest.raises(AsearcherError, match="nothing published"):
      await asyncio.to_thread(remote.wait_loaded, 0.2)
    remote.publisher.write(params, 0)
    watchers[0].start()  # the second server is not watching yet
    with pytest.raises(AsearcherError, match=r"engine1\.json \(runs its initial weights\)"):
      await asyncio.to_thread(remote.wait_loaded, 0.5)
    watchers[1].start()
    await asyncio.to_thread(remote.wait_loaded, T)
    assert [w.loaded for w in watchers] == [[0], [0]]

    # One server per group, groups spread; both now compute the trainer's policy.
    clients = [remote.client_for_group(g) for g in ("g0", "g1", "g0", "g1")]
    assert clients == [remote.clients[0], remote.clients[1]] * 2
    greedy = SamplingParams(temperature=0.0)
    outs = await asyncio.wait_for(
      asyncio.gather(*(c.generate([5, 17, 42], greedy, 6, stop_token_ids=()) for c in clients)), T
    )
    assert all(o.tokens == outs[0].tokens and o.versions == [0] * 6 for o in outs)

    await asyncio.to_thread(remote.start)
    await asyncio.sleep(0.3)  # a poll or more
    fleet = remote.stats()
    each = [d.stats() for d in drivers]
    assert fleet["servers_up"] == fleet["servers"] == 2 and fleet["slots"] == 2 + 3
    assert fleet["tokens_generated"] == sum(s["tokens_generated"] for s in each) == 24
    assert fleet["version"] == 0 and fleet["slot_occupancy"] == 0.0
  finally:
    remote.stop()
    await remote.close_clients()
    for w in watchers:
      w.stop()
    for s in servers:
      await asyncio.wait_for(s.stop(), T)


def test_fleet_counters_survive_a_server_restart(tmp_path):
  """A server restarted behind its address file starts its counters at 0; the fleet's keep
  counting from where its predecessor stopped. A server that stops answering keeps its counters
  in the sum but no longer counts slots, occupancy or version."""
  files = [tmp_path / "a.json", tmp_path / "b.json"]
  remote = RemoteEngines(files, tmp_path / "w", nnx.split(tiny_model())[0])

  def health(tokens: int, active: int, version: int) -> dict:
    return {"driver": {"slots": 4, "slots_active": active, "tokens_generated": tokens,
                       "updates": version, "version": version, "decode_s": tokens / 100}}  # fmt: skip

  remote._record(0, health(100, 2, 3), pid=11)
  remote._record(1, health(50, 1, 3), pid=12)
  s = remote.stats()
  assert (s["tokens_generated"], s["slots"], s["slot_occupancy"]) == (150, 8, 3 / 8)
  assert s["version"] == 3 and s["servers_up"] == 2
  remote._record(0, health(120, 2, 3), pid=11)  # same process, more tokens
  assert remote.stats()["tokens_generated"] == 170
  remote._record(0, health(10, 0, 3), pid=13)  # a new process behind a.json
  s = remote.stats()
  assert s["tokens_generated"] == 180 and s["decode_s"] == pytest.approx(1.8)
  assert s["slots_active"] == 1 and s["updates"] == 9
  remote._record(1, health(5, 1, 0), pid=None)  # no pid known: counters going back tell
  s = remote.stats()
  assert s["tokens_generated"] == 185 and s["version"] == 0
  assert remote._fetch(1, timeout_s=0.1) == {}  # b.json does not exist: down
  s = remote.stats()
  assert s["tokens_generated"] == 185 and s["servers_up"] == 1 and s["slots"] == 4
  assert s["version"] == 3


def test_a_groups_episodes_share_one_server_and_groups_spread(tmp_path):
  """The controller as `asearcher train` wires it to two servers: the four episodes of a group
  (one prompt) all reach the same server, where its prompt pages are shared, and the groups
  running together are spread over both."""
  tok = Tokenizer.qwen2()
  remote = RemoteEngines(
    [tmp_path / "a.json", tmp_path / "b.json"], tmp_path / "w", nnx.split(tiny_model())[0]
  )
  remote.clients = [ScriptedClient(tok, lambda ctx, k: "<answer>Paris</answer>") for _ in "ab"]
  items = [
    QAExample(id=f"q{i}", dataset="t", question=f"Capital number {i}?", answers=("Paris",))
    for i in range(4)
  ]
  staleness = StalenessManager(StalenessConfig(batch_groups=4, max_staleness=0))
  ctl = RolloutController(
    config=RolloutConfig(group_size=4, shuffle=False, admit_poll_s=0.05),
    items=items,
    agents=AgentSource(
      factory=lambda c, box: AsearcherAgent(
        client=c, tokenizer=tok, toolbox=box, config=AsearcherAgentConfig(max_turns=2)
      ),
      client=remote.client_for_group,
      group_done=remote.group_done,
      toolbox=fake_toolbox(),
      stop_token_ids=tok.stop_token_ids,
    ),
    staleness=staleness,
    replay=ReplayQueue(ReplayConfig(capacity=8)),
    scorer=lambda trajs: [float(i % 2) for i in range(len(trajs))],  # every group accepted
  )
  ctl.start()
  try:
    deadline = time.monotonic() + T
    while staleness.stats()["accepted"] < 4:  # eta = 0: no fifth group starts
      assert time.monotonic() < deadline, staleness.stats()
      time.sleep(0.02)
  finally:
    ctl.stop()
  asked = [
    [re.findall(r"Capital number (\d)", tok.decode(c.input_ids))[-1] for c in server.calls]
    for server in remote.clients
  ]
  assert sorted(asked[0] + asked[1]) == sorted("0123" * 4)  # one call per episode
  assert not set(asked[0]) & set(asked[1])  # no group on both servers
  assert len(set(asked[0])) == len(set(asked[1])) == 2  # two groups each
  assert remote._groups == {}  # every group ended: none holds its server


def test_groups_go_to_the_least_loaded_live_server(tmp_path):
  """A new group takes the server with the fewest groups in flight (round-robin among equals); a
  group keeps its server while that answers and moves when it stops, for its later episodes (a
  retry after the server died); with no server known up, every server is a candidate."""
  files = [tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"]
  remote = RemoteEngines(files, tmp_path / "w", nnx.split(tiny_model())[0])
  a, b, c = remote.clients
  assert [remote.client_for_group(g) for g in ("g0", "g1", "g2", "g1", "g0")] == [a, b, c, b, a]
  remote.group_done("g1")
  assert remote.client_for_group("g3") is b  # b is the only server with no group
  assert remote.client_for_group("g4") is c  # all hold one: round-robin goes on after b
  remote._record(0, {"driver": {}}, pid=None)  # a and b answer their poll, c does not
  remote._record(1, {"driver": {}}, pid=None)
  assert remote._fetch(2, timeout_s=0.1) == {}
  assert remote.client_for_group("g2") is a  # off c; a and b hold one each: round-robin
  assert remote.client_for_group("g4") is b  # off c; b holds fewer than a
  assert remote.client_for_group("g5") is a  # a and b hold two each, c none but it is down
  assert remote.client_for_group("g2") is a  # settled on a while a answers
  for i in range(3):
    remote._up[i] = False  # nothing answers (or no poll yet): every server a candidate
  assert remote.client_for_group("g6") is c
