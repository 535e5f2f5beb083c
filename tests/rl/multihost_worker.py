"""One trainer process of tests/rl/test_multihost.py: the real Learner, Trainer, Orbax
checkpointer, persisted ReplayQueue and StalenessManager, on a tiny model over a (data, fsdp,
tensor) mesh spanning every process's fake CPU devices.

Generation is replaced by `ScriptedRollout` on the lead: deterministic groups admitted through
the real staleness rule and pushed into the real replay queue, refilled whenever a version is
published (as an engine whose episodes finish between two steps would), so a run's groups,
their token versions and the counters depend on the step sequence alone, never on timing. It is
also the lead's weight sync: every published version's parameters are written to
`out/params_v<version>.npz`, the oracle the test compares across process layouts (the
parameters are gathered to process 0 for it: `TrainerConfig.gather_weights`). With "store",
every process publishes instead into the sharded weight store (`rl.weight_sync`
DirectoryWeightPublisher, float32) at run/weights, writing the shards it holds; with
"background" too, on each process's writer thread while the next steps train. With "export",
the final policy is also saved as a Hugging Face checkpoint (`hf_io.save`).

Run: python -m tests.rl.multihost_worker '<json spec>' (see `test_multihost.worker_spec`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from asearcher_jax import distributed

GROUP_SIZE = 2
PROMPT = 8


def scripted_group(i: int, version: int, vocab: int):
  """Group i: GROUP_SIZE trajectories of one sequence each, lengths, tokens, behaviour
  logprobs and rewards drawn from seed i; generated tokens stamped with `version`."""
  from asearcher_jax.rl.replay import Group

  rng = np.random.default_rng(1000 + i)
  trajs = []
  for _ in range(GROUP_SIZE):
    n = int(rng.integers(PROMPT + 8, 56))
    gen = np.arange(n) >= PROMPT
    trajs.append([{
      "tokens": rng.integers(3, vocab, n).astype(np.int32),
      "loss_mask": gen.astype(np.int32),
      "logprobs": np.where(gen, rng.uniform(-4.0, -0.5, n), 0.0).astype(np.float32),
      "versions": np.where(gen, version, -1).astype(np.int32),
    }])  # fmt: skip
  advantages = [float(r) for r in rng.uniform(0.0, 1.0, GROUP_SIZE)]
  return Group(
    group_id=f"g{i:03d}", trajectories=trajs, advantages=advantages, created_version=version,
    created_at=float(i),
  )  # fmt: skip


class ScriptedRollout:
  """Admits and pushes groups while the staleness rule allows; publishes record parameters."""

  def __init__(self, *, staleness, replay, total: int, vocab: int, out: Path) -> None:
    self.staleness, self.replay, self.total, self.vocab, self.out = (
      staleness, replay, total, vocab, out,
    )  # fmt: skip
    self.next = 0
    self.store = None  # a DirectoryWeightPublisher: publish there instead of recording

  def resume_from(self, replay_dir: Path) -> None:
    """The cursor after a restart: one past every group the groups log ever recorded."""
    from asearcher_jax.rl.replay import GROUPS_LOG, _read_records

    records, _ = _read_records(replay_dir / GROUPS_LOG)
    self.next = len(records)

  def fill(self) -> None:
    while self.next < self.total and self.staleness.try_start():
      self.replay.push(scripted_group(self.next, self.staleness.version, self.vocab), timeout=5)
      self.staleness.on_accept()
      self.next += 1

  def flush(self, timeout=None) -> None:
    if self.store is not None:
      self.store.flush(timeout)

  def close(self, timeout=None) -> None:
    if self.store is not None:
      self.store.close(timeout)

  def publish(self, learner) -> dict[str, float]:
    import jax

    metrics: dict[str, float] = {}
    if self.store is not None:
      metrics = self.store.publish(learner)
    else:
      params = jax.device_get(learner.params_copy())
      flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree.leaves_with_path(params)}
      np.savez(self.out / f"params_v{learner.version}.npz", **flat)
    self.staleness.set_version(learner.version)
    self.fill()
    return metrics


def main(spec: dict) -> None:
  distributed.initialize(
    distributed.DistributedConfig(
      coordinator_address=spec.get("coordinator"),
      num_processes=spec["num_processes"],
      process_id=spec["process_id"],
      local_device_count=spec["local_devices"],
      tpu_autodetect="never",
      initialization_timeout_s=60,
    )
  )
  import jax
  from flax import nnx

  from asearcher_jax.checkpoint import CheckpointConfig, Checkpointer
  from asearcher_jax.metric_writer import MetricWriter
  from asearcher_jax.model import transformer
  from asearcher_jax.model.config import ModelConfig
  from asearcher_jax.model.sharding import MeshConfig
  from asearcher_jax.model.steps import OptimizerConfig
  from asearcher_jax.rl.learner import Learner, PPOConfig
  from asearcher_jax.rl.replay import ReplayConfig, ReplayQueue
  from asearcher_jax.rl.staleness import StalenessConfig, StalenessManager
  from asearcher_jax.rl.trainer import Trainer, TrainerConfig
  from asearcher_jax.rl.weight_sync import DirectoryWeightPublisher, WeightSyncConfig

  assert jax.process_count() == spec["num_processes"], jax.process_count()
  assert jax.device_count() == 8, jax.devices()
  run, out = Path(spec["run_dir"]), Path(spec["out_dir"])
  out.mkdir(parents=True, exist_ok=True)
  cfg = ModelConfig(
    vocab_size=512, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
    num_kv_heads=2, tie_word_embeddings=True, max_position_embeddings=256,
  )  # fmt: skip
  graphdef, params = nnx.split(transformer.Transformer(cfg, rngs=nnx.Rngs(0)))
  learner = Learner(
    graphdef, params,
    ppo=PPOConfig(row_len=64, eps_clip=0.2),
    optimizer=OptimizerConfig(learning_rate=3e-3, weight_decay=0.0),
    mesh=MeshConfig(data=2, fsdp=2, tensor=2).build(),
  )  # fmt: skip
  lead = jax.process_index() == 0
  batch = 2
  replay = staleness = rollout = None
  if lead:
    staleness = StalenessManager(StalenessConfig(batch_groups=batch, max_staleness=1))
    replay = ReplayQueue(
      ReplayConfig(directory=str(run / "replay"), compact_after=0, fsync=False),
      on_discard=lambda g: staleness.on_discard(),
    )
    rollout = ScriptedRollout(
      staleness=staleness, replay=replay, total=spec["total_groups"], vocab=cfg.vocab_size, out=out
    )
    rollout.resume_from(run / "replay")
  store = None
  if spec.get("store"):  # every process publishes the shards it holds
    sync = WeightSyncConfig(dtype=None)
    if spec.get("background"):  # on a writer thread; every committed version kept for the test;
      # laid out for tensor=4 servers: both processes write shards of inner chunks
      sync = WeightSyncConfig(
        dtype=None, background=True, keep_versions=100, timeout_s=120, reader_tensor=4
      )
    store = DirectoryWeightPublisher(run / "weights", graphdef, config=sync)
    if lead:
      rollout.store = store
  ckpt = Checkpointer(CheckpointConfig(directory=str(run / "ckpt"), max_to_keep=3))
  writer = MetricWriter(run / "metrics", tensorboard=False)
  trainer = Trainer(
    config=TrainerConfig(
      train_steps=spec["steps"], batch_groups=batch, poll_s=0.2, batch_timeout_s=120,
      checkpoint_every=spec["checkpoint_every"],
      gather_weights=store is None,  # the scripted sync records whole tensors on the lead
    ),
    learner=learner, replay=replay, staleness=staleness, weight_sync=rollout if lead else store,
    checkpointer=ckpt, writer=writer,
  )  # fmt: skip
  resumed = trainer.restore()
  if lead:
    rollout.fill()

  def on_step(metrics: dict) -> None:
    if learner.version == spec.get("pause_after"):
      writer.flush()
      (out / f"paused_{jax.process_index()}").write_text(str(learner.version))
      time.sleep(600)  # the test SIGKILLs every process here

  trainer.run(on_step=on_step)
  if spec.get("export"):  # every process takes part (gathers); process 0 alone writes
    from asearcher_jax.model import hf_io

    hf_io.save(nnx.merge(graphdef, learner.params), run / "export")
  if store is not None:
    store.close()  # background writes: the last version is committed before the result
  ckpt.close()
  writer.close()
  result = {
    "process": jax.process_index(),
    "resumed": resumed,
    "version": learner.version,
    "trained_ids": trainer.trained_ids,
    "history": trainer.history,
  }
  if store is not None:
    result["store"] = {"written": store.written, "superseded": store.superseded,
                       "write_s": store.write_s}  # fmt: skip
  if lead:
    result["staleness"] = staleness.stats()
    result["pending"] = replay.pending_ids()
    replay.close()
  (out / f"result_{jax.process_index()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  main(json.loads(sys.argv[1]))
