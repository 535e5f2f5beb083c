"""QA-synthesis throughput: candidates checked per minute at concurrency 1 and 16.

Run with no arguments: `.venv/bin/python benchmarks/synth_throughput.py` (about 30 s on 2 cores).
Setup: the real synthesis loop, client, checks, oracle and output files, over the test suite's toy
world, with every role served by the scripted loopback model (asearcher_jax/testing/synth_scripted.py),
which answers each request after LATENCY_S -- the order of a short completion from a served
model. A "candidate" is one base question or one edit, checked through every stage it reaches
(each takes ~7-10 calls: generation, quality, 4 solver samples in parallel, judge, alternatives).
Seeds are the toy world's pages, repeated under distinct ids so 16 can run at once; the LLM
call rate is reported too.

Second setup: our own serve-model facade with the random qwen2-tiny policy (in process, CPU) as all
three roles, seed questions from the toy world, 16 new tokens per call. Its output never parses,
so each candidate is one quality check of 2 attempts (2 calls) and is rejected: this measures the
plumbing's rate against a real engine, not a capable model's. The last line is one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asearcher_jax.apps.synth import LocalEndpoint, local_endpoint, seeds_from_pages  # noqa: E402
from asearcher_jax.model import presets  # noqa: E402
from asearcher_jax.model.loading import PolicyConfig  # noqa: E402
from asearcher_jax.serving.engine import EngineConfig  # noqa: E402
from asearcher_jax.synthesis import RoleConfig, Roles, Seed, SynthConfig, run_synthesis  # noqa: E402
from asearcher_jax.testing import synth_toyworld as W  # noqa: E402
from asearcher_jax.testing.synth_scripted import ScriptedServer  # noqa: E402

LATENCY_S = 0.05
CONFIG = SynthConfig(num_solver_samples=4, max_turns=4)
SEEDS = {1: 13, 16: 104}  # concurrency -> seeds (the 13 pages, repeated)
TINY_SEEDS = {1: 6, 16: 48}
TINY_ENGINE = EngineConfig(max_slots=16, max_seq_len=512, prefill_buckets=(256,))


async def measure_tiny() -> dict:
  """Candidates/min with the tiny policy as every role, at concurrency 1 and 16."""
  qa = [(s, r, o) for s, r, o in W.FACTS if r == "born_in"]
  out = {}
  model = presets.model_config(name="qwen2-tiny")
  async with local_endpoint(
    LocalEndpoint(policy=PolicyConfig(model=model), engine=TINY_ENGINE)
  ) as url:
    role = RoleConfig(base_url=url, concurrency=64, timeout_s=120.0, max_tokens=16,
                      max_attempts=2, backoff_s=0.0)  # fmt: skip
    config = SynthConfig(num_solver_samples=4, max_turns=1)
    for c, n in {0: 2, **TINY_SEEDS}.items():  # 0: warm-up (compiles), not reported
      seeds = [
        Seed(id=f"{c}-{i}", question=f"Which city was {qa[i % 6][0]} born in?",
             answer=qa[i % 6][2], statement=W.sentence(qa[i % 6]), url=W.url(qa[i % 6][0]))
        for i in range(n)
      ]  # fmt: skip
      with tempfile.TemporaryDirectory() as d:
        res = await run_synthesis(
          seeds, store=W.store(), graph=W.graph(), output_dir=d, config=config,
          roles=Roles(generator=role, solver=role, judge=role), concurrency=max(c, 1), run_timeout_s=600,
        )  # fmt: skip
      s = res.summary
      if c:
        out[c] = {"candidates": s["candidates"], "calls": s["calls"], "elapsed_s": s["elapsed_s"],
                  "candidates_per_min": s["candidates_per_min"]}  # fmt: skip
        print(json.dumps({"tiny_concurrency": c, **out[c]}), flush=True)
  return out


async def measure(concurrency: int, n_seeds: int) -> dict:
  server = ScriptedServer(latency_s=LATENCY_S)
  url = await server.start()
  store, graph = W.store(), W.graph()
  pages = seeds_from_pages(store, graph, 100, 0)
  seeds = [Seed(id=f"{i}-{pages[i % len(pages)].id}", url=pages[i % len(pages)].url)
           for i in range(n_seeds)]  # fmt: skip
  role = RoleConfig(base_url=url, concurrency=64, timeout_s=30.0)
  try:
    with tempfile.TemporaryDirectory() as d:
      res = await run_synthesis(
        seeds, store=store, graph=graph, output_dir=d, config=CONFIG,
        roles=Roles(generator=role, solver=role, judge=role), oracle=W.oracle(), concurrency=concurrency, run_timeout_s=600,
      )  # fmt: skip
  finally:
    await server.stop()
  s = res.summary
  return {
    "concurrency": concurrency, "seeds": n_seeds, "candidates": s["candidates"],
    "accepted": s["accepted"], "calls": s["calls"], "elapsed_s": s["elapsed_s"],
    "candidates_per_min": s["candidates_per_min"],
    "calls_per_s": round(s["calls"] / s["elapsed_s"], 1),
  }  # fmt: skip


def main() -> None:
  logging.basicConfig(level=logging.WARNING)
  results = {}
  for c, n in SEEDS.items():
    r = asyncio.run(measure(c, n))
    print(json.dumps(r), flush=True)
    results[c] = r
  tiny = asyncio.run(measure_tiny())
  print(json.dumps({
    "benchmark": "synth_throughput",
    "backend": f"scripted loopback, {LATENCY_S * 1000:.0f} ms/call",
    "candidates_per_min_c1": results[1]["candidates_per_min"],
    "candidates_per_min_c16": results[16]["candidates_per_min"],
    "calls_per_s_c1": results[1]["calls_per_s"], "calls_per_s_c16": results[16]["calls_per_s"],
    "tiny_policy_cpu_candidates_per_min_c1": tiny[1]["candidates_per_min"],
    "tiny_policy_cpu_candidates_per_min_c16": tiny[16]["candidates_per_min"],
  }))  # fmt: skip


if __name__ == "__main__":
  main()
