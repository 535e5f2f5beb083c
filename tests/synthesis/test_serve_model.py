"""Our own `serve-model` facade (a random tiny policy, in process on loopback) as all three roles:
the run completes, every call is logged, the garbage is rejected with counted reasons and
nothing is written. Also the `synth` command itself over the shipped HotpotQA corpus."""

from __future__ import annotations

import asyncio
import json

import pytest

from asearcher_jax.apps.synth import (
  LocalEndpoint,
  SeedSource,
  SynthLimits,
  load_store,
  local_endpoint,
  seeds_from_pages,
  seeds_from_qa,
  synth,
)
from asearcher_jax.model import presets
from asearcher_jax.model.loading import PolicyConfig
from asearcher_jax.serving.engine import EngineConfig
from asearcher_jax.synthesis import LinkGraph, RoleConfig, Roles, Seed, SynthConfig, run_synthesis
from asearcher_jax.synthesis.synthwiki_oracle import synthwiki_oracle, synthwiki_pages
from asearcher_jax.synthwiki.wiki import TINY, build_world
from asearcher_jax.testing import synth_toyworld as W
from tests.synthesis.conftest import run_toy

ENGINE = EngineConfig(max_slots=8, max_seq_len=1024, prefill_buckets=(512,))
CFG = SynthConfig(num_solver_samples=2, max_turns=1, page_chars=600, seed_timeout_s=60)


def _tiny_role(url: str = "local") -> RoleConfig:
  return RoleConfig(base_url=url, max_tokens=12, timeout_s=30.0, max_attempts=2, backoff_s=0.01)


def _rows(path):
  return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
async def test_tiny_policy_as_all_roles_on_the_toy_world(tmp_path):
  model = presets.model_config(name="qwen2-tiny")
  async with (
    asyncio.timeout(240),
    local_endpoint(LocalEndpoint(policy=PolicyConfig(model=model), engine=ENGINE)) as url,
  ):
    r = _tiny_role(url)
    # Two page seeds (the generator must write a base QA) and one seed QA (straight to checks).
    qa = Seed(
      id="qa", question="Which city was Dilan born in?", answer="Brin",
      statement="Dilan was born in Brin.", url=W.url("Dilan"),
    )  # fmt: skip
    seeds = [*seeds_from_pages(W.store(), W.graph(), 2, 0), qa]
    res = await run_toy(url, tmp_path, config=CFG, seeds=seeds, concurrency=3, run_timeout_s=100,
                        roles={"generator": r, "solver": r, "judge": r})  # fmt: skip
    # The same on SynthWiki with its exact oracle.
    world = build_world(TINY)
    store, graph = synthwiki_pages(world)
    sw = await run_synthesis(
      seeds_from_pages(store, graph, 2, 0), store=store, graph=graph,
      output_dir=tmp_path / "sw", config=CFG, roles=Roles(generator=r, solver=r, judge=r),
      oracle=synthwiki_oracle(world), run_timeout_s=100,
    )  # fmt: skip
    # Seed questions from the shipped HotpotQA set go straight to the checks.
    hotpot = load_store(None, None)
    hq = await run_synthesis(
      seeds_from_qa("hotpotqa_train100", hotpot, limit=2), store=hotpot,
      graph=LinkGraph.from_mentions(hotpot), output_dir=tmp_path / "hotpot_qa", config=CFG,
      roles=Roles(generator=r, solver=r, judge=r), run_timeout_s=100,
    )  # fmt: skip
  assert hq.summary["candidates"] == 2 and hq.summary["written"] == 0
  assert all(k.startswith(("quality:", "format:")) for k in hq.summary["rejected"])
  assert "quality" in {c["step"] for c in _rows(tmp_path / "hotpot_qa" / "calls.jsonl")}
  assert sw.summary["candidates"] == 2 and sw.summary["written"] == 0
  assert len(_rows(tmp_path / "sw" / "calls.jsonl")) == sw.summary["calls"] > 0
  s = res.summary
  assert not s["timed_out"] and s["seed_status"] and s["written"] == 0
  assert s["candidates"] == sum(s["rejected"].values()) > 0  # random text never passes
  assert set(s["rejected"]) <= {"base_qa:malformed", "base_qa:empty", "quality:malformed",
                                "quality:empty"}  # fmt: skip
  assert any(k.startswith("quality:") for k in s["rejected"]), s["rejected"]
  calls = _rows(tmp_path / "calls.jsonl")
  assert len(calls) == s["calls"] > 0
  assert {c["step"] for c in calls} == {"base_qa", "quality"}
  assert all(c["prompt"].startswith("Task: ") and c["latency_s"] > 0 for c in calls)
  assert all(c["error"] for c in calls)  # each call's output was unusable, and says why
  assert _rows(tmp_path / "questions.jsonl") == []


@pytest.mark.slow
def test_synth_command_on_hotpotqa_with_local_tiny_policy(tmp_path):
  out = tmp_path / "hotpot"
  code = synth(
    output_dir=str(out), source=SeedSource(num_seeds=2), config=CFG,
    roles=Roles(generator=_tiny_role(), solver=_tiny_role(), judge=_tiny_role()),
    limits=SynthLimits(concurrency=2, run_timeout_s=120), local=LocalEndpoint(engine=ENGINE),
  )  # fmt: skip
  assert code == 0
  summary = json.loads((out / "summary.json").read_text())
  assert summary["candidates"] == 2 and summary["written"] == 0
  progress = _rows(out / "progress.jsonl")
  assert len(progress) == 2 and all(p["history"][0]["reason"] for p in progress)
  calls = _rows(out / "calls.jsonl")
  assert calls and all("wikipedia.org" in c["prompt"] for c in calls)
