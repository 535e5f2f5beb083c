"""`rl.remote.RemoteEngines` over two real servers (OpenAI facade + driver + weights watcher, in
this process on loopback): the start gate waits for every server to run the trainer's weights
and names the one that does not, episodes alternate between servers, and the fleet's figures
are the sum of the servers'."""

from __future__ import annotations

import asyncio
import json

import pytest
from flax import nnx

from asearcher_jax.errors import AsearcherError
from asearcher_jax.rl.remote import RemoteEngines
from asearcher_jax.serving.client import RemoteClientConfig
from asearcher_jax.serving.openai_api import OpenAIServer, OpenAIServerConfig
from asearcher_jax.serving.types import SamplingParams
from asearcher_jax.serving.weights_dir import DirectoryWeightWatcher
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

    # Round-robin, one server per episode; both now compute the trainer's policy.
    clients = [remote.client_for_episode() for _ in range(4)]
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
