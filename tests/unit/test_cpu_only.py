"""Which subcommands join the multi-process JAX program: only the ones that run on an
accelerator. A retrieval server, an index build, a plan, an export or a look at a run's files
started on a TPU worker (trainer worker 0 hosts the retrieval server) must neither wait for the
slice's peers nor open a chip the trainer owns; `main.CPU_ONLY` says which, in one place."""

from __future__ import annotations

import pytest

from asearcher_jax import compile_cache, distributed, main

# Subcommands that need no accelerator: their files, indexes and HTTP are CPU work.
NO_ACCELERATOR = {"serve-retrieval", "index", "plan", "inspect", "audit", "export"}


def test_the_cpu_only_subcommands_are_subcommands():
  assert NO_ACCELERATOR <= main.CPU_ONLY <= set(main.SUBCOMMANDS)


# `compile` has its own argv and environment handling (tpu_env.for_ahead_of_time).
@pytest.mark.parametrize("subcommand", sorted(set(main.SUBCOMMANDS) - {"compile"}))
def test_only_accelerator_subcommands_join_the_cluster(monkeypatch, subcommand):
  calls = []
  monkeypatch.setattr(main, "configure", lambda *a: lambda **kw: 0)  # the subcommand: a no-op
  monkeypatch.setattr(main, "cpu_only", lambda: calls.append("cpu"))
  monkeypatch.setattr(distributed, "initialize", lambda cfg: calls.append("join"))
  monkeypatch.setattr(compile_cache, "enable", lambda cfg: None)
  assert main.main([subcommand]) == 0
  assert calls == (["cpu"] if subcommand in main.CPU_ONLY else ["join"])
