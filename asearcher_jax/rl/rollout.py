"""The rollout controller: dataset items in, accepted GRPO groups out, under the staleness rule.

An asyncio loop on its own thread (the engine has its own thread, the learner owns the main one)
runs short phases per group:

  next item (a checkpointable cursor) -> admission (`StalenessManager.astart`, never a blocking
  lock) -> n agent episodes concurrently, each under a timeout, environment failures retried or
  dropped by policy -> score (per trajectory, None = excluded) -> group centring + zero-variance
  filter (`rl.reward.group_advantages`) -> `ReplayQueue.apush` (accepted) or `on_reject` +
  `record_rejected` (filtered / failed).

Runtime objects (an `AgentSource`: the agent factory, the generation client and the ToolBox it
is built from; queue, staleness manager) are built in code and passed in. Each episode's agent is
built from journaled wrappers of that client and ToolBox (`rl.inflight`), never patched after.
Scoring and counting live in `rl.scoring`. Blocking calls (disk appends, locks held by the
learner) go through `asyncio.to_thread`, so a slow learner never stalls episodes, and every await
has a timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, Literal

from asearcher_jax.agent.base import Agent
from asearcher_jax.agent.trajectory import Trajectory
from asearcher_jax.data.qa import QAExample
from asearcher_jax.rl import inflight
from asearcher_jax.rl.cursors import CurriculumCursor, DataCursor
from asearcher_jax.rl.episodes import EpisodeLog
from asearcher_jax.rl.inflight import EpisodeJournal, GroupJournal, JournalClient, JournalToolBox
from asearcher_jax.rl.replay import Group, ReplayQueue
from asearcher_jax.rl.scoring import (
  GroupScores,
  RolloutStats,
  Scorer,
  answer_scorer,
  score_group,
)
from asearcher_jax.rl.staleness import StalenessManager
from asearcher_jax.serving.types import GenerationClient

log = logging.getLogger(__name__)

# Builds one episode's agent from the generation client and the ToolBox (None: no tools) it must
# use; the controller passes journaled wrappers of both.
AgentFactory = Callable[[GenerationClient, Any], Agent]


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentSource:
  """What the controller builds each episode's agent from.

  Attributes:
    factory: (client, toolbox) -> a fresh agent.
    client: group key -> the generation client of one episode of that group, called once per
      episode attempt (remote engines: every episode of a group on one server, so the group's
      prompt is prefilled there once and its pages shared; the episode keeps the client, so its
      own prefix stays cached there).
    group_done: told each group's key once the group has ended (accepted, rejected, failed or
      cancelled), so `client` can forget it; None: nothing to tell.
    toolbox: the ToolBox every episode shares; None: agents without tools.
    stop_token_ids: the tokenizer's stop tokens (a resumed partial call continues with them).
  """

  factory: AgentFactory
  client: Callable[[str], GenerationClient]
  group_done: Callable[[str], None] | None = None
  toolbox: Any = None
  stop_token_ids: Sequence[int] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
  """Attributes:
  group_size: n, agent episodes per dataset item (one GRPO group); >= 2 for a group baseline.
  episode_timeout_s: wall-clock bound of one episode (including retries' own runs); an episode
    past it is cancelled (its engine requests aborted) and excluded as an environment failure.
  env_failure_policy: "retry" reruns an episode that failed for environment reasons (tool outage,
    engine error, timeout) up to `max_env_retries` times; "drop" excludes it at once. Either way
    a failed episode is never trained as a zero reward.
  max_env_retries: reruns per episode under "retry".
  admit_poll_s: how long one admission wait lasts before pause/stop flags are re-checked.
  push_timeout_s: how long an accepted group may wait for room in the replay queue; past it the
    group is rejected (counted) rather than holding a slot forever.
  shuffle: visit items in a fresh seeded permutation each epoch (else file order).
  seed: permutation seed.
  occupancy_sample_s: how often `engine_stats` is sampled for mean slot occupancy (0 = never).
  curriculum: draw items through `CurriculumCursor` (buckets from `QAExample.bucket`, thinned out
    where recent groups were zero-variance; always shuffled within a bucket, `shuffle` is
    ignored) instead of the plain walk.
  curriculum_floor: a bucket's weight never drops below this fraction of its size.
  curriculum_decay: per-observation decay of a bucket's mixed-group counts (0.95: ~20 groups).
  """

  group_size: int = 4
  episode_timeout_s: float = 1800.0
  env_failure_policy: Literal["retry", "drop"] = "retry"
  max_env_retries: int = 2
  admit_poll_s: float = 0.5
  push_timeout_s: float = 600.0
  shuffle: bool = True
  seed: int = 0
  occupancy_sample_s: float = 0.05
  curriculum: bool = False
  curriculum_floor: float = 0.05
  curriculum_decay: float = 0.95

  def __post_init__(self):
    if self.group_size < 1:
      raise ValueError(f"group_size must be >= 1, got {self.group_size}")
    if self.episode_timeout_s <= 0 or self.admit_poll_s <= 0 or self.push_timeout_s <= 0:
      raise ValueError("episode_timeout_s, admit_poll_s and push_timeout_s must be > 0")
    if self.env_failure_policy not in ("retry", "drop"):
      raise ValueError(f"env_failure_policy must be 'retry' or 'drop': {self.env_failure_policy}")
    if self.max_env_retries < 0:
      raise ValueError(f"max_env_retries must be >= 0, got {self.max_env_retries}")


class RolloutController:
  """Runs groups of agent episodes on a background event loop and feeds the replay queue.

  `start()` / `stop()` own the thread; `pause()` stops admitting new groups (running ones
  finish), `resume()` admits again. `run_coroutine(coro, timeout)` runs extra coroutines on the
  loop (e.g. starting a retrieval server or closing the ToolBox, whose HTTP sessions belong to
  this loop).
  """

  def __init__(
    self,
    *,
    config: RolloutConfig,
    items: Sequence[QAExample],
    agents: AgentSource,
    staleness: StalenessManager,
    replay: ReplayQueue,
    scorer: Scorer | None = None,
    engine_stats: Callable[[], Mapping[str, float]] | None = None,
    episode_log: EpisodeLog | None = None,
    resume_log: inflight.ResumeLog | None = None,
  ) -> None:
    """`episode_log`: exports every finished episode for inspection (`rl.episodes`);
    `resume_log`: a line per episode resumed from its journal, once its replay ends."""
    self.config = config
    self.episode_log, self.resume_log = episode_log, resume_log
    self.items = list(items)
    self.agents = agents
    self.staleness = staleness
    self.replay = replay
    self.scorer = scorer or answer_scorer()
    self.engine_stats = engine_stats
    self.cursor: DataCursor | CurriculumCursor
    if config.curriculum:
      self.cursor = CurriculumCursor(
        [it.bucket for it in self.items], seed=config.seed, floor=config.curriculum_floor,
        decay=config.curriculum_decay,
      )  # fmt: skip
    else:
      self.cursor = DataCursor(len(self.items), shuffle=config.shuffle, seed=config.seed)
    self._skip: set[str] = set()  # item keys whose groups already sit in the replay queue
    self._journals: dict[str, GroupJournal] = {}  # running groups by item key (checkpointed)
    self._resume: list[GroupJournal] = []  # groups saved in flight, run first after a restart
    self._lock = threading.Lock()  # guards the cursor and journals (read by checkpoints)
    self._stats = RolloutStats()
    self._count, self._sample = self._stats.count, self._stats.sample
    self._paused = threading.Event()
    self._stopping = threading.Event()
    self._loop: asyncio.AbstractEventLoop | None = None
    self._thread: threading.Thread | None = None
    self._ready = threading.Event()
    self._tasks: set[asyncio.Task] = set()
    self._closers: list[Callable[[], Awaitable[Any]]] = []
    self._main_error: BaseException | None = None

  # --- lifecycle (any thread) ------------------------------------------------------------------

  def start(self, timeout: float = 30.0) -> None:
    if self._thread is not None:
      raise RuntimeError("the rollout controller is already running")
    self._thread = threading.Thread(target=self._thread_main, name="rollout", daemon=True)
    self._thread.start()
    if not self._ready.wait(timeout):
      raise TimeoutError("rollout loop did not start")

  def stop(self, timeout: float = 60.0) -> None:
    """Stops admitting, cancels running groups (their slots are released) and joins."""
    self._stopping.set()
    if self._thread is not None:
      self._thread.join(timeout)
      if self._thread.is_alive():
        log.warning("rollout thread did not stop within %.0f s", timeout)
      self._thread = None

  def add_closer(self, close: Callable[[], Awaitable[Any]]) -> None:
    """Registers an async cleanup (ToolBox sessions, a retrieval server) that `stop()` runs on
    this loop after every group has been cancelled, last registered first."""
    self._closers.append(close)

  def pause(self) -> None:
    self._paused.set()

  def resume(self) -> None:
    self._paused.clear()

  @property
  def running(self) -> bool:
    """The loop thread is up (run_coroutine works)."""
    return self._loop is not None

  @property
  def paused(self) -> bool:
    return self._paused.is_set()

  def run_coroutine(self, coro: Coroutine, timeout: float) -> Any:
    """Runs `coro` on the rollout loop and waits (with a timeout) for its result."""
    if self._loop is None:
      raise RuntimeError("the rollout loop is not running")
    fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self._loop)
    try:
      return fut.result(timeout + 5)
    except concurrent.futures.TimeoutError:
      fut.cancel()
      raise TimeoutError(f"coroutine on the rollout loop exceeded {timeout:g} s") from None

  # --- checkpoint state ------------------------------------------------------------------------

  def state_dict(self, *, exclude_groups: Sequence[str] = ()) -> dict[str, Any]:
    """The data cursor and the journals of the groups in flight (JSON; see `rl.inflight`).

    Groups already handed to the replay queue (pending there) or named in `exclude_groups` (the
    trainer's trained ids: a pushed group can be trained before its journal is dropped) are left
    out, so a restart never runs a group whose result already exists."""
    done = {group_item_key(g) for g in [*self.replay.pending_ids(), *exclude_groups]}
    with self._lock:
      journals = [j for j in [*self._journals.values(), *self._resume] if j.key not in done]
      return {
        "cursor": self.cursor.state_dict(),
        "inflight": [j.snapshot() for j in journals],
      }

  def load_state_dict(
    self, state: Mapping[str, Any] | None, *, queued_ids: Sequence[str] = ()
  ) -> None:
    """Restores the cursor (None: from the start) and the groups that were in flight, which run
    first and replay their journals; items whose group is already queued (accepted after the
    checkpoint, kept by the replay log) are skipped instead of being run a second time."""
    with self._lock:
      self._skip = {group_item_key(g) for g in queued_ids}
      if state is None:
        return
      self.cursor.load_state_dict(state["cursor"])
      saved = [GroupJournal.from_snapshot(d) for d in state.get("inflight", ())]
      self._resume = [j for j in saved if j.key not in self._skip]

  # --- metrics ---------------------------------------------------------------------------------

  def metrics(self, *, reset: bool = True) -> dict[str, float]:
    """`rollout/*`: cumulative counters, and means of the per-trajectory samples since the last
    reset (reward, accuracy, turns, tokens, tool calls, occupancy, group latency and its max);
    plus the ToolBox's cumulative `tools/*` counters (calls, failures, cache hits, cost)."""
    out = self._stats.snapshot(reset=reset)
    if isinstance(self.cursor, CurriculumCursor):
      with self._lock:
        out.update(self.cursor.metrics())
    out["rollout/running_groups"] = float(self.staleness.stats()["running"])
    tool_metrics = getattr(self.agents.toolbox, "metrics", None)
    if tool_metrics is not None:
      out.update(tool_metrics())
    return out

  # --- the loop --------------------------------------------------------------------------------

  def _thread_main(self) -> None:
    loop = asyncio.new_event_loop()
    self._loop = loop
    try:
      loop.run_until_complete(self._main())
    except BaseException as e:  # recorded so the trainer can surface it
      self._main_error = e
      log.exception("rollout loop failed")
    finally:
      loop.run_until_complete(loop.shutdown_asyncgens())
      loop.run_until_complete(loop.shutdown_default_executor())
      loop.close()
      self._loop = None

  @property
  def error(self) -> BaseException | None:
    return self._main_error

  async def _main(self) -> None:
    self._ready.set()
    sampler = asyncio.create_task(self._sample_occupancy())
    try:
      while not self._stopping.is_set():
        if self._paused.is_set():
          await asyncio.sleep(min(self.config.admit_poll_s, 0.05))
          continue
        if not await self.staleness.astart(timeout=self.config.admit_poll_s):
          continue
        if self._stopping.is_set():
          self.staleness.on_reject()
          break
        journal = self._next_group()
        task = asyncio.create_task(self._run_group(journal), name=f"group-{journal.key}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
    finally:
      sampler.cancel()
      for t in list(self._tasks):
        t.cancel()
      if self._tasks:
        await asyncio.wait(list(self._tasks), timeout=30)
      for close in reversed(self._closers):
        try:
          await asyncio.wait_for(close(), 10)
        except Exception:  # one failed cleanup must not skip the others
          log.exception("rollout loop cleanup failed")

  def _next_group(self) -> GroupJournal:
    """A group saved in flight, else the next item; registered for checkpoints in the same
    critical section that advances the cursor, so a snapshot never misses an item."""
    with self._lock:
      if self._resume:
        journal = self._resume.pop(0)
      else:
        while True:
          key, index = self.cursor.next()
          if key not in self._skip:
            break
          self._skip.discard(key)
        journal = GroupJournal(
          key=key,
          index=index,
          version=self.staleness.version,
          created_at=time.time(),
          episodes=[EpisodeJournal() for _ in range(self.config.group_size)],
        )
      self._journals[journal.key] = journal
      return journal

  async def _sample_occupancy(self) -> None:
    if self.engine_stats is None or self.config.occupancy_sample_s <= 0:
      return
    while True:
      await asyncio.sleep(self.config.occupancy_sample_s)
      try:
        self._sample(engine_occupancy=self.engine_stats()["slot_occupancy"])
      except Exception:  # diagnostics must never kill the loop
        log.exception("engine stats failed")
        return

  # --- one group -------------------------------------------------------------------------------

  async def _run_group(self, journal: GroupJournal) -> None:
    """Episodes -> score -> filter -> push. Always ends in exactly one on_accept / on_reject."""
    key, item = journal.key, self.items[journal.index]
    self._count(groups_started=1, groups_resumed=int(journal.resumed))
    finished = False
    try:
      trajs = await asyncio.gather(
        *(self._run_episode(item, journal, i) for i in range(len(journal.episodes)))
      )
      finished = await self._finish_group(
        key, item, trajs, journal.version, journal.created_at, index=journal.index
      )
    except asyncio.CancelledError:
      self._count(groups_cancelled=1)
      raise
    except Exception:
      log.exception("group %s failed", key)
      self._count(groups_errored=1)
    finally:
      with self._lock:
        self._journals.pop(key, None)
      if not finished:
        self.staleness.on_reject()
      if self.agents.group_done is not None:  # after the accounting, which must never be skipped
        self.agents.group_done(key)

  async def _finish_group(
    self,
    key: str,
    item: QAExample,
    trajs: Sequence[Trajectory | None],
    version: int,
    created: float,
    *,
    index: int,
  ) -> bool:
    """Scores and pushes; returns True once the staleness manager has been told the outcome."""
    ran = [t for t in trajs if t is not None]
    outcome = score_group(trajs, self.scorer)
    for t, s in zip(trajs, outcome.scores):
      if t is not None:
        self._stats.record_trajectory(t, s)
    if outcome.usable >= 2 and isinstance(self.cursor, CurriculumCursor):
      with self._lock:
        self.cursor.observe(index, mixed=outcome.advantages is not None)
    await self._export(key, item, trajs, (version, self.staleness.version), outcome)
    lengths = [sum(s.num_tokens for s in t.training_sequences()) for t in ran]
    if outcome.rejection is not None:
      self._count(groups_rejected=1, **{outcome.rejection: 1})
      self.replay.record_rejected(lengths)
      return False
    keep, advantages, scores = outcome.keep, outcome.advantages, outcome.scores
    group = Group.from_trajectories(
      f"{key}/{item.id}",
      [trajs[i] for i in keep],
      [advantages[i] for i in keep],
      created_version=version,
      created_at=created,
      metadata={
        "qid": item.id,
        "scores": [scores[i] for i in keep],
        "item": key,
        "agent": trajs[keep[0]].agent,
      },
    )
    push = asyncio.ensure_future(self._push(group))
    try:
      ok = await asyncio.shield(push)
    except asyncio.CancelledError:
      # The push runs on a thread and may land anyway (stop() mid-push): account for what
      # really happened, so the queue and the staleness counters never disagree. `_push`
      # gives up within one poll slice once stopping.
      ok = await asyncio.wait_for(push, self.config.admit_poll_s + 30)
    if not ok:
      self._count(groups_rejected=1, groups_push_timeout=1)
      return False
    self.staleness.on_accept()
    self._count(groups_accepted=1, trajectories_accepted=len(keep))
    # Admission to acceptance: with at most (eta + 1) x B groups in flight (the staleness rule),
    # the trainer is fed only if this stays under ~(eta + 1) training steps (Little's law).
    self._sample(group_s=time.time() - created)
    return True

  async def _export(self, key: str, item: QAExample, trajs: Sequence[Trajectory | None],
                    versions: tuple[int, int], outcome: GroupScores) -> None:  # fmt: skip
    """Appends the group's episodes to the episode log; a failure is logged, never fatal."""
    if self.episode_log is not None:
      try:
        await asyncio.wait_for(asyncio.to_thread(
          self.episode_log.append_group, group_id=f"{key}/{item.id}", qid=item.id,
          trajectories=trajs, versions=versions, scores=outcome.scores,
          advantages=outcome.advantages, rejection=outcome.rejection), 60)  # fmt: skip
      except Exception:
        log.exception("episode export failed for group %s", key)

  async def _push(self, group: Group) -> bool:
    """`replay.push` on a worker thread in short slices (a full queue must not delay stop())."""
    deadline = time.monotonic() + self.config.push_timeout_s
    while True:
      left = deadline - time.monotonic()
      if await self.replay.apush(group, max(min(self.config.admit_poll_s, left), 0.0)):
        return True
      if left <= 0 or self._stopping.is_set():
        return False

  async def _run_episode(self, item: QAExample, group: GroupJournal, i: int) -> Trajectory | None:
    """One episode, rerun on environment failure per policy; None if it never produced a usable
    trajectory within the timeout. The first attempt replays the episode's saved journal."""
    c = self.config
    attempts = 1 + (c.max_env_retries if c.env_failure_policy == "retry" else 0)
    traj: Trajectory | None = None
    saved = group.episodes[i] if group.resumed else None
    for attempt in range(attempts):
      if attempt:
        self._count(episode_retries=1)
      self._count(episodes=1)
      agent, client, tools = self._journaled_agent(group, i, saved if attempt == 0 else None)
      try:
        async with asyncio.timeout(c.episode_timeout_s):
          traj = await agent.run(
            item.question,
            qid=item.id,
            answers=item.answers,
            aug_answers=item.aug_answers,
            valid_inst=item.valid_inst,
          )
        await client.replay_done()  # an episode that ended inside its journal
      except TimeoutError:
        self._count(episode_timeouts=1, env_failures=1)
        traj = None
        continue
      finally:
        self._count(
          resumed_llm_calls=client.replayed_calls,
          resumed_tokens=client.resumed_tokens
          + sum(len(r["tokens"]) for r in client.journal.calls[: client.replayed_calls]),
          resumed_tool_calls=tools.replayed_tools if tools is not None else 0,
          resumed_diverged=int(client.mismatched),
        )
      if not traj.environment_failure:
        return traj
      self._count(env_failures=1)
    if traj is not None:
      self._count(episodes_dropped=1)
    return traj

  def _journaled_agent(
    self, group: GroupJournal, i: int, saved: EpisodeJournal | None
  ) -> tuple[Agent, JournalClient, JournalToolBox | None]:
    """A fresh agent built on the episode's journaled client and ToolBox: its engine and tool
    calls are recorded into (and, when resuming, first answered from) the episode's journal."""
    journal = EpisodeJournal()
    with self._lock:
      group.episodes[i] = journal
    src = self.agents
    tools = JournalToolBox(src.toolbox, journal, saved) if src.toolbox is not None else None
    hook = self.resume_log.hook(group.key, i, saved, tools) if self.resume_log and saved else None
    client = JournalClient(
      src.client(group.key), journal, saved, default_stop_ids=src.stop_token_ids, on_replayed=hook
    )
    return src.factory(client, tools), client, tools


def group_item_key(group_id: str) -> str:
  """The item key ("e<epoch>/i<index>") of a group id made by the controller."""
  return "/".join(group_id.split("/")[:2])
