"""The replay logs shipped to a bucket (a local GCS emulator, tests/gcs_emulator.py): appended on
local disk, shipped in sealed segments, and rebuilt from the bucket when a restarted VM has lost
its local disk, with the resume semantics of tests/rl/test_replay.py."""

from __future__ import annotations

import shutil

import pytest
from etils import epath

from asearcher_jax.rl.replay import CONSUMED_LOG, GROUPS_LOG, ReplayConfig, ReplayQueue
from asearcher_jax.storage import ShippedJournal
from tests.rl.test_replay import _group


def _cfg(local, remote, **kw) -> ReplayConfig:
  return ReplayConfig(capacity=16, directory=str(local), ship_to=remote, **kw)


def test_a_restarted_vm_resumes_the_queue_from_the_bucket(tmp_path, gcs_bucket):
  remote = f"{gcs_bucket}/run/replay"
  local = tmp_path / "vm1"
  q = ReplayQueue(_cfg(local, remote))
  for i in range(5):
    q.push(_group(f"g{i}", version=i), timeout=1)
  taken = q.take(2, timeout=1)
  q.commit([g.group_id for g in taken])  # ships: 5 groups, one commit
  leased = q.take(1, timeout=1)  # leased, never committed: comes back
  assert [g.group_id for g in leased] == ["g2"]
  q.push(_group("g5", version=5), timeout=1)  # after the last shipment: the local disk only
  # Nothing on the bucket is appended to: each shipment is a new object.
  segments = sorted(p.name for p in (epath.Path(remote) / f"{GROUPS_LOG}.segments").glob("*/*"))
  assert len(segments) == 1
  q.close()  # a clean stop ships the rest

  # A new VM: the local disk is gone, the queue comes back from the bucket.
  shutil.rmtree(local)
  q2 = ReplayQueue(_cfg(tmp_path / "vm2", remote))
  assert q2.pending_ids() == ["g2", "g3", "g4", "g5"]
  with pytest.raises(ValueError, match="already pushed"):
    q2.push(_group("g0", version=0), timeout=1)  # consumed ids are known too
  q2.commit([g.group_id for g in q2.take(2, timeout=1)])
  q2.push(_group("g6", version=6), timeout=1)
  q2.sync()
  # A crash (no close): what the last sync shipped survives the loss of the disk.
  q2._groups_file.close()
  q2._consumed_file.close()
  q3 = ReplayQueue(_cfg(tmp_path / "vm3", remote))
  assert q3.pending_ids() == ["g4", "g5", "g6"]
  q3.close()


def test_a_restart_on_the_same_vm_keeps_what_was_not_shipped(tmp_path, gcs_bucket):
  remote = f"{gcs_bucket}/run/replay"
  q = ReplayQueue(_cfg(tmp_path / "vm", remote))
  q.push(_group("a", version=0), timeout=1)
  q.sync()
  q.push(_group("b", version=1), timeout=1)  # appended locally, not shipped
  q._groups_file.close()
  q._consumed_file.close()
  q2 = ReplayQueue(_cfg(tmp_path / "vm", remote))  # the local log is longer: it wins
  assert q2.pending_ids() == ["a", "b"]
  q2.close()  # ships b
  q3 = ReplayQueue(_cfg(tmp_path / "elsewhere", remote))
  assert q3.pending_ids() == ["a", "b"]
  q3.close()


def test_compaction_ships_a_new_generation_and_drops_the_old(tmp_path, gcs_bucket):
  remote = f"{gcs_bucket}/run/replay"
  q = ReplayQueue(_cfg(tmp_path / "vm1", remote, compact_after=2))
  for i in range(4):
    q.push(_group(f"g{i}", version=i), timeout=1)
  q.commit([g.group_id for g in q.take(3, timeout=1)])
  q.close()
  q2 = ReplayQueue(_cfg(tmp_path / "vm2", remote, compact_after=2))  # compacts on open
  assert q2.pending_ids() == ["g3"]
  q2.close()
  gens = [p.name for p in (epath.Path(remote) / f"{GROUPS_LOG}.segments").iterdir()]
  assert gens == ["g000001"]
  assert (epath.Path(remote) / f"{CONSUMED_LOG}.generation").read_text() == "1"
  q3 = ReplayQueue(_cfg(tmp_path / "vm3", remote, compact_after=2))
  assert q3.pending_ids() == ["g3"]
  q3.close()


def test_a_shipped_journal_on_a_plain_directory_and_a_gap(tmp_path):
  """The same journal shipped to a directory (a bucket mount); a segment lost in the middle
  cuts the rebuilt journal at the gap instead of splicing records that do not follow."""
  journal = ShippedJournal(tmp_path / "local" / "j.log", tmp_path / "remote", name="j.log")
  journal.open()
  (tmp_path / "local").mkdir()
  for chunk in (b"one\n", b"two\n", b"three\n"):
    with open(tmp_path / "local" / "j.log", "ab") as f:
      f.write(chunk)
    assert journal.ship() == len(chunk)
  assert journal.ship() == 0
  (tmp_path / "local" / "j.log").unlink()
  again = ShippedJournal(tmp_path / "local" / "j.log", tmp_path / "remote", name="j.log")
  assert again.open() == len(b"one\ntwo\nthree\n")
  assert (tmp_path / "local" / "j.log").read_bytes() == b"one\ntwo\nthree\n"
  (tmp_path / "remote" / "j.log.segments" / "g000000" / f"{4:016d}").unlink()
  (tmp_path / "local" / "j.log").unlink()
  cut = ShippedJournal(tmp_path / "local" / "j.log", tmp_path / "remote", name="j.log")
  assert cut.open() == 4 and (tmp_path / "local" / "j.log").read_bytes() == b"one\n"


def test_ship_to_needs_a_local_directory():
  with pytest.raises(ValueError, match="local directory"):
    ReplayConfig(ship_to="gs://bucket/run/replay")
