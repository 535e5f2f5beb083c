"""A synthesis run: seeds in, checked questions out, resumable, deduplicated, fully logged.

Files under `output_dir`:
  questions.jsonl  one accepted hard question per line, in the QA format the RL and eval loaders
                   read (`id`, `question`, `answer`, `answers`), plus statements with sources, the
                   edit history, every check's verdicts and difficulty (= solver accuracy);
  progress.jsonl   one line per finished seed (its status and full edit/verdict history): a
                   re-run skips every seed listed here;
  calls.jsonl      every LLM request (role, step, prompt, output, latency, error);
  summary.json     counts: candidates, accepted, rejections by reason, oracle agreement,
                   calls, tokens, throughput.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asearcher_jax import storage
from asearcher_jax.evaluation.metrics import normalize_answer
from asearcher_jax.synthesis import prompts as P
from asearcher_jax.synthesis.links import LinkGraph
from asearcher_jax.synthesis.llm import Budget, CallLog, LLMRole, Roles
from asearcher_jax.synthesis.loop import Seed, Stats, SynthConfig, Synthesizer
from asearcher_jax.synthesis.oracle import Oracle
from asearcher_jax.tools.retrieval.corpus import PageStore

log = logging.getLogger(__name__)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
  rows = []
  if path.exists():
    for line in storage.jsonl_lines(path.read_text(encoding="utf-8")):
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        continue  # a line cut by a crash: its seed is simply done again
  return rows


class Output:
  """The run's files; `done` and the dedup set are rebuilt from them on start."""

  def __init__(self, output_dir: str | Path) -> None:
    self.dir = Path(output_dir)
    self.dir.mkdir(parents=True, exist_ok=True)
    self.questions = self.dir / "questions.jsonl"
    self.progress = self.dir / "progress.jsonl"
    self.done = {str(r.get("seed_id")) for r in _read_jsonl(self.progress)}
    self.seen = {normalize_answer(r["question"]) for r in _read_jsonl(self.questions)}
    self.written = 0
    self.duplicates = 0

  def finish(self, seed: Seed, trace: dict[str, Any]) -> None:
    """Writes the seed's question (unless a duplicate) and marks the seed done."""
    row = trace["row"]
    if row is not None:
      key = normalize_answer(row["question"])
      if key in self.seen:
        trace["status"] = "duplicate"
        self.duplicates += 1
      else:
        self.seen.add(key)
        self.written += 1
        with self.questions.open("a", encoding="utf-8") as f:
          f.write(json.dumps(row, ensure_ascii=False) + "\n")
    progress = {"seed_id": seed.id, "status": trace["status"], "history": trace["history"]}
    with self.progress.open("a", encoding="utf-8") as f:
      f.write(json.dumps(progress, ensure_ascii=False) + "\n")
    self.done.add(seed.id)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
  """What a run did (also in summary.json)."""

  summary: dict[str, Any]
  output_dir: Path


async def run_synthesis(
  seeds: Sequence[Seed],
  *,
  store: PageStore,
  graph: LinkGraph,
  output_dir: str | Path,
  config: SynthConfig = SynthConfig(),  # noqa: B008 (frozen config)
  roles: Roles,
  concurrency: int = 4,
  budget: Budget | None = None,
  oracle: Oracle | None = None,
  rng_seed: int = 0,
  run_timeout_s: float = 3600.0,
) -> RunResult:
  """Grows every seed not already done in `output_dir`, `concurrency` at a time.

  Roles must have http(s) base URLs here (`apps.synth` resolves "local"). The run ends
  after `run_timeout_s` at the latest; unfinished seeds are not marked done, so a re-run
  continues them."""
  out = Output(output_dir)
  budget = budget or Budget()
  call_log = CallLog(out.dir / "calls.jsonl")
  llms = [LLMRole(name, cfg, log=call_log, budget=budget) for name, cfg in roles.items()]
  stats = Stats()
  synth = Synthesizer(
    config, generator=llms[0], solver=llms[1], judge=llms[2], store=store, graph=graph,
    oracle=oracle, stats=stats,
  )  # fmt: skip
  todo = [s for s in seeds if s.id not in out.done]
  semaphore = asyncio.Semaphore(concurrency)
  statuses: dict[str, int] = {}

  async def one(seed: Seed) -> None:
    async with semaphore:
      if budget.exhausted:
        statuses["skipped_budget"] = statuses.get("skipped_budget", 0) + 1
        return
      trace = await synth.run_seed(seed, rng_seed)
      if trace["status"] == "budget" and trace["row"] is None:
        statuses["budget"] = statuses.get("budget", 0) + 1
        return  # not done: a re-run with more budget does it again
      out.finish(seed, trace)
      statuses[trace["status"]] = statuses.get(trace["status"], 0) + 1

  t0 = time.perf_counter()
  tasks = [asyncio.ensure_future(one(s)) for s in todo]
  timed_out = False
  try:
    async with asyncio.timeout(run_timeout_s):
      await asyncio.gather(*tasks)
  except TimeoutError:
    timed_out = True
  finally:
    for t in tasks:
      t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for r in llms:
      await r.close()
  elapsed = time.perf_counter() - t0
  summary = {
    **stats.to_json(),
    "seeds": len(seeds), "skipped_done": len(seeds) - len(todo), "seed_status": statuses,
    "written": out.written, "duplicates": out.duplicates, "calls": budget.calls,
    "tokens": budget.tokens, "logged_calls": call_log.rows, "elapsed_s": round(elapsed, 3),
    "candidates_per_min": round(stats.candidates / elapsed * 60, 2) if elapsed > 0 else None,
    "timed_out": timed_out, "concurrency": concurrency, "prompts": dict(P.PROMPT_SET),
    "config": dataclasses.asdict(config),
    "roles": {r.name: {"model": r.config.model, "base_url": r.config.base_url} for r in llms},
  }  # fmt: skip
  (out.dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
  log.info(
    "synth: %d candidates, %d accepted, %d written; rejected %s",
    stats.candidates, stats.accepted, out.written, dict(stats.rejected),
  )  # fmt: skip
  return RunResult(summary=summary, output_dir=out.dir)
