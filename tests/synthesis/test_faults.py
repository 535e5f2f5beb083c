"""Bad endpoints and bad model output: retried, counted with the right reason, never written,
never hanging."""

from __future__ import annotations

import json
import time

import pytest

from asearcher_jax.synthesis import Budget, SynthConfig
from asearcher_jax.synthesis.prompts import parse_json, parse_yes_no
from tests.synthesis.conftest import role, run_toy

CFG = SynthConfig(num_solver_samples=2, max_turns=2, seed_timeout_s=20)


def _calls(path):
  return [json.loads(x) for x in (path / "calls.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
  ("task", "fault", "reason"),
  [
    ("base_qa", "invalid_json", "base_qa:malformed"),
    ("base_qa", "wrong_format", "base_qa:malformed"),
    ("base_qa", "empty", "base_qa:empty"),
    ("base_qa", "bad_body", "base_qa:bad_response"),
    ("quality_check", "http500", "quality:http_500"),
    ("quality_check", "empty", "quality:empty"),
    ("solve", "http500", "solve:http_500"),
    ("judge", "hang", "judge:timeout"),
    ("alternative_check", "invalid_json", "alternative:malformed"),
  ],
)
async def test_fault_is_retried_then_counted(scripted, tmp_path, task, fault, reason):
  server = await scripted(faults={task: fault}, hang_s=1.0)
  roles = {k: role(server.url, timeout_s=0.3, max_attempts=2) for k in ("generator", "solver")}
  roles["judge"] = role(server.url, timeout_s=0.3, max_attempts=2)
  t0 = time.perf_counter()
  res = await run_toy(server.url, tmp_path, config=CFG, n=3, roles=roles, concurrency=3)
  assert time.perf_counter() - t0 < 20
  s = res.summary
  assert s["rejected"].get(reason, 0) > 0, s["rejected"]
  assert not s["timed_out"]
  failed = [c for c in _calls(tmp_path) if c["error"]]
  assert failed and all(c["error"].startswith(reason.split(":")[1]) for c in failed)
  # Each failed call used every attempt: attempt numbers 0 and 1 both appear.
  assert {c["attempt"] for c in failed} == {0, 1}
  # Nothing that failed a check is written: every written question passed all of them.
  rows = [json.loads(x) for x in (tmp_path / "questions.jsonl").read_text().splitlines()] if (
    tmp_path / "questions.jsonl").exists() else []  # fmt: skip
  if task in ("base_qa", "quality_check", "solve"):
    assert rows == [] and s["accepted"] == 0
  for r in rows:  # judge / alternative faults: only questions that never needed them pass
    assert r["verdicts"]["quality"] and r["verdicts"]["oracle"]["ok"]


async def test_unreachable_endpoint_and_budget(scripted, tmp_path):
  dead = role("http://127.0.0.1:9/v1", max_attempts=2, timeout_s=1.0)
  server = await scripted()
  res = await run_toy(server.url, tmp_path / "dead", config=CFG, n=2,
                      roles={"generator": dead})  # fmt: skip
  assert res.summary["rejected"] == {"base_qa:unreachable": 2}
  res = await run_toy(server.url, tmp_path / "budget", config=CFG, n=6, budget=Budget(max_calls=10))
  assert res.summary["calls"] <= 10 + 4  # in-flight calls of concurrent seeds may finish
  status = res.summary["seed_status"]
  assert status.get("budget", 0) + status.get("skipped_budget", 0) > 0
  # Seeds the budget cut short are not marked done: a re-run with budget left does them.
  done = {json.loads(x)["seed_id"] for x in (tmp_path / "budget" / "progress.jsonl").read_text(
    ).splitlines()} if (tmp_path / "budget" / "progress.jsonl").exists() else set()  # fmt: skip
  assert len(done) < 6
  again = await run_toy(server.url, tmp_path / "budget", config=CFG, n=6)
  assert again.summary["skipped_done"] == len(done)
  lines = (tmp_path / "budget" / "progress.jsonl").read_text().splitlines()
  assert len({json.loads(x)["seed_id"] for x in lines}) == len(lines) == 6


def test_parsers():
  assert parse_json('noise {"a": "x"} then ```json\n{"a": "y", "b": "z"}\n```', ["a"])["a"] == "y"
  assert parse_json('{"a": 1} {"a": "last"}', ["a"])["a"] == "last"
  for bad in ("", "no json", '{"a": ""}', '{"b": "x"}', '{"a": "x"'):
    with pytest.raises(ValueError):
      parse_json(bad, ["a"])
  assert parse_yes_no('{"duplicate": "Yes."}', "duplicate") is True
  assert parse_yes_no('{"duplicate": false}', "duplicate") is False
  with pytest.raises(ValueError):
    parse_yes_no('{"duplicate": "maybe"}', "duplicate")
