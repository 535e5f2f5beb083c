"""The project's own harnesses, beside benchmarks/: not part of asearcher_jax and not installed
(pyproject's package find includes only `asearcher_jax*`); tests/ and benchmarks/ import them
from the repository root, where they run.

  crash_loop      `asearcher train` SIGKILLed at random points, again and again, in one run
  faults          a fault-injecting HTTP proxy, a loop thread for servers, ENOSPC on save
  abuse           misbehaving clients for the HTTP servers (malformed, oversized, slow, floods)
  agent_workload  the benchmarks' steerable agent workload on the real engine, slow tools and
                  a byte-level tokenizer for tiny CPU policies
  soak            asynchronous RL under tool faults and restarts (benchmarks/reliability.py)

What a user needs to test their own agent or tool stays in `asearcher_jax.testing` (test
doubles); what a user needs to check a run is `asearcher audit` (`asearcher_jax.rl.audit`).
The library never imports this package (.importlinter).
"""
