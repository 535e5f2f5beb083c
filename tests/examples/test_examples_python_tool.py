"""The examples/ extension: a Python-executor tool and an agent that uses it beside search, written
outside the package and reached only through the registries and `"module:Class"` strings.

Shown: the executor's limits (time, memory, output) hold; a scripted episode searches, runs code
and answers through the real ToolBox, trajectory, views and evaluation report; `asearcher train`
trains the agent two steps on CPU from the gin overlay, and `asearcher eval` evaluates it; no file
under asearcher_jax/ names the example.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gin
import numpy as np
import pytest

from asearcher_jax import main
from asearcher_jax.agent import protocol
from asearcher_jax.agent import registry as agent_registry
from asearcher_jax.agent.trajectory import Trajectory
from asearcher_jax.data.qa import QAExample
from asearcher_jax.evaluation import report
from asearcher_jax.evaluation.runner import EvalRunner, RunnerConfig
from asearcher_jax.rl.replay import GROUPS_LOG, _read_records, decode_group
from asearcher_jax.serving.types import SamplingParams
from asearcher_jax.testing import ScriptedClient
from asearcher_jax.testing.fake_tools import FakeAccess, FakeSearch
from asearcher_jax.tools import registry as tool_registry
from asearcher_jax.tools.cache import CacheConfig, ToolCache
from asearcher_jax.tools.toolbox import ToolBox, ToolCall
from asearcher_jax.views import episode as ev
from asearcher_jax.views import terminal
from asearcher_jax.views.html import turns_html
from examples.python_tool.agent import CodeSearchAgent
from examples.python_tool.tool import PythonTool, PythonToolConfig

REPO = Path(__file__).resolve().parents[2]
AGENT = "examples.python_tool.agent:CodeSearchAgent"
TOOL = "examples.python_tool.tool:PythonTool"


@pytest.fixture(autouse=True)
def fresh_gin():
  gin.clear_config()
  yield
  gin.clear_config()


@pytest.fixture(autouse=True)
def restore_registries():
  """The example's tool and agent are forgotten afterwards (the registries are global, and other
  tests read the lists of tools and agents)."""
  tool_registry.tags()
  tools, agents = dict(tool_registry._TOOLS), dict(agent_registry.AGENTS)
  yield
  tool_registry._TOOLS.clear()
  tool_registry._TOOLS.update(tools)
  agent_registry.AGENTS.clear()
  agent_registry.AGENTS.update(agents)


async def test_examples_python_tool_runs_code_within_its_limits():
  tool = PythonTool(PythonToolConfig(timeout_s=1.0, memory_mb=128, max_output_chars=50))
  ok = await tool.call("print(sum(range(10)))")
  assert ok.found and ok.text == "[exit code 0]\nstdout:\n45"

  t0 = time.perf_counter()
  loop = await tool.call("while True:\n  pass")
  assert not loop.found and "exceeded the time limit of 1 s" in loop.text
  assert time.perf_counter() - t0 < 5  # killed, not waited out

  mem = await tool.call("x = bytearray(512 * 1024 * 1024)")  # 4x the address-space limit
  assert not mem.found and "MemoryError" in mem.text and "[exit code 1]" in mem.text

  err = await PythonTool().call("raise ValueError('boom')")
  assert 'File "<python>", line 1' in err.text and "ValueError: boom" in err.text
  assert "<string>" not in err.text  # the bootstrap frame is not the model's business

  long = await tool.call("print('a' * 500)")
  assert "a" * 50 + "...[451 chars cut]" in long.text and "a" * 51 not in long.text

  # Cancelled from outside (a ToolBox timeout shorter than the tool's): the child is killed too.
  slow = PythonTool(PythonToolConfig(timeout_s=30.0))
  marker = f"python_tool_cancel_{os.getpid()}"
  task = asyncio.create_task(slow.call(f"import time  # {marker}\ntime.sleep(30)"))
  await asyncio.sleep(1.0)
  task.cancel()
  with pytest.raises(asyncio.CancelledError):
    await task
  await asyncio.sleep(0.2)
  ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, timeout=10).stdout
  assert marker not in ps

  isolated = await tool.call("import os; print(os.listdir('.'), 'PYTHONPATH' in os.environ)")
  assert "[] False" in isolated.text  # an empty working directory, no inherited environment


async def test_examples_tool_is_registered_by_entry_point_and_routed_by_the_toolbox():
  assert tool_registry.resolve(TOOL) is PythonTool
  assert tool_registry.get("python") is PythonTool
  assert protocol.action_tags()[-1] == "answer" and "python" in protocol.action_tags()
  parsed = protocol.parse("<think>add</think><python>print(1 + 1)</python>")
  assert parsed.format.ok and parsed.action == protocol.Action("python", "print(1 + 1)")

  async with ToolBox(search=FakeSearch(), access=FakeAccess({}), tools=[PythonTool()]) as box:
    assert box.tags == ("search", "access", "python")
    result = await box.execute(ToolCall("python", "print(2 ** 10)"))
    assert "1024" in result.text and result.text.startswith("<information>\n")
    assert (
      result.stats.found and not result.stats.invalid_call and result.stats.provider == "python"
    )
    empty = await box.execute(ToolCall("python", "   "))
    assert empty.stats.invalid_call and empty.stats.error == "empty python argument"
    assert box.metrics()["tools/python/calls"] == 2.0


def _script(context: str, i: int) -> str:
  """Search, read, run code, read, answer: turns follow from the tool results in the context."""
  shown = context.count("\n</information>")
  if shown > context.count("Read.</think>"):
    return "Read.</think>"
  return (
    ["<search> six times seven </search>", "<python>print(6 * 7)</python>"][shown]
    if (shown < 2)
    else "<answer> 42 </answer>"
  )


async def test_examples_agent_searches_runs_code_and_is_evaluated(tmp_path, tok):
  client = ScriptedClient(tok, _script)
  box = ToolBox(
    search=FakeSearch(), access=FakeAccess({}), tools=[tool_registry.build(TOOL)],
    cache=ToolCache(CacheConfig(mode="off")),
  )  # fmt: skip
  assert agent_registry.resolve(AGENT)[0] is CodeSearchAgent
  factory = agent_registry.agent_factory(AGENT, None, client=client, tokenizer=tok, toolbox=box)
  runner = EvalRunner(
    config=RunnerConfig(output_dir=str(tmp_path), concurrency=2, progress=False),
    agent_factory=factory,
    identity={"agent": AGENT, "tools": ["search", "access", TOOL]},
    sampling=SamplingParams(),
    toolbox=box,
  )
  questions = [
    QAExample(id=f"q{i}", question=f"What is 6 times 7? ({i})", answers=("42",), dataset="arith")
    for i in range(3)
  ]
  data = {"arith": questions}
  async with box:
    result = await asyncio.wait_for(runner.run(data), 120)
  assert result.total == 3

  summary = report.write_report(runner.run_dir)
  d = summary["datasets"]["arith"]
  assert d["em"] == 1.0 and d["mean_python_calls"] == 1.0 and d["mean_searches"] == 1.0
  assert d["mean_tool_calls"] == 2.0
  header = (runner.run_dir / "questions.csv").read_text().splitlines()[0].split(",")
  assert "python_calls" in header

  snap = json.loads(next((runner.run_dir / "arith" / "run0").glob("*.json")).read_text())
  traj = snap["trajectory"]
  assert traj["agent"] == "code_search" and traj["stats"]["num_python"] == 1.0
  (python_event,) = [t for t in traj["tools"] if t["name"] == "python"]
  assert "stdout:\n42" in python_event["text"] and python_event["stats"]["found"]
  # The prompt lists the tools from the ToolBox (tag and description), the executor among them.
  assert f"<python> ... </python>: {PythonTool.description}" in traj["prompt_text"]

  # Views draw the tool's call and its output like the built-in tools'.
  t = Trajectory.from_json(traj)
  blocks = [b for turn in ev.turns(t) for b in turn.blocks]
  kinds = [b.kind for b in blocks]
  assert "python" in kinds and "output" in kinds and "results" in kinds
  assert terminal.block_style("python") == PythonTool.style
  assert terminal.block_style("output") == terminal.RESULT_STYLE
  assert "class='blk python tool'" in turns_html(t)


def _groups(run_dir: Path):
  records, _ = _read_records(run_dir / "replay" / GROUPS_LOG)
  return [decode_group(r) for r in records]


@pytest.mark.slow  # > 10 s: the fast tier stays under 5 minutes
def test_examples_agent_trains_two_steps_from_the_gin_overlay(tmp_path, tok, capsys):
  run_dir = tmp_path / "train"
  params = [
    f'commands.train.run_dir="{run_dir}"',
    "commands.train.max_questions=8",
    "train_config.TrainConfig.train_steps=2",
    "train_config.TrainConfig.batch_timeout_s=120.0",
    "staleness.StalenessConfig.batch_groups=1",
    "staleness.StalenessConfig.max_concurrent=2",
    "rollout.RolloutConfig.group_size=2",
    "rollout.RolloutConfig.episode_timeout_s=60.0",
  ]
  argv = [
    "train", "--gin_file=gin/runs/train.gin", "--gin_file=examples/python_tool/train.gin",
    *(f"--gin_param={p}" for p in params),
  ]  # fmt: skip
  cwd = os.getcwd()
  os.chdir(REPO)  # the gin files' paths are the repository's
  try:
    assert main.main(argv) == 0
  finally:
    os.chdir(cwd)
  summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert summary["agent"] == AGENT and summary["version"] == 2 and summary["groups_trained"] >= 2
  groups = _groups(run_dir)
  assert len(groups) >= 2
  seq = groups[0].trajectories[0][0]
  prompt = tok.decode(np.asarray(seq["tokens"])[np.asarray(seq["loss_mask"]) == 0].tolist())
  assert f"<python> ... </python>: {PythonTool.description}" in prompt
  assert np.asarray(seq["loss_mask"]).sum() > 0  # the policy's own tokens were trained


def _eval(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-m", "asearcher_jax.main", "eval", *args],
    cwd=REPO, capture_output=True, text=True, timeout=300,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )  # fmt: skip


async def test_examples_agent_is_evaluated_by_asearcher_eval(tmp_path, retrieval_server):
  proc = await asyncio.to_thread(
    _eval,
    "--gin_file=gin/runs/eval.gin",
    "--gin_file=examples/python_tool/eval.gin",
    f"--gin_param=runner.RunnerConfig.output_dir='{tmp_path}'",
    f"--gin_param=commands.EvalTools.retrieval_addresses=['127.0.0.1:{retrieval_server.port}']",
    "--gin_param=commands.EvalData.limit=2",
    "--gin_param=runner.RunnerConfig.progress=False",
    "--gin_param=asearcher.AsearcherAgentConfig.max_turns=2",
    "--gin_param=asearcher.AsearcherAgentConfig.max_new_tokens=4",
    "--gin_param=asearcher.AsearcherAgentConfig.max_tokens=1024",
    "--gin_param=engine.EngineConfig.max_slots=2",
    "--gin_param=engine.EngineConfig.max_seq_len=1024",
    "--gin_param=engine.EngineConfig.prefill_buckets=(1024,)",
  )
  assert proc.returncode == 0, proc.stderr
  assert "eval: 2 results (2 computed, 0 resumed, 0 judged)" in proc.stdout
  run_dir = Path(json.loads(proc.stdout.strip().splitlines()[-1])["run_dir"])
  summary = json.loads((run_dir / "summary.json").read_text())
  assert summary["config"]["agent"] == AGENT
  config = json.loads((run_dir / "config.json").read_text())
  assert any(TOOL in x for x in config["tools"]["extra"])
  d = summary["datasets"]["hotpotqa_train100"]
  assert d["n"] == 2 and "mean_python_calls" in d
  snap = json.loads(next((run_dir / "hotpotqa_train100" / "run0").glob("*.json")).read_text())
  assert "<python> ... </python>" in snap["trajectory"]["prompt_text"]


def test_examples_are_named_by_no_file_of_the_package():
  names = ("examples.python_tool", "python_tool", "PythonTool", "CodeSearchAgent")
  hits = [
    f"{p.relative_to(REPO)}: {n}"
    for p in sorted((REPO / "asearcher_jax").rglob("*"))
    if p.is_file() and p.suffix in (".py", ".gin", ".md", ".json", ".txt", ".toml", ".cfg")
    for n in names
    if n in p.read_text(encoding="utf-8", errors="replace")
  ]
  assert not hits
