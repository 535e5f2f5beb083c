"""The eval runner: any agent x any generation client x a ToolBox, k seeded runs, resumable.

Results live in `{output_dir}/{agent}-{key}/`, where `key` hashes the full configuration (agent
and its settings, sampling, base seed, model and tools): a different configuration gets a different
directory, so stale files are never mixed into an aggregate (the original globbed `*seed*` files).
Each (dataset, run, question) is one JSON snapshot written atomically when the question finishes;
a restarted run loads finished snapshots and only computes what is missing, so a killed run
resumes where it stopped; questions that ended in an engine abort, a tool outage or an error are
not a fair try and are redone. Run r seeds each question from (seed + r, dataset, id), so asking
for k=4 after k=2 reuses runs 0-1.

Questions run on `concurrency` workers over one shared ToolBox and generation client: while one
episode waits for a tool, others generate, which is what makes a search-agent eval fast.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from asearcher_jax.agent.base import Agent
from asearcher_jax.agent.trajectory import Trajectory
from asearcher_jax.data.qa import QAExample
from asearcher_jax.evaluation import metrics
from asearcher_jax.evaluation.judge import EndpointUnreachable, LLMJudge, probe_http
from asearcher_jax.serving.types import SamplingParams
from asearcher_jax.tools import registry as tool_registry
from asearcher_jax.tools.cache import CacheMode

log = logging.getLogger(__name__)

SNAPSHOT_VERSION = 1
# An episode that ended like this did not get a fair try: recomputed when the run is resumed.
RETRY_FINISH = ("abort", "environment_failure", "error")

AgentFactory = Callable[[SamplingParams], Agent]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerConfig:
  """How the runner schedules and stores work (none of it changes the results)."""

  # Root directory; each configuration gets its own `{agent}-{key}` directory under it.
  output_dir: str
  # k: seeded runs per question (Avg@k / Pass@k).
  num_runs: int = 1
  # Base seed; run r uses seed + r.
  seed: int = 0
  # Questions in flight at once (all datasets and runs share it).
  concurrency: int = 16
  # Seconds one question (episode + judge) may take before it is recorded as an error.
  question_timeout_s: float = 3600.0
  # Seconds a reachability check of the engine, retrieval or judge endpoint may take.
  preflight_timeout_s: float = 10.0
  # Keep the full trajectory (token ids, tool texts) in each snapshot (never for sensitive sets).
  save_trajectories: bool = True
  # Score like the released eval harness (no bool mapping or CJK mode in EM/F1) instead of training.
  eval_mode: bool = True
  # Show a tqdm progress bar with live accuracy on stderr.
  progress: bool = True

  def __post_init__(self) -> None:
    if self.num_runs < 1 or self.concurrency < 1:
      raise ValueError("num_runs and concurrency must be >= 1")


def config_key(identity: Mapping[str, Any]) -> str:
  """A short stable hash of a JSON-able configuration."""
  blob = json.dumps(identity, sort_keys=True, default=str, ensure_ascii=False)
  return hashlib.sha256(blob.encode()).hexdigest()[:12]


def derive_seed(run_seed: int, dataset: str, qid: str) -> int:
  """Per-question sampling seed: independent across questions, identical across re-runs."""
  digest = hashlib.sha256(f"{run_seed}/{dataset}/{qid}".encode()).digest()
  return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def safe_name(qid: str) -> str:
  """A file name for any id ('/' and friends replaced; a hash keeps replaced ids distinct)."""
  name = re.sub(r"[^A-Za-z0-9_.-]", "_", qid)[:80]
  if name != qid:
    name += "-" + hashlib.sha256(qid.encode()).hexdigest()[:8]
  return name


def question_digest(ex: QAExample) -> str:
  """Detects a question whose text or gold changed since its snapshot was written."""
  blob = json.dumps([ex.question, list(ex.answers)], ensure_ascii=False)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Job:
  example: QAExample
  run: int
  seed: int


class SnapshotStore:
  """Per-question JSON files under one run directory; writes are atomic (tmp + rename)."""

  def __init__(self, run_dir: Path) -> None:
    self.run_dir = run_dir

  def path(self, dataset: str, run: int, qid: str) -> Path:
    return self.run_dir / dataset / f"run{run}" / f"{safe_name(qid)}.json"

  def load(self, job: Job) -> dict[str, Any] | None:
    """The finished snapshot of `job`, or None if missing, unreadable or stale."""
    path = self.path(job.example.dataset, job.run, job.example.id)
    try:
      snap = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
      return None
    ok = (
      snap.get("version") == SNAPSHOT_VERSION
      and snap.get("qid") == job.example.id
      and snap.get("question_digest") == question_digest(job.example)
      and snap.get("finish_reason") not in RETRY_FINISH
    )
    return snap if ok else None

  def save(self, snap: dict[str, Any]) -> None:
    path = self.path(snap["dataset"], snap["run"], snap["qid"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(snap, ensure_ascii=False), encoding="utf-8")
    tmp.replace(path)

  def iter_snapshots(self) -> Iterator[dict[str, Any]]:
    for path in sorted(self.run_dir.glob("*/run*/*.json")):
      try:
        yield json.loads(path.read_text(encoding="utf-8"))
      except (OSError, json.JSONDecodeError):
        log.warning("skipping unreadable snapshot %s", path)


def episode_stats(traj: Trajectory) -> dict[str, float]:
  """Per-question numbers the report aggregates."""
  s = traj.stats()
  return {
    "turns": s["num_llm_calls"],
    "tool_calls": s["num_tool_calls"],
    **{name: s.get(f"num_{tag}", 0.0) for tag, name in tool_registry.stat_names().items()},
    "tool_failures": s["num_tool_failures"],
    "output_tokens": s["num_output_tokens"],
    "max_input_tokens": s["max_input_tokens"],
    "time_s": traj.duration_s,
  }


@dataclasses.dataclass
class RunResult:
  """What one `EvalRunner.run` did (the scores are in the snapshots and `report.summarize`)."""

  run_dir: Path
  total: int = 0
  generated: int = 0
  reused: int = 0
  judged: int = 0
  wall_s: float = 0.0


class EvalRunner:
  """Runs every (dataset, run, question) once, resuming from snapshots; see the module doc."""

  def __init__(
    self,
    *,
    config: RunnerConfig,
    agent_factory: AgentFactory,
    identity: Mapping[str, Any],
    sampling: SamplingParams,
    judge: LLMJudge | None = None,
    client: Any = None,
    toolbox: Any = None,
  ) -> None:
    """
    Args:
      agent_factory: a fresh agent per question, given that question's sampling (seeded).
      identity: what determines the results besides sampling and seed (agent name and config,
        model, tools); hashed into the run directory name.
      sampling: temperature / top_p / top_k; the seed is set per question.
      judge: scores predictions with an LLM too (verdicts stored per judge key).
      client / toolbox: only checked for reachability before the run starts.
    """
    self.config = config
    self.agent_factory = agent_factory
    self.sampling = sampling
    self.judge = judge
    self.client = client
    self.toolbox = toolbox
    self.identity = {
      **identity,
      "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p,
                   "top_k": sampling.top_k},
      "seed": config.seed,
      "eval_mode": config.eval_mode,
    }  # fmt: skip
    # A "module:Class" agent names its directory by the class (no ':' or '.' in a path part).
    agent_name = str(identity.get("agent", "agent")).rpartition(":")[2].rpartition(".")[2]
    self.run_dir = Path(config.output_dir) / f"{agent_name}-{config_key(self.identity)}"
    self.store = SnapshotStore(self.run_dir)
    self._running: collections.Counter[str] = collections.Counter()
    self._sums: collections.Counter[str] = collections.Counter()

  def write_config(self) -> None:
    self.run_dir.mkdir(parents=True, exist_ok=True)
    path = self.run_dir / "config.json"
    path.write_text(json.dumps(self.identity, indent=2, sort_keys=True, default=str))

  async def preflight(self) -> None:
    """Fails fast (EndpointUnreachable) when the engine, retrieval or judge server is down."""
    t = self.config.preflight_timeout_s
    try:
      base_url = getattr(self.client, "base_url", None)
    except Exception as e:  # e.g. RemoteGenerationClient cannot read its address file
      raise EndpointUnreachable(f"generation endpoint: {e}") from None
    if isinstance(base_url, str):
      await probe_http(base_url.rstrip("/") + "/health", "generation", t)
    await self._preflight_tools(t)
    if self.judge is not None:
      await self.judge.preflight(t)

  async def _preflight_tools(self, timeout_s: float) -> None:
    cache = getattr(self.toolbox, "cache", None) or getattr(
      getattr(self.toolbox, "inner", None), "cache", None
    )
    if cache is not None and cache.mode is CacheMode.REPLAY_ONLY:
      return  # a replayed run needs no tool server: that is its point
    providers = {id(p): p for p in (getattr(self.toolbox, "search_provider", None),
                                    getattr(self.toolbox, "access_provider", None)) if p}  # fmt: skip
    for provider in providers.values():
      servers = getattr(provider, "servers", None)
      if servers is None:
        continue  # web providers: their own retries and failure accounting apply
      found = servers()
      if not found:
        raise EndpointUnreachable("no retrieval server address configured or announced")
      errors = []
      for server in found:
        url = server if server.startswith("http") else f"http://{server}"
        try:
          await probe_http(url + "/health", "retrieval", timeout_s)
          break
        except EndpointUnreachable as e:
          errors.append(str(e))
      else:
        raise EndpointUnreachable("; ".join(errors))

  def jobs(self, datasets: Mapping[str, Sequence[QAExample]]) -> list[Job]:
    out = []
    for run in range(self.config.num_runs):
      for examples in datasets.values():
        for ex in examples:
          out.append(Job(ex, run, derive_seed(self.config.seed + run, ex.dataset, ex.id)))
    return out

  async def run(self, datasets: Mapping[str, Sequence[QAExample]]) -> RunResult:
    """Computes every missing snapshot. Cancelling it loses only the questions in flight."""
    await self.preflight()
    self.write_config()
    jobs = self.jobs(datasets)
    result = RunResult(run_dir=self.run_dir, total=len(jobs))
    queue: asyncio.Queue[Job] = asyncio.Queue()
    for job in jobs:
      queue.put_nowait(job)
    bar = tqdm(total=len(jobs), disable=not self.config.progress, desc="eval", unit="q",
               dynamic_ncols=True)  # fmt: skip
    t0 = time.perf_counter()

    async def worker() -> None:
      while True:
        try:
          job = queue.get_nowait()
        except asyncio.QueueEmpty:
          return
        snap = await self._one(job, result)
        self._update(snap)
        bar.update(1)
        bar.set_postfix_str(self._postfix(), refresh=False)

    workers = [
      asyncio.create_task(worker()) for _ in range(min(self.config.concurrency, len(jobs)))
    ]
    try:
      await asyncio.gather(*workers)
    finally:
      for w in workers:
        w.cancel()
      await asyncio.gather(*workers, return_exceptions=True)
      bar.close()
      result.wall_s = time.perf_counter() - t0
    return result

  def _update(self, snap: dict[str, Any]) -> None:
    self._running["n"] += 1
    for k, v in snap["scores"].items():
      self._sums[k] += v
    verdict = (snap.get("judge") or {}).get(self.judge.key) if self.judge else None
    if verdict is not None:
      self._sums["judge"] += float(verdict.get("judgement") == "correct")

  def _postfix(self) -> str:
    n = max(self._running["n"], 1)
    parts = [f"EM={self._sums['em'] / n:.3f}", f"F1={self._sums['f1'] / n:.3f}"]
    if self.judge is not None:
      parts.append(f"judge={self._sums['judge'] / n:.3f}")
    return " ".join(parts)

  async def _one(self, job: Job, result: RunResult) -> dict[str, Any]:
    snap = self.store.load(job)
    if snap is None:
      snap = await self._generate(job)
      self.store.save(snap)
      result.generated += 1
    else:
      result.reused += 1
    if self.judge is not None and self._needs_judge(snap):
      ex = job.example
      try:
        async with asyncio.timeout(self.config.question_timeout_s):
          verdict = await self.judge.judge(
            ex.question, ex.answers, snap["pred"], sensitive=ex.sensitive
          )
        snap.setdefault("judge", {})[self.judge.key] = verdict.to_json()
        self.store.save(snap)
        result.judged += 1
      except TimeoutError:
        log.warning("judge timed out for %s/%s", ex.dataset, ex.id)
    return snap

  def _needs_judge(self, snap: dict[str, Any]) -> bool:
    assert self.judge is not None
    verdict = (snap.get("judge") or {}).get(self.judge.key)
    return verdict is None or verdict.get("status") != "success"  # failed ones are retried

  async def _generate(self, job: Job) -> dict[str, Any]:
    ex = job.example
    sampling = dataclasses.replace(self.sampling, seed=job.seed)
    agent = self.agent_factory(sampling)
    errors: list[str] = []
    traj: Trajectory | None = None
    try:
      async with asyncio.timeout(self.config.question_timeout_s):
        traj = await agent.run(ex.question, qid=ex.id, answers=ex.answers)
    except TimeoutError:
      errors.append(f"question exceeded {self.config.question_timeout_s:g} s")
    except Exception as e:  # an agent bug ends this question, recorded, not the whole eval
      log.exception("agent failed on %s/%s", ex.dataset, ex.id)
      errors.append(f"{type(e).__name__}: {e}")
    pred = traj.pred_answer if traj is not None else None
    snap: dict[str, Any] = {
      "version": SNAPSHOT_VERSION,
      "dataset": ex.dataset,
      "qid": ex.id,
      "run": job.run,
      "seed": job.seed,
      "question_digest": question_digest(ex),
      "sensitive": ex.sensitive,
      "question": None if ex.sensitive else ex.question,
      "answers": None if ex.sensitive else list(ex.answers),
      "pred": pred,
      "scores": metrics.all_metrics(pred, ex.answers, eval_mode=self.config.eval_mode),
      "finish_reason": traj.finish_reason if traj is not None else "error",
      "errors": (traj.errors if traj is not None else []) + errors,
      "stats": episode_stats(traj) if traj is not None else {},
      "finished_at": time.time(),
      "judge": {},
    }
    if ex.sensitive:  # tool errors can quote queries, which can quote the question
      snap["errors"] = [e.split(":", 1)[0] for e in snap["errors"]]
    if traj is not None and self.config.save_trajectories and not ex.sensitive:
      snap["trajectory"] = traj.to_json()
    return snap
