"""A pod trainer's run logs (episode export, resume log, metrics) appended on its own disk and
shipped to the run directory (`storage.ShippedLogs`): nothing is appended there, readers of the
run directory see what was shipped, and a replaced VM picks the logs up where they were."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
from etils import epath

from asearcher_jax.agent.trajectory import Trajectory
from asearcher_jax.rl.episodes import EPISODES_FILE, EpisodeLog, read_episodes
from asearcher_jax.storage import ShippedLogs, read_journal

METRICS = "metrics/metrics.jsonl"


def _episode(log: EpisodeLog, gid: str) -> None:
  traj = Trajectory(agent="asearcher", qid=gid, question="q?", answers=["a"])
  log.append_group(group_id=gid, qid=gid, trajectories=[traj], versions=(0, 1), scores=[1.0],
                   advantages=[0.5], rejection=None)  # fmt: skip


def _logs(local, remote, episodes: EpisodeLog) -> ShippedLogs:
  return ShippedLogs(local, remote, journals={EPISODES_FILE: episodes.lock},
                     files=("rollout/resumed.jsonl", "metrics/*"))  # fmt: skip


@pytest.mark.parametrize("where", ["mount", "bucket"])
def test_run_logs_ship_whole_objects_and_come_back_on_a_new_vm(tmp_path, where, request):
  remote = tmp_path / "run" if where == "mount" else f"{request.getfixturevalue('gcs_bucket')}/run"
  vm1 = tmp_path / "vm1"
  episodes = EpisodeLog(vm1 / EPISODES_FILE)
  logs = _logs(vm1, remote, episodes)
  assert logs.open() == 0  # a fresh run: nothing to restore
  _episode(episodes, "g0")
  (vm1 / "metrics").mkdir()
  (vm1 / METRICS).write_text('{"step": 1}\n')
  assert logs.ship() > 0
  assert logs.ship() == 0  # nothing changed: nothing uploaded again
  _episode(episodes, "g1")
  with (vm1 / METRICS).open("a") as f:
    f.write('{"step": 2}\n{"step": 3, "tor')  # a row the writer was still writing
  logs.ship()
  # Readers of the run directory: the episode export from its segments, never an appended file.
  root = epath.Path(remote)
  assert not (root / EPISODES_FILE).exists()
  assert len(list((root / f"{EPISODES_FILE}.segments").glob("*/*"))) == 2
  assert [r["group_id"] for r in read_episodes(f"{remote}/{EPISODES_FILE}")] == ["g0", "g1"]
  assert (root / METRICS).read_text().startswith('{"step": 1}\n{"step": 2}\n')

  # A new VM: the local disk is gone; the logs come back, a torn metrics row cut off.
  shutil.rmtree(vm1)
  vm2 = tmp_path / "vm2"
  episodes2 = EpisodeLog(vm2 / EPISODES_FILE)
  logs2 = _logs(vm2, remote, episodes2)
  assert logs2.open() > 0
  assert (vm2 / METRICS).read_text() == '{"step": 1}\n{"step": 2}\n'
  assert logs2.ship() == 0  # what came back is what is there
  _episode(episodes2, "g2")
  with (vm2 / METRICS).open("a") as f:
    f.write('{"step": 3}\n')
  logs2.start()
  logs2.close()  # ships the rest
  assert [r["group_id"] for r in read_episodes(f"{remote}/{EPISODES_FILE}")] == ["g0", "g1", "g2"]
  rows = [json.loads(x) for x in (root / METRICS).read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2, 3]


def test_a_segment_holds_whole_episode_records(tmp_path):
  """The shipper takes the log's lock: a group being written is never cut in two."""
  vm, remote = tmp_path / "vm", tmp_path / "run"
  episodes = EpisodeLog(vm / EPISODES_FILE)
  logs = _logs(vm, remote, episodes)
  logs.open()
  stop = threading.Event()

  def writer():
    n = 0
    while not stop.is_set():
      _episode(episodes, f"g{n}")
      n += 1

  t = threading.Thread(target=writer)
  t.start()
  try:
    shipments = 0
    while shipments < 5:  # while the writer appends
      shipments += logs.ship() > 0
      time.sleep(0.005)
  finally:
    stop.set()
    t.join()
  logs.ship()
  segments = sorted((remote / f"{EPISODES_FILE}.segments").glob("*/*"))
  assert len(segments) > 1
  one = tmp_path / "one" / EPISODES_FILE
  one.parent.mkdir()
  counted = 0
  for seg in segments:  # each segment alone is a complete export (a cut one raises or drops)
    one.write_bytes(seg.read_bytes())
    counted += len(read_episodes(one))
  assert counted == len(read_episodes(vm / EPISODES_FILE))
  assert read_journal(remote / EPISODES_FILE) == (vm / EPISODES_FILE).read_bytes()


def test_read_journal_of_nothing_is_none(tmp_path):
  assert read_journal(tmp_path / "absent.log") is None
  assert read_episodes(tmp_path / EPISODES_FILE) == []


def test_shipped_logs_need_a_positive_period(tmp_path):
  with pytest.raises(ValueError, match="every_s"):
    ShippedLogs(tmp_path, tmp_path / "r", journals={}, files=(), every_s=0)
