"""`asearcher eval` as a user runs it: the gin default config, resume on re-run, one-line errors
for bad input, and fail-fast on unreachable endpoints."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asearcher_jax.evaluation.judge import EndpointUnreachable
from asearcher_jax.evaluation.runner import EvalRunner, RunnerConfig
from asearcher_jax.serving.client import RemoteGenerationClient
from asearcher_jax.serving.types import SamplingParams
from asearcher_jax.tools.search import LocalRetrievalConfig
from asearcher_jax.tools.toolbox import make_toolbox

REPO = Path(__file__).resolve().parents[2]
T = 120


def _eval(*gin_params: str, timeout: float = T) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-m", "asearcher_jax.main", "eval", *gin_params],
    cwd=REPO, capture_output=True, text=True, timeout=timeout,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )  # fmt: skip


def _closed_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]  # nobody listens there once the socket is closed


@pytest.mark.slow
def test_bad_dataset_file_is_a_one_line_error_naming_the_line(tmp_path):
  bad = tmp_path / "mine.jsonl"
  bad.write_text(
    '{"id": 1, "question": "Q", "answer": "A"}\n{"id": 1, "question": "Q2", "answer": "B"}\n'
  )
  proc = _eval(f"--gin_param=commands.EvalData.datasets=['{bad}']")
  assert proc.returncode == 1, proc.stderr
  (line,) = [x for x in proc.stderr.splitlines() if x.startswith("asearcher eval: error:")]
  assert f"{bad}:2: duplicate id '1' (first on line 1)" in line
  assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_unreachable_generation_endpoint_fails_fast_from_the_cli(tmp_path):
  port = _closed_port()
  t0 = time.perf_counter()
  proc = _eval(
    "--gin_param=commands.Generation.backend='remote'",
    f"--gin_param=commands.Generation.server_url='http://127.0.0.1:{port}'",
    f"--gin_param=runner.RunnerConfig.output_dir='{tmp_path}'",
  )
  assert proc.returncode == 1, proc.stderr
  assert f"generation endpoint http://127.0.0.1:{port}/health is unreachable" in proc.stderr
  assert "Traceback" not in proc.stderr and time.perf_counter() - t0 < 60
  assert not list(tmp_path.iterdir())  # nothing was started or written


async def test_unreachable_retrieval_server_fails_fast(tmp_path):
  port = _closed_port()
  runner_kw = dict(
    config=RunnerConfig(output_dir=str(tmp_path), progress=False, preflight_timeout_s=5),
    agent_factory=lambda s: None, identity={"agent": "x"}, sampling=SamplingParams(),
  )  # fmt: skip
  async with make_toolbox(local=LocalRetrievalConfig(addresses=(f"127.0.0.1:{port}",))) as box:
    t0 = time.perf_counter()
    with pytest.raises(EndpointUnreachable, match=f"retrieval endpoint http://127.0.0.1:{port}"):
      await EvalRunner(toolbox=box, **runner_kw).run({})
    assert time.perf_counter() - t0 < 5
  async with make_toolbox(local=LocalRetrievalConfig(addr_dir=str(tmp_path / "empty"))) as box:
    with pytest.raises(EndpointUnreachable, match="no retrieval server"):
      await EvalRunner(toolbox=box, **runner_kw).run({})
  missing = RemoteGenerationClient(address_file=tmp_path / "nope.addr")
  with pytest.raises(EndpointUnreachable, match="cannot read server address"):
    await EvalRunner(client=missing, **runner_kw).run({})
  assert not list(tmp_path.glob("x-*"))


@pytest.mark.slow
async def test_eval_command_runs_resumes_and_compares(tmp_path, retrieval_server):
  """The default gin file, shrunk: 3 questions of the shipped HotpotQA-100, the in-process tiny
  policy and the real retrieval server; a second identical command reuses every result."""
  port = retrieval_server.port
  params = (
    f"--gin_param=runner.RunnerConfig.output_dir='{tmp_path}'",
    f"--gin_param=commands.EvalTools.retrieval_addresses=['127.0.0.1:{port}']",
    "--gin_param=commands.EvalData.limit=3",
    "--gin_param=runner.RunnerConfig.num_runs=2",
    "--gin_param=runner.RunnerConfig.progress=False",
    "--gin_param=asearcher.AsearcherAgentConfig.max_turns=2",
    "--gin_param=asearcher.AsearcherAgentConfig.max_new_tokens=4",
    "--gin_param=engine.EngineConfig.max_slots=4",
    "--gin_param=engine.EngineConfig.max_seq_len=1024",
    "--gin_param=engine.EngineConfig.prefill_buckets=(1024,)",
    "--gin_param=asearcher.AsearcherAgentConfig.max_tokens=1024",
  )
  first = await asyncio.to_thread(_eval, *params)
  assert first.returncode == 0, first.stderr
  assert "eval: 6 results (6 computed, 0 resumed, 0 judged)" in first.stdout
  assert "| hotpotqa_train100 | 3 | 2 |" in first.stdout and "| Average" in first.stdout
  run_dir = Path(json.loads(first.stdout.strip().splitlines()[-1])["run_dir"])
  summary = json.loads((run_dir / "summary.json").read_text())
  assert summary["datasets"]["hotpotqa_train100"]["k"] == 2
  assert summary["config"]["agent"] == "asearcher" and summary["config"]["generation"] == "engine"

  second = await asyncio.to_thread(_eval, *params)
  assert second.returncode == 0, second.stderr
  assert "eval: 6 results (0 computed, 6 resumed, 0 judged)" in second.stdout

  cmp = await asyncio.to_thread(
    _eval, f"--gin_param=commands.evaluate.compare=['{run_dir}', '{run_dir}']"
  )
  assert cmp.returncode == 0, cmp.stderr
  assert "B - A" in cmp.stdout and "hotpotqa_train100" in cmp.stdout


@pytest.mark.slow
async def test_eval_command_killed_with_sigkill_resumes_without_recomputing(
  tmp_path, retrieval_server
):
  """`kill -9` the eval process once some questions are done; the rerun computes only the rest."""
  params = [
    f"--gin_param=runner.RunnerConfig.output_dir='{tmp_path}'",
    f"--gin_param=commands.EvalTools.retrieval_addresses=['127.0.0.1:{retrieval_server.port}']",
    "--gin_param=commands.EvalData.limit=10",
    "--gin_param=runner.RunnerConfig.num_runs=1",
    "--gin_param=runner.RunnerConfig.progress=False",
    "--gin_param=asearcher.AsearcherAgentConfig.max_turns=4",
    "--gin_param=asearcher.AsearcherAgentConfig.max_new_tokens=8",
    "--gin_param=engine.EngineConfig.max_slots=2",
    "--gin_param=engine.EngineConfig.max_seq_len=1024",
    "--gin_param=engine.EngineConfig.prefill_buckets=(1024,)",
    "--gin_param=asearcher.AsearcherAgentConfig.max_tokens=1024",
  ]
  proc = subprocess.Popen(
    [sys.executable, "-m", "asearcher_jax.main", "eval", *params],
    cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )  # fmt: skip
  try:
    deadline = time.monotonic() + T
    while len(list(tmp_path.glob("*/*/run*/*.json"))) < 2:
      assert proc.poll() is None, "eval finished before it could be killed"
      assert time.monotonic() < deadline, "no snapshot appeared"
      await asyncio.sleep(0.05)
  finally:
    proc.kill()  # SIGKILL: no cleanup runs
    proc.wait(30)
  done_before = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*/*/run*/*.json")}
  assert 2 <= len(done_before) < 10
  rerun = await asyncio.to_thread(_eval, *params)
  assert rerun.returncode == 0, rerun.stderr
  computed = 10 - len(done_before)
  assert f"eval: 10 results ({computed} computed, {len(done_before)} resumed" in rerun.stdout
  after = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*/*/run*/*.json")}
  assert len(after) == 10 and all(after[n] == t for n, t in done_before.items())
