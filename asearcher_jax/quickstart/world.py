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
from typing import TYPE_CHECKING

from asearcher_jax.data.synthwiki import SynthWiki, SynthWikiConfig, build_synthwiki
from asearcher_jax.data.synthwiki_tokenizer import build_world_tokenizer, save_world_tokenizer
from asearcher_jax.tools.retrieval.index import build_index_dir, load_index
from asearcher_jax.tools.retrieval.server import RetrievalServer, RetrievalServerConfig

if TYPE_CHECKING:
  from asearcher_jax.data.synthwiki_expert import ExpertConfig


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
  tok = build_world_tokenizer(sw.world, sw.questions, vocab_size=vocab_size)
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
  from asearcher_jax.data.synthwiki_expert import (
    ExpertConfig,
    generate_expert_trajectories,
    write_trajectories,
  )
  from asearcher_jax.tokenizer import Tokenizer

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
