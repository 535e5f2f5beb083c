"""Arbitrary and adversarial generations never raise: every call is a format failure or a valid
action, and the trajectory stays token exact."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asearcher_jax.agent import (
  AsearcherAgent,
  AsearcherAgentConfig,
  ReasoningAgent,
  ReasoningAgentConfig,
  SearchR1Agent,
  protocol,
)
from asearcher_jax.testing import ScriptedClient, assert_token_exact, fake_toolbox
from asearcher_jax.tokenizer import Tokenizer

TOK = Tokenizer.qwen2()
TAGS = ["<search>", "</search>", "<access>", "</access>", "<answer>", "</answer>", "<think>"]
TAGS += ["</think>", "<thought>", "</thought>", "<|im_end|>", "<|endoftext|>", "<|im_start|>"]
TAGS += ["Assistant", "https://ex.org/p", " q ", "中文", "\n"]
texts = st.lists(st.one_of(st.sampled_from(TAGS), st.text(max_size=12)), max_size=30).map("".join)
# Raw ids: byte tokens (invalid UTF-8 on their own), ordinary ids, and the special tokens.
ids = st.lists(
  st.one_of(
    st.integers(0, 255), st.integers(0, 151_642), st.sampled_from([151643, 151644, 151645])
  ),
  max_size=40,
)
outputs = st.lists(st.one_of(texts, ids), min_size=1, max_size=8)


def _check_calls(traj, client):
  for call in traj.calls:
    parsed = protocol.parse(call.text)
    assert call.format_problems or parsed.action is None or parsed.action.kind in protocol.TOOL_TAGS
    if call.action is not None:
      assert call.action.startswith(("<search>", "<access>", "<answer>"))
  assert_token_exact(traj, client.calls)


def _run(agent_cls, script, **config):
  def policy(context, i):
    return script[i] if i < len(script) else "<answer> done </answer>"

  client = ScriptedClient(TOK, policy)
  cfg_cls = {AsearcherAgent: AsearcherAgentConfig, ReasoningAgent: ReasoningAgentConfig}.get(
    agent_cls
  )
  kwargs = {"config": cfg_cls(**config)} if cfg_cls else {}
  agent = agent_cls(
    client=client,
    tokenizer=TOK,
    toolbox=fake_toolbox({"https://ex.org/p": "page " * 100}),
    **kwargs,
  )
  traj = asyncio.run(asyncio.wait_for(agent.run("q?", answers=["done"]), 30))
  assert traj.finish_reason
  return traj, client


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(outputs)
def test_asearcher_agent_never_raises(script):
  traj, client = _run(AsearcherAgent, script, max_turns=12, max_new_tokens=64)
  _check_calls(traj, client)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(outputs)
def test_search_r1_agent_never_raises(script):
  traj, client = _run(SearchR1Agent, script)
  _check_calls(traj, client)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(outputs)
def test_reasoning_agent_never_raises(script):
  traj, client = _run(ReasoningAgent, script, max_turns=10, max_new_tokens=64, max_failures=4)
  assert_token_exact(traj, client.calls)


@pytest.mark.slow
def test_one_megabyte_generation():
  huge = "<search> a <search>" + "xé" * 500_000 + "</search><search>" * 2000
  traj, client = _run(
    AsearcherAgent, [huge], max_turns=3, max_new_tokens=2_000_000, max_tokens=5_000_000
  )
  first = traj.calls[0]
  assert first.output_ids.size > 100_000
  assert first.action is not None and first.action.startswith("<search>")  # ran, format fails
  assert not first.format_ok and not traj.format_ok
  _check_calls(traj, client)


def test_two_tool_calls_execute_one():
  traj, _ = _run(AsearcherAgent, ["<search> a </search><access> https://ex.org/p </access>"])
  assert [t.name for t in traj.tools] == ["search"]  # the act turn stops at </search>
  # a read turn stops only at </think>, so it can hold two calls: one runs, the gate fails
  read = "<access> https://ex.org/p </access> and <search> b </search> ok</think>"
  traj, client = _run(AsearcherAgent, ["<search> a </search>", read])
  assert [(t.name, t.argument) for t in traj.tools] == [("search", "a"), ("search", "b")]
  assert traj.calls[0].format_ok and not traj.calls[1].format_ok and not traj.format_ok
  _check_calls(traj, client)
