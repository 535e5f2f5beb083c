"""The trainer's side of disaggregated RL: generation on separate `serve-model` servers.

AReaL and ASearcher run generation and training on disjoint devices (ASearcher's recipe: 96
inference + 32 training GPUs). Here that is one trainer process (`asearcher train` with
`engine_address_files` and `weights_dir`) and any number of `asearcher serve-model` processes,
each started with the same `weights_dir`. `RemoteEngines` is everything the trainer needs from
them:
  * a client per server, one server per GRPO group (`client_for_group`): the n episodes of a
    group start from one prompt, so on one server its pages are prefilled once and shared, where
    spread over k servers each would prefill it; an episode keeps its client for all its calls
    (the server holding its parked prefix). A new group goes to the live server with the fewest
    groups in flight, so long groups do not pile up on one server;
  * weight sync (`rl.weight_sync.WeightSync`: publish, flush, close): each version is written to
    `weights_dir` (`DirectoryWeightPublisher`); the servers' watchers load it between decode
    steps and stamp the tokens with the version they actually ran, so staleness measured from
    token versions stays exact while they catch up;
  * `wait_loaded`: at start (fresh or resumed) every server must run the trainer's weights
    before the first episode, whatever init it was started from;
  * `stats()`: the fleet's engine figures (summed /health driver stats, slot occupancy over all
    slots, the oldest version any server runs), polled on a thread and cached, so callers on the
    rollout's event loop never block on HTTP.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flax import nnx

from asearcher_jax.errors import AsearcherError
from asearcher_jax.rl.weight_sync import DirectoryWeightPublisher, PolicySource, WeightSyncConfig
from asearcher_jax.serving.client import RemoteClientConfig, RemoteGenerationClient, read_address
from asearcher_jax.serving.weights_dir import read_latest

log = logging.getLogger(__name__)

# Per-step driver figures: averaged over servers, not summed.
_MEAN = {"decode_rows_per_step", "last_update_ms"}
# Gauges: what a server has now (the rest are counters since it started).
_GAUGES = {
  "slots", "slots_active", "slot_occupancy", "queue_depth", "version", "decode_tokens_per_s",
  "decode_rows_per_step", "last_update_ms", "slots_parked",
}  # fmt: skip


class RemoteEngines:
  """A fleet of `serve-model` servers fed through one weights directory (module docstring)."""

  def __init__(
    self,
    address_files: Sequence[str | Path],
    weights_dir: str | Path,
    graphdef: nnx.GraphDef,
    *,
    client: RemoteClientConfig = RemoteClientConfig(),
    sync: WeightSyncConfig = WeightSyncConfig(),
    poll_s: float = 0.5,
  ) -> None:
    if not address_files:
      raise AsearcherError("engine_address_files is empty: name at least one serve-model server")
    self.address_files = [Path(a) for a in address_files]
    self.clients = [RemoteGenerationClient(address_file=a, config=client) for a in address_files]
    self.publisher = DirectoryWeightPublisher(weights_dir, graphdef, sync)
    self.poll_s = poll_s
    self._lock = threading.Lock()
    self._groups: dict[str, int] = {}  # group in flight -> its server
    self._load = [0] * len(self.clients)  # groups in flight per server
    self._rr = 0  # where the round-robin among equally loaded servers starts
    self._health: list[dict[str, Any] | None] = [None] * len(self.clients)
    # Counters a server had before it restarted (they start again from 0), per server.
    self._base: list[dict[str, float]] = [{} for _ in self.clients]
    self._pid: list[int | None] = [None] * len(self.clients)  # from the address file
    self._up = [False] * len(self.clients)  # answered the last poll
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  # --- agents ----------------------------------------------------------------------------------

  def client_for_group(self, group: str) -> RemoteGenerationClient:
    """The server of `group` (called once per episode attempt; the agent keeps the client for
    its whole episode). A new group takes the live server with the fewest groups in flight,
    round-robin among equals. A group whose server stopped answering the /health poll moves for
    its later episodes (a retry after the server died goes where it can run); while no server
    is known to answer (before `start()`, or all down) every one is a candidate, and a server
    restarted behind its address file is found by the client's retries."""
    with self._lock:
      n = len(self.clients)
      live = [i for i in range(n) if self._up[i]] or list(range(n))
      i = self._groups.get(group)
      if i is None or i not in live:
        if i is not None:
          self._load[i] -= 1
        i = min(live, key=lambda j: (self._load[j], (j - self._rr) % n))
        self._rr = (i + 1) % n
        self._groups[group] = i
        self._load[i] += 1
      return self.clients[i]

  def group_done(self, group: str) -> None:
    """`group` ended (accepted, rejected or cancelled): its server no longer counts it."""
    with self._lock:
      i = self._groups.pop(group, None)
      if i is not None:
        self._load[i] -= 1

  async def close_clients(self) -> None:
    for c in self.clients:
      await c.close()

  # --- weights ---------------------------------------------------------------------------------

  def publish(self, learner: PolicySource) -> dict[str, float]:
    """`WeightSync`: writes the learner's version; the servers load it on their next poll."""
    return self.publisher.publish(learner)

  def flush(self, timeout: float | None = None) -> None:
    """`WeightSync`: waits for the versions published so far to be in the store (background
    writes); raises a failed write."""
    self.publisher.flush(timeout)

  def close(self, timeout: float | None = None) -> None:
    """`WeightSync`: waits for the last write (at most the sync's timeout_s) and stops the
    writer thread; a second call does nothing. The clients and the /health poller have their
    own ends (`close_clients`, `stop`)."""
    self.publisher.close(timeout)

  def wait_loaded(self, timeout_s: float) -> None:
    """Blocks until every server runs what the LATEST pointer names (same publish time), or
    raises AsearcherError naming the servers that did not (unreachable, or still loading)."""
    self.publisher.flush(timeout_s)  # what was published is in the store first
    latest = read_latest(self.publisher.root)
    if latest is None:
      raise AsearcherError(f"nothing published in {self.publisher.root}")
    want = {"version": int(latest["version"]), "time": latest.get("time")}
    deadline = time.monotonic() + timeout_s
    behind = list(range(len(self.clients)))
    while True:
      behind = [i for i in behind if self._fetch(i, timeout_s=5.0).get("weights") != want]
      if not behind:
        return
      if time.monotonic() > deadline:
        names = ", ".join(f"{self.address_files[i]} ({self._describe(i)})" for i in behind)
        raise AsearcherError(
          f"serve-model servers did not load version {want['version']} from "
          f"{self.publisher.root} within {timeout_s:g} s: {names}. Start each with "
          f"weights_dir={self.publisher.root}."
        )
      time.sleep(0.1)

  # --- figures ---------------------------------------------------------------------------------

  def start(self) -> None:
    """Starts the /health poller behind `stats()`."""
    for i in range(len(self.clients)):
      self._fetch(i, timeout_s=5.0)
    self._thread = threading.Thread(target=self._poll, name="engine-health", daemon=True)
    self._thread.start()

  def stop(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(10)
      self._thread = None

  def stats(self) -> dict[str, float]:
    """The fleet as one engine: counters summed over every server's life (a restarted server's
    counters continue from its predecessor's), gauges and rates summed over the servers up now,
    per-step figures averaged, occupancy over their slots, the oldest version any runs (-1 while
    none answers)."""
    with self._lock:
      last = [h.get("driver", {}) if h is not None else {} for h in self._health]
      up = [d for d, ok in zip(last, self._up, strict=True) if ok and d]
      bases = [dict(b) for b in self._base]
    out: dict[str, float] = {}
    for d, b in zip(last, bases, strict=True):
      for k, v in _add_counters(b, d).items():
        out[k] = out.get(k, 0.0) + v
    for d in up:
      for k, v in d.items():
        if k in _GAUGES and isinstance(v, int | float) and not isinstance(v, bool):
          out[k] = out.get(k, 0.0) + float(v)
    for k in _MEAN & set(out):
      out[k] /= len(up)
    slots = out.get("slots", 0.0)
    out["slot_occupancy"] = out.get("slots_active", 0.0) / slots if slots else 0.0
    out["version"] = float(min((d.get("version", -1) for d in up), default=-1))
    out["servers_up"] = float(len(up))
    out["servers"] = float(len(self.clients))
    return out

  def _poll(self) -> None:
    while not self._stop.wait(self.poll_s):
      for i in range(len(self.clients)):
        self._fetch(i, timeout_s=max(self.poll_s, 2.0))

  def _fetch(self, i: int, *, timeout_s: float) -> dict[str, Any]:
    """Server i's /health (recorded for stats()); {} when it cannot be reached."""
    try:
      text = self.address_files[i].read_text()
      url = read_address(self.address_files[i]) + "/health"
      with urllib.request.urlopen(url, timeout=timeout_s) as r:
        health = json.loads(r.read())
      pid = json.loads(text).get("pid") if text.lstrip().startswith("{") else None
    except (OSError, ValueError, KeyError, urllib.error.URLError) as e:
      log.debug("server %s: %s", self.address_files[i], e)
      with self._lock:
        self._up[i] = False
      return {}
    self._record(i, health, pid)
    return health

  def _record(self, i: int, health: dict[str, Any], pid: int | None) -> None:
    """Keeps server i's latest answer. A new process behind the address file (another pid, or
    counters that went backwards) starts its counters at 0: the old ones move to its base."""
    with self._lock:
      old = self._health[i]
      if old is not None and (
        (pid is not None and self._pid[i] is not None and pid != self._pid[i])
        or _went_back(old.get("driver", {}), health.get("driver", {}))
      ):
        self._base[i] = _add_counters(self._base[i], old.get("driver", {}))
      self._health[i], self._pid[i], self._up[i] = health, pid, True

  def _describe(self, i: int) -> str:
    with self._lock:
      h = self._health[i] if self._up[i] else None
    if h is None:
      return "not reachable"
    return f"runs {h.get('weights') or 'its initial weights'}"


def _went_back(old: dict[str, Any], new: dict[str, Any]) -> bool:
  return any(float(new.get(k, 0)) < float(old.get(k, 0)) for k in ("tokens_generated", "updates"))


def _add_counters(base: dict[str, float], driver: dict[str, Any]) -> dict[str, float]:
  """base + the counters (not gauges) of one driver's stats."""
  out = dict(base)
  for k, v in driver.items():
    if k not in _GAUGES and isinstance(v, int | float) and not isinstance(v, bool):
      out[k] = out.get(k, 0.0) + float(v)
  return out
