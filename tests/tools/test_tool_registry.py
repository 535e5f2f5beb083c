"""Tools and agents by name: registration, `"module:Class"` entry points, one-line errors, and
every reader of tool names (protocol, toolbox, views, trajectory, evaluation) asking the registry
instead of keeping its own list."""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path
from typing import ClassVar

import pytest

from asearcher_jax.agent import protocol
from asearcher_jax.agent import registry as agent_registry
from asearcher_jax.agent.asearcher import AsearcherAgent, AsearcherAgentConfig
from asearcher_jax.agent.trajectory import ToolEvent, Trajectory
from asearcher_jax.errors import AsearcherError
from asearcher_jax.evaluation.runner import episode_stats
from asearcher_jax.testing.fake_tools import FakeAccess, FakeSearch
from asearcher_jax.tools import registry
from asearcher_jax.tools.base import InvalidArgument, Tool, ToolOutput
from asearcher_jax.tools.builtin import AccessTool, SearchTool
from asearcher_jax.tools.toolbox import ToolBox, ToolCall
from asearcher_jax.views import episode as ev

PACKAGE = Path(__file__).resolve().parents[2] / "asearcher_jax"


class Echo(Tool):
  tag: ClassVar[str] = "echo_reg"
  description: ClassVar[str] = "repeats its argument"

  async def call(self, argument: str) -> str | ToolOutput:
    if argument == "bad":
      raise InvalidArgument("echo_reg: 'bad' is not echoed")
    if argument == "down":
      raise ConnectionError("echo service down")
    return argument.upper()


@pytest.fixture(autouse=True)
def restore_registries():
  """Tools and agents registered here are forgotten afterwards (the registries are global)."""
  registry.tags()  # the built-ins, registered before the snapshot
  tools, agents = dict(registry._TOOLS), dict(agent_registry.AGENTS)
  yield
  registry._TOOLS.clear()
  registry._TOOLS.update(tools)
  agent_registry.AGENTS.clear()
  agent_registry.AGENTS.update(agents)


@pytest.fixture
def user_module(monkeypatch):
  """A module outside the package holding a tool and an agent, as a user's file would."""
  mod = types.ModuleType("user_ext_reg")

  class Calc(Tool):
    tag: ClassVar[str] = "calc_reg"
    description: ClassVar[str] = "an arithmetic expression"

    async def call(self, argument: str) -> str:
      return str(sum(int(x) for x in argument.split("+")))

  class MyAgent(AsearcherAgent):
    name = "my_agent"

  class NotATool:
    pass

  mod.Calc, mod.MyAgent, mod.NotATool = Calc, MyAgent, NotATool
  monkeypatch.setitem(sys.modules, "user_ext_reg", mod)
  return mod


def test_builtins_register_themselves_first():
  assert registry.tags()[:2] == ("search", "access")
  assert registry.resolve("search") is SearchTool and registry.get("access") is AccessTool
  assert protocol.action_tags()[:2] == ("search", "access")
  assert protocol.action_tags()[-1] == "answer"
  assert protocol.act_stops(("search", "answer")) == ("</search>", "</answer>")


def test_entry_point_resolution_registers_the_tool_for_every_reader(user_module):
  cls = registry.resolve("user_ext_reg:Calc")
  assert cls is user_module.Calc and registry.get("calc_reg") is cls
  assert "calc_reg" in protocol.action_tags() and "</calc_reg>" in protocol.act_stops()
  assert registry.stat_names()["calc_reg"] == "calc_reg_calls"
  parsed = protocol.parse("<think>x</think>\n<calc_reg>2+3</calc_reg>")
  assert parsed.format.ok and parsed.action == protocol.Action("calc_reg", "2+3")
  two = protocol.parse("<calc_reg>1</calc_reg><search>q</search>")
  assert not two.format.ok  # one action per generation counts registered tools too

  traj = Trajectory(agent="a", question="q")
  traj.tools = [ToolEvent(after_call=0, name="calc_reg", argument="1+1", text="")]
  stats = traj.stats()
  assert stats["num_calc_reg"] == 1.0 and stats["num_search"] == 0.0
  assert stats["num_tool_calls"] == 1.0
  assert episode_stats(traj)["calc_reg_calls"] == 1.0
  event = ToolEvent(after_call=0, name="calc_reg", argument="1+1", text="<information>2")
  assert ev._tool_block(event).kind == cls.result_label


@pytest.mark.parametrize(
  ("spec", "message"),
  [
    ("nope", "tool must be one of"),
    ("no_such_module_reg:X", "cannot import no_such_module_reg"),
    ("user_ext_reg:Missing", "user_ext_reg has no Missing"),
    ("user_ext_reg:NotATool", "NotATool is not a subclass of Tool"),
    ("user_ext_reg:", "expected a registered name or 'module:Class'"),
  ],
)
def test_bad_tool_names_are_one_line_errors(user_module, spec, message):
  with pytest.raises(AsearcherError, match=message) as e:
    registry.resolve(spec)
  assert "\n" not in str(e.value)


def test_a_taken_name_or_the_answer_tag_is_refused(user_module):
  with pytest.raises(AsearcherError, match="already registered"):
    registry.register("search", user_module.Calc)

  class Answer(Tool):
    tag: ClassVar[str] = "answer"

  with pytest.raises(AsearcherError, match="the protocol's own tag"):
    registry.register("answer_tool", Answer)


async def test_the_toolbox_attributes_a_user_tools_failures():
  async with ToolBox(search=FakeSearch(), access=FakeAccess({}), tools=[Echo()]) as box:
    ok = await box.execute(ToolCall("echo_reg", " hi "))
    assert "HI" in ok.text and ok.stats.found and ok.stats.provider == "echo_reg"
    bad = await box.execute(ToolCall("echo_reg", "bad"))  # the policy's mistake
    assert bad.stats.invalid_call and not bad.stats.environment_failure
    down = await box.execute(ToolCall("echo_reg", "down"))  # the environment's
    assert down.stats.environment_failure and "ConnectionError" in down.stats.error
    unknown = await box.execute(ToolCall("python_not_here", "x"))
    assert unknown.stats.invalid_call and unknown.stats.error.startswith("unknown tool")
    metrics = box.metrics()
  assert metrics["tools/echo_reg/calls"] == 3.0 and metrics["tools/other/calls"] == 1.0


def test_agents_resolve_by_entry_point_with_their_config_class(user_module):
  cls, config = agent_registry.resolve("user_ext_reg:MyAgent")
  assert cls is user_module.MyAgent and isinstance(config, AsearcherAgentConfig)
  assert agent_registry.resolve("search-r1")[0].name == "search_r1"  # old spellings still work
  with pytest.raises(AsearcherError, match="takes a AsearcherAgentConfig"):
    agent_registry.resolve("user_ext_reg:MyAgent", object())
  with pytest.raises(AsearcherError, match="is not a subclass of Agent"):
    agent_registry.resolve("user_ext_reg:NotATool")


# Where tool names used to be listed by hand; they must read the registry now.
REGISTRY_READERS = (
  "agent/protocol.py",
  "agent/trajectory.py",
  "tools/toolbox.py",
  "views",
  "evaluation",
)


def test_no_hard_coded_tool_list_in_the_readers_of_tool_names():
  """No string literal (docstrings aside) in those modules is a built-in tool's tag."""
  files = [
    f
    for part in REGISTRY_READERS
    for f in ((PACKAGE / part).rglob("*.py") if (PACKAGE / part).is_dir() else [PACKAGE / part])
  ]
  hits = []
  for f in files:
    tree = ast.parse(f.read_text(encoding="utf-8"))
    docstrings = {
      id(node.body[0].value)
      for node in ast.walk(tree)
      if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
      and node.body
      and isinstance(node.body[0], ast.Expr)
      and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
      if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and any(f"{tag}" == node.value.strip("<>/") for tag in ("search", "access"))
      ):
        hits.append(f"{f.relative_to(PACKAGE)}:{node.lineno}: {node.value!r}")
  assert len(files) >= 10 and not hits
