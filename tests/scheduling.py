"""The test session's pytest-xdist scheduler: `--dist loadgroup` with the `tiny_run` users as one
group, every other test on its own, and a crashed worker's tests rescheduled without a hang.

pytest-xdist 3.8.0 (the newest release, 2026-12) hangs at the end of a `loadgroup` run once a
worker has crashed (a segfault in a test): the crashed worker's finished groups go back on the
queue as empty units that no worker reports back on (pytest-xdist #1378), its replacement is
given one test and waits for a second before it runs it (#1327), and the test it died on is run
again and again (#1371). A crash must cost that one test, not stall CI until its time limit.

A crashed test is run once more on the fresh worker (`mark_test_pending`, called by
tests/conftest.py's `pytest_handlecrashitem`): a segfault in native code (XLA, faiss, torch) that
comes once in many runs is reported as a rerun, by name, and a test that crashes twice fails.
"""

from __future__ import annotations

from xdist.scheduler import LoadGroupScheduling

# Set by tests/conftest.py: node-id prefixes of the tests that share the session's `tiny_run`.
ONE_WORKER_PREFIXES: tuple[str, ...] = ()


class TinyRunOnOneWorker(LoadGroupScheduling):
  """LoadGroupScheduling with the three crash-recovery fixes above."""

  def _split_scope(self, nodeid: str) -> str:
    return "tiny_run" if nodeid.startswith(ONE_WORKER_PREFIXES) else nodeid

  def remove_node(self, node) -> str | None:
    workload = self.assigned_work.pop(node)
    pending = [
      (scope, nodeid)
      for scope, unit in workload.items()
      for nodeid, completed in unit.items()
      if not completed
    ]
    if not pending:
      return None
    scope, crashitem = pending[0]  # units are sent in order: the first pending one was running
    workload[scope][crashitem] = True  # xdist reports it failed; running it again proves nothing
    for scope, unit in workload.items():
      if not all(unit.values()):  # only units with work left go back (#1378)
        self.workqueue[scope] = unit
    for other in self.assigned_work:
      self._reschedule(other)
    return crashitem

  def mark_test_pending(self, nodeid: str) -> None:
    """Queues a crashed test to run again, first in line."""
    scope = self._split_scope(nodeid)
    unit = self.workqueue.setdefault(scope, {})
    unit[nodeid] = False
    self.workqueue.move_to_end(scope, last=False)
    for node in self.assigned_work:
      self._reschedule(node)

  def _reschedule(self, node) -> None:
    """Tops a node up to at least two pending tests (a worker runs its first only once a second
    has arrived or it is told to shut down), or shuts it down once the queue is empty."""
    if node.shutting_down:
      return
    while True:
      if not self.workqueue:
        node.shutdown()
        return
      if self._pending_of(self.assigned_work[node]) >= 2:
        return
      self._assign_work_unit(node)
