from __future__ import annotations

import asyncio

import pytest

from asearcher_jax.apps.synth import seeds_from_pages
from asearcher_jax.synthesis import RoleConfig, Roles, SynthConfig, run_synthesis
from asearcher_jax.testing import synth_toyworld as W
from asearcher_jax.testing.synth_scripted import ScriptedServer

T = 30  # seconds: bound on every await in these tests

FAST = SynthConfig(num_solver_samples=4, max_turns=4, seed_timeout_s=20)


def role(url: str, **kw) -> RoleConfig:
  kw = {"timeout_s": 5.0, "backoff_s": 0.01, **kw}
  return RoleConfig(base_url=url, **kw)


@pytest.fixture
async def scripted():
  servers = []

  async def make(**kw) -> ScriptedServer:
    s = ScriptedServer(**kw)
    await asyncio.wait_for(s.start(), T)
    servers.append(s)
    return s

  yield make
  for s in servers:
    await s.stop()


async def run_toy(url: str, out_dir, *, config=FAST, oracle=True, n=20, roles=None, **kw):
  """A run over the toy world with the scripted model at `url` as every role."""
  store, graph = W.store(), W.graph()
  seeds = kw.pop("seeds", None) or seeds_from_pages(store, graph, n, 0)
  r = roles or {}
  limit = kw.pop("run_timeout_s", T)
  return await asyncio.wait_for(
    run_synthesis(
      seeds, store=store, graph=graph, output_dir=out_dir, config=config,
      roles=Roles(**{k: r.get(k, role(url)) for k in ("generator", "solver", "judge")}), oracle=W.oracle() if oracle else None,
      run_timeout_s=limit, **kw,
    ),
    limit + 5,
  )  # fmt: skip
