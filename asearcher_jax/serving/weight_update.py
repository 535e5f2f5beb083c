"""A weight update on its way to the driver's engine thread.

Callers on any thread submit (params, version); the engine thread takes at most one pending update
between two decode steps. A newer update replaces a pending one (its future is cancelled), and a
recompute the replaced one asked for is kept.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future

from flax import nnx


@dataclasses.dataclass
class Update:
  params: nnx.State
  version: int
  done: Future
  recompute: bool  # re-prefill in-flight slots and forget parked ones (else keep them)


class PendingUpdate:
  """At most one weight update waiting for the engine thread; a newer one replaces it."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._update: Update | None = None

  def submit(self, params: nnx.State, version: int, recompute: bool) -> Future:
    done: Future = Future()
    with self._lock:
      if self._update is not None:
        self._update.done.cancel()
        # The replaced update's weights never ran, but a recompute it asked for still must: the
        # cache may hold keys/values of weights unrelated to the new ones (a reset).
        recompute = recompute or self._update.recompute
      self._update = Update(params=params, version=int(version), done=done, recompute=recompute)
    return done

  def take(self) -> Update | None:
    with self._lock:
      update, self._update = self._update, None
    return update
