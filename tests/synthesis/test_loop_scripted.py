"""End to end over the toy world with a scripted model behind a real loopback HTTP server."""

from __future__ import annotations

import json

from asearcher_jax.data.qa import load_qa_file, load_training_qa
from asearcher_jax.synthesis import OracleQuery, Seed, SynthConfig, check
from asearcher_jax.synthesis.oracle import Fuzz
from asearcher_jax.testing import synth_toyworld as W
from tests.synthesis.conftest import FAST, run_toy


def _rows(path):
  return [json.loads(x) for x in path.read_text().splitlines()]


async def test_accepted_questions_are_true_unique_and_loadable(scripted, tmp_path):
  server = await scripted()
  res = await run_toy(server.url, tmp_path)
  s = res.summary
  assert s["written"] >= 4 and s["accepted"] > s["written"] - 1
  # Every candidate is accounted for: accepted or rejected with one reason.
  assert s["candidates"] == s["accepted"] + sum(s["rejected"].values())
  # Fuzzed decades are ambiguous in this world; the sloppy quality check misses it, the oracle
  # does not -- and the agreement report says so.
  assert s["rejected"].get("oracle_not_unique", 0) > 0
  assert s["rejected"].get("duplicate_fact", 0) > 0
  q = s["oracle_agreement"]["quality"]
  assert q["llm_pass_oracle_fail"] > 0 and q["agree"] > 0 and 0 < q["rate"] < 1

  oracle = W.oracle()
  rows = _rows(tmp_path / "questions.jsonl")
  assert len(rows) == s["written"]
  assert any(len(r["statements"]) > 1 for r in rows)  # injection happened and was accepted
  for r in rows:
    texts = [st["text"] for st in r["statements"]]
    assert all(oracle.statement_true(t) for t in texts), texts
    assert all(st["source"].startswith(W.URL) for st in r["statements"])
    fuzzes = tuple(Fuzz(**f) for f in r["fuzzes"])
    query = OracleQuery(
      question=r["question"], answer=r["answer"], statements=tuple(texts), fuzzes=fuzzes
    )
    verdict = check(oracle, query)
    assert verdict.ok and verdict.answers == (r["answer"],), (r["question"], verdict)
    assert r["difficulty"] <= FAST.max_solver_accuracy
    assert r["verdicts"]["quality"]["unique"] == "yes" and r["verdicts"]["oracle"]["ok"]
    assert r["history"][-1]["accepted"] and r["history"][-1]["question"] == r["question"]
  # The RL and eval loaders read the file as is.
  assert [e.answers[0] for e in load_qa_file(tmp_path / "questions.jsonl")] == [
    r["answer"] for r in rows
  ]
  assert len(load_training_qa(tmp_path / "questions.jsonl")) == len(rows)

  # Every request is in the call log with prompt, output and latency.
  calls = _rows(tmp_path / "calls.jsonl")
  assert len(calls) == s["calls"] == server.requests
  assert {c["role"] for c in calls} == {"generator", "solver", "judge"}
  assert all(c["prompt"] and c["output"] and c["latency_s"] >= 0 for c in calls)
  progress = _rows(tmp_path / "progress.jsonl")
  assert len(progress) == s["seeds"]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["prompts"]["base_qa"] == "base_qa/v1"


async def test_resume_skips_done_seeds_and_dedups(scripted, tmp_path):
  server = await scripted()
  first = await run_toy(server.url, tmp_path, n=6)
  n_rows = len(_rows(tmp_path / "questions.jsonl"))
  requests = server.requests
  again = await run_toy(server.url, tmp_path, n=6)
  assert again.summary["skipped_done"] == 6 and server.requests == requests
  assert len(_rows(tmp_path / "questions.jsonl")) == n_rows == first.summary["written"]
  # New seeds that grow into questions already written are deduplicated, not written twice.
  rows = _rows(tmp_path / "questions.jsonl")
  seeds = [Seed(id=f"again-{i}", url=r["seed"]["url"]) for i, r in enumerate(rows)]
  third = await run_toy(server.url, tmp_path, seeds=seeds)
  assert third.summary["written"] == 0 and third.summary["duplicates"] == len(rows)
  assert len(_rows(tmp_path / "questions.jsonl")) == n_rows


async def test_seed_qa_and_oracle_audit_mode(scripted, tmp_path):
  """Seed questions instead of pages; with the oracle only auditing, the LLM uniqueness checks
  decide, and an ambiguous seed is caught by the quality check."""
  server = await scripted()
  seeds = [
    Seed(id="ok", question="Which city was Dilan born in?", answer="Brin",
         statement="Dilan was born in Brin.", url=W.url("Dilan")),
    Seed(id="ambiguous", question="Which person was born in Brin?", answer="Aldo",
         statement="Aldo was born in Brin.", url=W.url("Aldo")),
  ]  # fmt: skip
  config = SynthConfig(num_solver_samples=2, max_turns=2, oracle_gate=False)
  res = await run_toy(server.url, tmp_path, seeds=seeds, config=config)
  progress = {p["seed_id"]: p for p in _rows(tmp_path / "progress.jsonl")}
  assert progress["ambiguous"]["status"] == "no_base_question"
  assert progress["ambiguous"]["history"][0]["reason"] == "quality:not_unique"
  assert progress["ambiguous"]["history"][0]["verdicts"]["oracle"]["reason"] == "oracle_not_unique"
  assert progress["ok"]["history"][0]["accepted"]
  assert res.summary["oracle_agreement"]["quality"]["agree"] >= 2


async def test_random_policy_and_metric_grader(scripted, tmp_path):
  server = await scripted()
  config = SynthConfig(
    num_solver_samples=3, max_turns=3, action_policy="random", grader="em", check_duplicate=False
  )
  res = await run_toy(server.url, tmp_path, config=config, n=8)
  assert res.summary["written"] > 0
  assert server.model.calls.get("choose_action", 0) == 0 and "judge" not in server.model.calls
