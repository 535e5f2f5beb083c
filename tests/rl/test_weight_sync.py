"""Weight sync: in process, a real Learner's new weights reach the real Driver mid-generation
(engine-stamped versions change inside one request); across processes (simulated with two
objects and a temp dir), a version published to the weight store (bf16 by default) behind an
atomic LATEST pointer is picked up by a watcher; every sync has `flush` (raises a failed write)
and an idempotent `close`. The trainer, not the sync, tells the staleness manager each version
(tests/rl/test_trainer_e2e.py::test_the_trainer_tells_staleness_each_version_after_the_sync)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asearcher_jax.model import steps
from asearcher_jax.rl.learner import Learner, PPOConfig
from asearcher_jax.rl.replay import Group
from asearcher_jax.rl.weight_sync import (
  DirectoryWeightPublisher,
  InProcessWeightSync,
  WeightSync,
  WeightSyncConfig,
)
from asearcher_jax.serving.types import SamplingParams
from asearcher_jax.serving.weights_dir import (
  LATEST,
  DirectoryWeightWatcher,
  load_version,
  read_latest,
  versions,
)
from tests.serving.conftest import (  # noqa: F401
  VOCAB,
  hold_driver,
  kv_layout,
  make_driver,
  tiny_model,
  tokenizer,
)


def make_learner(model) -> Learner:
  graphdef, params = nnx.split(model)
  return Learner(
    graphdef,
    jax.tree.map(jnp.copy, params),  # the engine keeps the originals; the learner donates
    ppo=PPOConfig(row_len=32),
    optimizer=steps.OptimizerConfig(learning_rate=1e-2, weight_decay=0.0),
  )


def one_group(seed: int = 0) -> Group:
  rng = np.random.default_rng(seed)
  trajs = []
  for _ in range(2):
    tokens = rng.integers(1, VOCAB, 16).astype(np.int32)
    mask = (np.arange(16) >= 6).astype(np.int32)
    trajs.append([{
      "tokens": tokens, "loss_mask": mask, "logprobs": np.where(mask > 0, -4.6, 0.0).astype(np.float32),
      "versions": np.where(mask > 0, 0, -1).astype(np.int32),
    }])  # fmt: skip
  return Group(group_id=f"g{seed}", trajectories=trajs, advantages=[1.0, -1.0], created_version=0)


def bf16(tree):
  """What a bf16 store hands a float32 server: each weight rounded to bf16."""
  return jax.tree.map(
    lambda x: np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(x.dtype)), tree
  )


def leaves_equal(a, b) -> bool:
  return all(
    np.array_equal(np.asarray(x), np.asarray(y))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


@pytest.mark.slow
async def test_in_process_update_lands_mid_generation(make_driver):  # noqa: F811
  model = tiny_model()
  driver = make_driver(model, slots=2, max_seq_len=128, buckets=(16, 128))
  learner = make_learner(model)
  sync = InProcessWeightSync(driver, WeightSyncConfig(timeout_s=60))
  learner.train_step([one_group(0)])  # version 1 (compiles before the request starts)
  # The driver thread waits once decoding is under way, until the update is submitted: polled
  # from the event loop, a slow copy on a busy machine could let all 100 tokens out first.
  with hold_driver(driver, "_step", lambda: driver.metrics["tokens"] >= 5) as hold:
    submit = driver.submit_update

    def submit_then_release(*args, **kw):
      done = submit(*args, **kw)
      hold.release()
      return done

    driver.submit_update = submit_then_release
    task = asyncio.create_task(
      driver.generate(list(range(1, 9)), SamplingParams(seed=1), 100, stop_token_ids=())
    )
    try:
      await hold.wait_reached()
      metrics = await asyncio.to_thread(sync.publish, learner)
    finally:
      driver.submit_update = submit
  result = await asyncio.wait_for(task, 60)
  versions = np.asarray(result.versions)
  assert result.stop_reason == "length" and len(versions) == 100
  assert versions[0] == 0 and versions[-1] == 1 and np.all(np.diff(versions) >= 0)
  assert driver.version == 1
  assert metrics["weight_sync/engine_update_ms"] > 0
  # The engine holds a copy: the learner's next (donating) step leaves it intact and servable.
  served = jax.tree.map(np.asarray, driver._params.state)
  learner.train_step([one_group(1)])
  assert leaves_equal(driver._params.state, served)
  await asyncio.to_thread(sync.publish, learner)
  again = await asyncio.wait_for(driver.generate([1, 2, 3], SamplingParams(seed=2), 4), 60)
  assert again.versions == [2] * len(again.versions) and driver.version == 2


class RecordingSink:
  def __init__(self) -> None:
    self.updates: list[tuple[nnx.State, int]] = []
    self.recomputes: list[bool | None] = []

  def update_params(self, params, version, timeout=600.0, *, recompute=None) -> float:
    self.updates.append((params, version))
    self.recomputes.append(recompute)
    return 1.0


def test_directory_publish_and_watch(tmp_path):
  model = tiny_model()
  learner = make_learner(model)
  graphdef, _ = nnx.split(model)
  publisher = DirectoryWeightPublisher(  # blocking: committed when publish returns
    tmp_path / "weights", graphdef, WeightSyncConfig(keep_versions=1, background=False)
  )
  sink = RecordingSink()
  watcher = DirectoryWeightWatcher(tmp_path / "weights", sink, version=0)
  assert watcher.poll_once() is None  # nothing published yet
  # A half-written version (no commit marker, no pointer yet) is invisible.
  (tmp_path / "weights" / "v00000001" / "params").mkdir(parents=True)
  assert watcher.poll_once() is None

  learner.train_step([one_group(0)])
  metrics = publisher.publish(learner)
  assert publisher.written == [1]
  n = sum(x.size for x in jax.tree.leaves(learner.params))
  assert metrics["weight_sync/gb"] == pytest.approx(2 * n / 1e9)  # bf16
  assert metrics["weight_sync/s_per_gb"] == pytest.approx(
    metrics["weight_sync/total_s"] / (2 * n / 1e9)
  )
  assert read_latest(tmp_path / "weights")["version"] == 1
  assert watcher.poll_once() == 1 and watcher.poll_once() is None  # applied once
  assert watcher.last_load["gb"] == pytest.approx(4 * n / 1e9) and watcher.last_load["load_s"] > 0
  params, version = sink.updates[-1]
  assert version == 1 and leaves_equal(params, bf16(learner.params))
  assert not leaves_equal(params, learner.params)  # published as bf16, loaded as float32

  learner.train_step([one_group(1)])
  publisher.publish(learner)
  names = sorted(p.name for p in (tmp_path / "weights").iterdir())
  assert names == [LATEST, "v00000002"]  # keep_versions=1 pruned v1
  assert json.loads((tmp_path / "weights" / LATEST).read_text())["path"] == "v00000002"
  assert watcher.poll_once() == 2 and leaves_equal(sink.updates[-1][0], bf16(learner.params))


def test_watcher_runs_whatever_the_pointer_names(tmp_path):
  """A server converges on the trainer's weights whatever it started from: the first pointer
  is loaded even at the version it already claims (v0 over its own init), and a trainer that
  resumed from an older checkpoint moves it back, each time with a forced recompute."""
  model = tiny_model()
  learner = make_learner(model)
  graphdef, _ = nnx.split(model)
  publisher = DirectoryWeightPublisher(tmp_path / "w", graphdef)
  sink = RecordingSink()
  watcher = DirectoryWeightWatcher(tmp_path / "w", sink, version=0)
  assert watcher.status() is None
  publisher.publish(learner)  # version 0: a fresh run's start
  publisher.flush()  # a no-op for blocking writes (the default); background ones: the commit
  assert watcher.poll_once() == 0 and sink.recomputes == [True]
  assert watcher.status()["version"] == 0 and watcher.poll_once() is None
  at_v0 = jax.tree.map(np.asarray, learner.params)
  learner.train_step([one_group(0)])
  publisher.publish(learner)
  publisher.flush()
  assert watcher.poll_once() == 1 and sink.recomputes[-1] is None  # newer: kv_on_update decides
  # The trainer crashed before checkpointing v1 and resumed at v0: same version, new pointer.
  time.sleep(0.01)
  publisher.write(at_v0, 0)
  assert watcher.poll_once() == 0 and sink.recomputes[-1] is True
  assert leaves_equal(sink.updates[-1][0], bf16(at_v0)) and watcher.version == 0


@pytest.mark.slow  # ~8 s
def test_watcher_thread_feeds_a_real_driver(tmp_path, make_driver):  # noqa: F811
  model = tiny_model()
  driver = make_driver(model, slots=1, max_seq_len=32, buckets=(16, 32))
  learner = make_learner(model)
  publisher = DirectoryWeightPublisher(tmp_path / "w", nnx.split(model)[0])
  watcher = DirectoryWeightWatcher(tmp_path / "w", driver, poll_s=0.02)
  watcher.start()
  try:
    learner.train_step([one_group(0)])
    publisher.publish(learner)
    deadline = time.monotonic() + 30
    while driver.version != 1:
      assert time.monotonic() < deadline
      time.sleep(0.02)
  finally:
    watcher.stop()
    publisher.close()
  assert watcher.loaded == [1] and leaves_equal(driver._params.state, bf16(learner.params))


BACKGROUND = WeightSyncConfig(background=True)


class GatedPublisher(DirectoryWeightPublisher):
  """A slow store: each write waits for `gate` (then writes for real, or fails on `fail_at`)."""

  def __init__(self, *args, fail_at: int | None = None, **kw) -> None:
    super().__init__(*args, **kw)
    self.gate = threading.Event()
    self.started: list[int] = []
    self.fail_at = fail_at

  def write(self, params, version):
    self.started.append(version)
    assert self.gate.wait(30), "the test never opened the gate"
    if version == self.fail_at:
      raise OSError("store unreachable")
    return super().write(params, version)


def test_background_publish_lets_the_trainer_run_ahead_of_a_slow_store(tmp_path):
  """Four real train steps and publishes complete while the store cannot finish a single write;
  then the first version and the newest are committed, in order, with the right weights; the
  two between were superseded (never half-written). Blocking mode waits for the store."""
  model = tiny_model()
  learner = make_learner(model)
  publisher = GatedPublisher(tmp_path / "w", nnx.split(model)[0],
                             WeightSyncConfig(keep_versions=4, background=True))  # fmt: skip
  published = {}
  for v in range(1, 5):
    learner.train_step([one_group(v)])
    metrics = publisher.publish(learner)  # returns with the store stuck on version 1
    published[v] = bf16(learner.params)
    assert learner.version == v
    assert metrics["weight_sync/charged_s"] >= 0
  assert publisher.written == [] and read_latest(tmp_path / "w") is None
  publisher.gate.set()
  publisher.flush(timeout=60)
  assert publisher.started == [1, 4] and publisher.written == [1, 4]
  assert publisher.superseded == [2, 3]
  assert sorted(versions(tmp_path / "w")) == [1, 4] and read_latest(tmp_path / "w")["version"] == 4
  for v in (1, 4):  # each committed version holds the weights of its own step
    got = load_version(tmp_path / "w" / f"v{v:08d}")
    assert leaves_equal(got, published[v])
  m = publisher.publish(learner)  # the next publish reports the last completed write
  assert m["weight_sync/written_version"] == 4 and m["weight_sync/gb"] > 0
  publisher.close(timeout=60)
  with pytest.raises(RuntimeError, match="closed"):
    publisher.publish(learner)

  blocking = GatedPublisher(tmp_path / "b", nnx.split(model)[0],
                            config=WeightSyncConfig(background=False))  # fmt: skip
  t = threading.Thread(target=blocking.publish, args=(learner,), daemon=True)
  t.start()
  t.join(0.3)
  assert t.is_alive() and blocking.written == []  # the trainer waits on the store
  blocking.gate.set()
  t.join(60)
  assert not t.is_alive() and blocking.written == [learner.version]


def test_background_write_errors_surface_and_close_times_out(tmp_path):
  model = tiny_model()
  learner = make_learner(model)
  publisher = GatedPublisher(tmp_path / "w", nnx.split(model)[0], fail_at=0, config=BACKGROUND)
  publisher.publish(learner)  # version 0: its write will fail
  with pytest.raises(TimeoutError, match=r"WeightSyncConfig\.timeout_s"):
    publisher.flush(timeout=0.2)  # the store is stuck: no hang, a clear error
  publisher.gate.set()
  with pytest.raises(RuntimeError, match="store unreachable"):
    publisher.flush(timeout=60)
  learner.train_step([one_group(1)])
  publisher.publish(learner)  # raised once; the next version goes through
  publisher.close(timeout=60)
  assert publisher.written == [1] and versions(tmp_path / "w") == [1]
  # An error still pending at close is raised there.
  failing = GatedPublisher(tmp_path / "f", nnx.split(model)[0], fail_at=1, config=BACKGROUND)
  failing.gate.set()
  failing.publish(learner)
  with pytest.raises(RuntimeError, match="store unreachable"):
    failing.close(timeout=60)


def test_a_trainer_under_jax_distributed_publishes_in_the_background_too(tmp_path, monkeypatch):
  """Under jax.distributed (one process here, as the local launcher starts it) the write still
  runs on the writer thread: it goes through tensorstore and coordination-service barriers, no
  Orbax save and no collective (two processes: tests/rl/test_multihost.py)."""
  model = tiny_model()
  learner = make_learner(model)
  publisher = GatedPublisher(tmp_path / "w", nnx.split(model)[0], config=BACKGROUND)
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  metrics = publisher.publish(learner)  # returns with the write stuck at the gate
  assert publisher.written == [] and metrics["weight_sync/snapshot_s"] >= 0
  deadline = time.monotonic() + 30
  while publisher.started != [0]:
    assert time.monotonic() < deadline
    time.sleep(0.01)
  assert publisher._thread is not None and publisher._thread.is_alive()
  publisher.gate.set()
  publisher.close(timeout=60)
  assert publisher.written == [0] and versions(tmp_path / "w") == [0]
  assert leaves_equal(load_version(tmp_path / "w" / "v00000000"), bf16(learner.params))


def test_every_weight_sync_flushes_and_closes_once(tmp_path):
  """The protocol on each implementation: `flush` returns once the last version is committed,
  `close` twice is one close, and publishing after it is an error."""
  from asearcher_jax.rl.remote import RemoteEngines

  model = tiny_model()
  learner = make_learner(model)
  graphdef = nnx.split(model)[0]
  sink = RecordingSink()
  in_process = InProcessWeightSync(sink)
  store = DirectoryWeightPublisher(tmp_path / "w", graphdef, BACKGROUND)
  remote = RemoteEngines([tmp_path / "engine0.json"], tmp_path / "r", graphdef, sync=BACKGROUND)
  for sync in (in_process, store, remote):
    assert isinstance(sync, WeightSync)
    sync.publish(learner)
    sync.flush(timeout=60)
  assert [v for _, v in sink.updates] == [0]
  assert store.written == [0] and read_latest(tmp_path / "w")["version"] == 0
  assert read_latest(tmp_path / "r")["version"] == 0  # the servers' store
  for sync in (in_process, store, remote):
    sync.close(timeout=60)
    sync.close(timeout=60)
    with pytest.raises(RuntimeError, match="closed"):
      sync.publish(learner)
  assert remote.publisher._thread is None


def test_remote_engines_flush_raises_a_failed_write_and_close_is_idempotent(tmp_path):
  from asearcher_jax.rl.remote import RemoteEngines

  model = tiny_model()
  learner = make_learner(model)
  remote = RemoteEngines([tmp_path / "engine0.json"], tmp_path / "r", nnx.split(model)[0])
  remote.publisher = GatedPublisher(tmp_path / "r", nnx.split(model)[0], fail_at=0,
                                    config=BACKGROUND)  # fmt: skip
  remote.publisher.gate.set()
  remote.publish(learner)  # version 0: its write fails on the writer thread
  with pytest.raises(RuntimeError, match="store unreachable"):
    remote.flush(timeout=60)
  learner.train_step([one_group(1)])
  remote.publish(learner)
  remote.close(timeout=60)
  remote.close(timeout=60)
  assert remote.publisher.written == [1] and read_latest(tmp_path / "r")["version"] == 1


def test_config_validation():
  with pytest.raises(ValueError):
    WeightSyncConfig(keep_versions=0)
  with pytest.raises(ValueError):
    WeightSyncConfig(timeout_s=0)
