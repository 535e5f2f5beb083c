"""The quickstart's world on disk and its tools: SynthWiki data + world tokenizer + BM25 index,
a retrieval server on a background thread, and scripted-expert trajectories for the warm start.

Everything here is a plain function of a seed and a directory, so the quickstart, the warm-start
command and the tests build exactly the same world.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Sequence
from pathlib import Path

from asearcher_jax.agent.asearcher import AsearcherAgent, AsearcherAgentConfig
from asearcher_jax.agent.trajectory import Trajectory
from asearcher_jax.rl import reward
from asearcher_jax.serving.types import SamplingParams
from asearcher_jax.synthwiki.expert import (
  COMPACT_AGENT,
  ExpertConfig,
  SynthWikiExpert,
  write_trajectories,
)
from asearcher_jax.synthwiki.questions import SynthQuestion
from asearcher_jax.synthwiki.tokenizer import build_world_tokenizer, save_world_tokenizer
from asearcher_jax.synthwiki.wiki import SynthWiki, SynthWikiConfig, build_synthwiki
from asearcher_jax.synthwiki.world import World
from asearcher_jax.tokenizer import Tokenizer
from asearcher_jax.tools.retrieval.index import build_index_dir, load_index
from asearcher_jax.tools.retrieval.server import RetrievalServer, RetrievalServerConfig
from asearcher_jax.tools.search import LocalRetrievalConfig
from asearcher_jax.tools.toolbox import ToolBox, make_toolbox


@dataclasses.dataclass(frozen=True)
class WorldFiles:
  """Paths of one prepared world (all under `root`)."""

  root: Path
  corpus: Path
  train: Path
  test: Path
  tokenizer: Path
  index: Path
  digest: str


def prepare_world(
  root: str | Path, config: SynthWikiConfig, *, vocab_size: int = 2048
) -> tuple[SynthWiki, WorldFiles]:
  """Writes corpus, splits, world tokenizer and BM25 index under `root` (idempotent)."""
  root = Path(root)
  sw = build_synthwiki(config)
  paths = sw.write(root)
  tok = build_world_tokenizer(sw.world, sw.tokenizer_questions, vocab_size=vocab_size)
  tok_dir = save_world_tokenizer(tok, root / "tokenizer")
  index = root / "index"
  build_index_dir(corpus=[paths["corpus"]], index_dir=index, show_progress=False)
  files = WorldFiles(
    root=root, corpus=paths["corpus"], train=paths["train"], test=paths["test"],
    tokenizer=tok_dir, index=index, digest=sw.digest(),
  )  # fmt: skip
  return sw, files


class RetrievalThread:
  """The real BM25 retrieval server on 127.0.0.1 (free port), on its own event-loop thread, so
  any number of other loops (rollouts, evaluation) can reach it over HTTP."""

  def __init__(self, index_dir: str | Path, *, addr_dir: str | Path | None = None) -> None:
    self.index_dir = Path(index_dir)
    self.addr_dir = str(addr_dir) if addr_dir else None
    self.port: int | None = None
    self._loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self._loop.run_forever, name="retrieval", daemon=True)
    self._server: RetrievalServer | None = None

  @property
  def address(self) -> str:
    return f"127.0.0.1:{self.port}"

  def __enter__(self) -> RetrievalThread:
    self._thread.start()
    cfg = RetrievalServerConfig(port=0, addr_dir=self.addr_dir)
    self._server = RetrievalServer(load_index(self.index_dir), cfg)
    fut = asyncio.run_coroutine_threadsafe(self._server.start(), self._loop)
    self.port = fut.result(timeout=60)
    return self

  def __exit__(self, *exc: object) -> None:
    if self._server is not None:
      fut = asyncio.run_coroutine_threadsafe(self._server.stop(), self._loop)
      fut.result(timeout=30)
    self._loop.call_soon_threadsafe(self._loop.stop)
    self._thread.join(timeout=30)


def expert_trajectories(
  sw: SynthWiki,
  files: WorldFiles,
  out_path: str | Path,
  *,
  questions: Sequence | None = None,
  samples_per_question: int = 1,
  imperfection: float = 0.15,
  expert: ExpertConfig | None = None,
  agent_config=None,
  concurrency: int = 16,
  seed: int = 0,
) -> dict[str, float]:
  """Runs the scripted expert (real agent, real tools) over `questions` (default: the train
  split) and writes token-exact trajectories as JSONL; returns counts and the expert's accuracy.

  `expert` (an `ExpertConfig`) sets each mistake's probability; None: the one-knob
  `ExpertConfig.imperfect(imperfection)`."""
  qs = list(questions if questions is not None else sw.train)
  tok = Tokenizer.from_dir(files.tokenizer)
  with RetrievalThread(files.index) as server:
    trajs = asyncio.run(
      generate_expert_trajectories(
        sw.world, qs, tokenizer=tok, retrieval_address=server.address,
        n=len(qs) * samples_per_question, expert=expert or ExpertConfig.imperfect(imperfection),
        agent_config=agent_config, concurrency=concurrency, seed=seed,
      )
    )  # fmt: skip
  ok = [t for t in trajs if not t.environment_failure]
  write_trajectories(ok, out_path)
  scores = [t.score or 0.0 for t in ok]
  return {
    "trajectories": float(len(ok)),
    "failed": float(len(trajs) - len(ok)),
    "expert_mean_reward": sum(scores) / max(len(scores), 1),
  }


async def generate_expert_trajectories(
  world: World,
  questions: Sequence[SynthQuestion],
  *,
  tokenizer: Tokenizer,
  toolbox: ToolBox | None = None,
  retrieval_address: str | None = None,
  n: int | None = None,
  expert: ExpertConfig | None = None,
  agent_config: AsearcherAgentConfig | None = None,
  concurrency: int = 8,
  seed: int = 0,
) -> list[Trajectory]:
  """n episodes (default: one per question; more cycle through them with new sampling seeds) of
  the real agent driven by the expert, scored with the RL reward (`Trajectory.score`)."""
  if not questions:
    return []
  own = None
  if toolbox is None:
    if retrieval_address is None:
      raise ValueError("pass a toolbox or the retrieval server's address (host:port)")
    own = toolbox = make_toolbox(local=LocalRetrievalConfig(addresses=(retrieval_address,)))
  client = SynthWikiExpert(world, questions, tokenizer, expert)
  config = agent_config or COMPACT_AGENT
  n = len(questions) if n is None else n
  gate = asyncio.Semaphore(concurrency)

  async def one(i: int) -> Trajectory:
    q = questions[i % len(questions)]
    agent = AsearcherAgent(
      client=client,
      tokenizer=tokenizer,
      toolbox=toolbox,
      config=config,
      sampling=SamplingParams(seed=seed * 1_000_003 + i),
    )
    async with gate:
      traj = await agent.run(q.question, qid=q.id, answers=[q.answer])
    traj.score = reward.trajectory_reward(traj).score
    traj.extra.update(hops=q.hops, kind=q.kind, ops=list(q.ops))
    return traj

  try:
    return list(await asyncio.gather(*(one(i) for i in range(n))))
  finally:
    if own is not None:
      await own.close()
