"""QA synthesis: grounded, hard, verified questions by fact injection and fuzzing (issue 9).

`run.run_synthesis` is the library entry point (tests, SynthWiki); `apps.synth.synth` is the
`asearcher synth` subcommand. See `loop` for the checks, `oracle` for exact checking against a
procedural world, `links` for the link graph and `prompts` for the versioned prompts.
"""

from asearcher_jax.synthesis.links import LinkGraph, sample_pages
from asearcher_jax.synthesis.llm import Budget, CallFailed, CallLog, LLMRole, RoleConfig, Roles
from asearcher_jax.synthesis.loop import QAState, Seed, Stats, SynthConfig, Synthesizer
from asearcher_jax.synthesis.oracle import (
  Fuzz,
  Oracle,
  OracleQuery,
  OracleVerdict,
  TripleOracle,
  check,
  vague_matches,
)
from asearcher_jax.synthesis.run import RunResult, run_synthesis

__all__ = [
  "Budget", "CallFailed", "CallLog", "Fuzz", "LLMRole", "LinkGraph", "Oracle", "OracleQuery",
  "OracleVerdict", "QAState", "RoleConfig", "Roles", "RunResult", "Seed", "Stats", "SynthConfig",
  "Synthesizer", "TripleOracle", "check", "run_synthesis", "sample_pages", "vague_matches",
]  # fmt: skip
