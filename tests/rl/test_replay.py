"""Replay queue: oldest-first batches, each group once, bounded with timeouts, crash-safe
append-only persistence (torn tails, leases, compaction), staleness discard, diagnostics."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from asearcher_jax.agent.trajectory import TrainingSequence
from asearcher_jax.rl.replay import (
  CONSUMED_LOG,
  GROUPS_LOG,
  Group,
  ReplayConfig,
  ReplayQueue,
  logged_group_ids,
)


def _seq(n: int, version: int, prompt: int = 2) -> TrainingSequence:
  mask = np.r_[np.zeros(prompt), np.ones(n - prompt)].astype(np.int32)
  return TrainingSequence(
    tokens=np.arange(n, dtype=np.int32) % 7 + 1,
    loss_mask=mask,
    logprobs=-np.linspace(0.1, 1.0, n).astype(np.float32) * mask,
    versions=np.where(mask > 0, version, -1).astype(np.int32),
    stop_reason="stop",
    calls=[0],
  )


def _group(gid: str, version: int, *, n: int = 2, length: int = 6, created_at: float = 0.0):
  return Group(
    group_id=gid,
    trajectories=[[_seq(length + i, version)] for i in range(n)],
    advantages=[float(i) - (n - 1) / 2 for i in range(n)],
    created_version=version,
    created_at=created_at,
    metadata={"qid": gid},
  )


def test_oldest_first_each_group_once():
  q = ReplayQueue(ReplayConfig(capacity=10))
  for gid, v, t in [("c", 2, 0.0), ("a", 0, 5.0), ("b", 1, 0.0), ("a2", 0, 9.0)]:
    assert q.push(_group(gid, v, created_at=t), timeout=1)
  assert q.pending_ids() == ["a", "a2", "b", "c"]
  first = q.take(3, timeout=1)
  assert [g.group_id for g in first] == ["a", "a2", "b"]
  assert q.take(2, timeout=0.01) == []  # only one left: nothing is taken
  assert [g.group_id for g in q.take(1, timeout=1)] == ["c"]
  with pytest.raises(ValueError, match="already pushed"):
    q.push(_group("a", 5), timeout=1)


def test_bounded_push_times_out_and_commit_frees_room():
  q = ReplayQueue(ReplayConfig(capacity=2))
  assert q.push(_group("a", 0), timeout=1) and q.push(_group("b", 0), timeout=1)
  assert not q.push(_group("c", 0), timeout=0.02)
  taken = q.take(1, timeout=1)
  assert not q.push(_group("c", 0), timeout=0.02)  # a leased group still holds its place
  threading.Timer(0.05, q.commit, args=([taken[0].group_id],)).start()
  assert q.push(_group("c", 0), timeout=5)
  with pytest.raises(KeyError):
    q.commit(["nope"])


def test_take_waits_for_producer_thread_and_every_group_arrives_once():
  q = ReplayQueue(ReplayConfig(capacity=8))
  ids = [f"g{i:02d}" for i in range(40)]

  def produce():
    for i, gid in enumerate(ids):
      assert q.push(_group(gid, i // 4), timeout=10)

  t = threading.Thread(target=produce)
  t.start()
  seen = []
  while len(seen) < len(ids):
    batch = q.take(4, timeout=10)
    assert len(batch) == 4
    q.commit([g.group_id for g in batch])
    seen += [g.group_id for g in batch]
  t.join(timeout=10)
  assert sorted(seen) == ids and len(set(seen)) == len(ids)


def test_persistence_survives_reopen_with_leases_and_torn_tails(tmp_path):
  cfg = ReplayConfig(directory=str(tmp_path), compact_after=0)
  q = ReplayQueue(cfg)
  for i in range(5):
    q.push(_group(f"g{i}", i), timeout=1)
  done = q.take(2, timeout=1)
  q.commit([g.group_id for g in done])
  leased = q.take(1, timeout=1)  # trained but not checkpointed: must come back
  assert [g.group_id for g in leased] == ["g2"]
  # crash: no close(); a push was half-written and a commit line torn
  with open(tmp_path / GROUPS_LOG, "ab") as f:
    f.write(b"\x50\x00\x00\x00garbage")
  with open(tmp_path / CONSUMED_LOG, "a") as f:
    f.write('{"ids": ["g3"')
  q2 = ReplayQueue(cfg)
  assert q2.pending_ids() == ["g2", "g3", "g4"]
  g = q2.take(1, timeout=1)[0]
  orig = leased[0]
  assert g.advantages == orig.advantages and g.metadata == {"qid": "g2"}
  assert g.created_version == 2 and g.enqueued_at == pytest.approx(orig.enqueued_at)
  s, s0 = g.trajectories[1][0], orig.trajectories[1][0]
  assert isinstance(s, TrainingSequence) and s.stop_reason == "stop" and s.calls == [0]
  for k in ("tokens", "loss_mask", "logprobs", "versions"):
    np.testing.assert_array_equal(s[k], s0[k])
    assert s[k].dtype == s0[k].dtype
  # appends after a torn tail stay readable
  q2.commit([g.group_id])
  q2.push(_group("g5", 5), timeout=1)
  q2.close()
  assert ReplayQueue(cfg).pending_ids() == ["g3", "g4", "g5"]
  with pytest.raises(ValueError, match="already pushed"):
    ReplayQueue(cfg).push(_group("g0", 0), timeout=1)  # consumed ids stay known


def test_logged_group_ids_reads_a_live_log_without_touching_it(tmp_path):
  q = ReplayQueue(ReplayConfig(directory=str(tmp_path), compact_after=0))
  for i in range(3):
    q.push(_group(f"g{i}", i), timeout=1)
  q.commit([g.group_id for g in q.take(1, timeout=1)])
  with open(tmp_path / GROUPS_LOG, "ab") as f:  # a push being written right now
    f.write(b"\x50\x00\x00\x00half")
  size = (tmp_path / GROUPS_LOG).stat().st_size
  # Trained or queued, every complete group counts; the torn tail is neither read nor cut.
  assert logged_group_ids(tmp_path) == {"g0", "g1", "g2"}
  assert (tmp_path / GROUPS_LOG).stat().st_size == size
  assert logged_group_ids(tmp_path / "missing") == set()


def test_compaction_drops_consumed_groups_from_the_log(tmp_path):
  cfg = ReplayConfig(directory=str(tmp_path), compact_after=3)
  q = ReplayQueue(cfg)
  for i in range(6):
    q.push(_group(f"g{i}", i, length=200), timeout=1)
  q.commit([g.group_id for g in q.take(4, timeout=1)])
  q.close()
  size = (tmp_path / GROUPS_LOG).stat().st_size
  q2 = ReplayQueue(cfg)
  assert q2.pending_ids() == ["g4", "g5"]
  assert (tmp_path / GROUPS_LOG).stat().st_size < size / 2
  q2.close()
  assert ReplayQueue(cfg).pending_ids() == ["g4", "g5"]


def test_max_head_staleness_discards_durably_and_reports(tmp_path):
  dropped = []
  cfg = ReplayConfig(directory=str(tmp_path), max_head_staleness=2)
  q = ReplayQueue(cfg, on_discard=dropped.append)
  for gid, v in [("old", 1), ("ok", 3), ("new", 5)]:
    q.push(_group(gid, v), timeout=1)
  got = q.take(2, timeout=0.05, current_version=5)
  assert [g.group_id for g in got] == ["ok", "new"]
  assert [g.group_id for g in dropped] == ["old"]
  m = q.metrics()
  assert sum(v for k, v in m.items() if k.endswith("/discarded")) == 2  # two trajectories
  q.close()
  assert ReplayQueue(cfg).pending_ids() == ["ok", "new"]  # leased come back, dropped never


def test_length_bucket_diagnostics():
  q = ReplayQueue(ReplayConfig(length_buckets=(8, 100)))
  q.push(_group("short", 3, length=4), timeout=1)  # trajectories of 4 and 5 tokens
  q.push(_group("long", 1, length=50), timeout=1)  # 50 and 51 tokens
  q.record_rejected([6, 7, 300])
  q.take(2, timeout=1, current_version=4)
  m = q.metrics()
  assert m["replay/len_le_8/accept_rate"] == pytest.approx(2 / 4)
  assert m["replay/len_le_100/accept_rate"] == 1.0
  assert m["replay/len_gt_100/accept_rate"] == 0.0
  assert m["replay/len_le_8/staleness_max"] == 1.0  # version 4 - token version 3
  assert m["replay/len_le_100/staleness_mean"] == 3.0
  assert m["replay/len_le_100/wait_s_mean"] >= 0.0
  assert m["replay/leased"] == 2.0
  assert "replay/len_le_8/staleness_max" not in q.metrics()  # reset after reading


async def test_apush_does_not_block_the_loop():
  q = ReplayQueue(ReplayConfig(capacity=1))
  assert await q.apush(_group("a", 0), timeout=1)
  assert not await asyncio.wait_for(q.apush(_group("b", 0), timeout=0.05), timeout=2)


def test_a_groups_log_written_before_the_advantages_rename_still_reads(tmp_path):
  """Records written while the field was called "rewards" come back as `Group.advantages`,
  through `decode_group` and through a queue reopened over such a log."""
  import zlib

  import msgpack

  from asearcher_jax.rl.replay import _HEADER, decode_group, encode_group

  orig = _group("old", 1, n=3)
  record = msgpack.unpackb(encode_group(orig), raw=False)
  assert "rewards" not in record
  record["rewards"] = record.pop("advantages")  # the old format
  raw = msgpack.packb(record, use_bin_type=True)
  assert decode_group(raw).advantages == orig.advantages == [-1.0, 0.0, 1.0]
  (tmp_path / GROUPS_LOG).write_bytes(_HEADER.pack(len(raw), zlib.crc32(raw)) + raw)
  q = ReplayQueue(ReplayConfig(directory=str(tmp_path)))
  try:
    g = q.take(1, timeout=1)[0]
  finally:
    q.close()
  assert g.group_id == "old" and g.advantages == orig.advantages


def test_config_validation():
  with pytest.raises(ValueError):
    ReplayConfig(capacity=0)
  with pytest.raises(ValueError):
    ReplayConfig(length_buckets=(10, 5))
  with pytest.raises(ValueError, match="advantages"):
    Group(group_id="x", trajectories=[[]], advantages=[], created_version=0)


def test_group_from_agent_trajectories_round_trips(tmp_path):
  from asearcher_jax.agent.trajectory import LLMCall, Trajectory

  def call(i, inp, out, v):
    return LLMCall(
      index=i, kind="act", input_ids=np.asarray(inp, np.int32), output_ids=np.asarray(out, np.int32),
      logprobs=np.full(len(out), -0.5, np.float32), versions=np.full(len(out), v, np.int32),
      stop_reason="stop", max_new_tokens=8,
    )  # fmt: skip

  # the second call extends the first sequence (prefix), the third starts a new one
  traj = Trajectory(agent="t", question="q", calls=[
    call(0, [1, 2], [3, 4], 0), call(1, [1, 2, 3, 4, 9], [5], 1), call(2, [7], [8], 2),
  ])  # fmt: skip
  g = Group.from_trajectories("q1", [traj], [0.5], created_version=0, created_at=1.0)
  assert [len(s["tokens"]) for s in g.trajectories[0]] == [6, 2]
  assert g.head_versions() == [0] and g.trajectory_lengths() == [8]
  q = ReplayQueue(ReplayConfig(directory=str(tmp_path)))
  q.push(g, timeout=1)
  q.close()
  back = ReplayQueue(ReplayConfig(directory=str(tmp_path))).take(1, timeout=1)[0]
  np.testing.assert_array_equal(back.trajectories[0][0]["versions"], [-1, -1, 0, 0, -1, 1])
  np.testing.assert_array_equal(back.trajectories[0][0]["loss_mask"], [0, 0, 1, 1, 0, 1])
