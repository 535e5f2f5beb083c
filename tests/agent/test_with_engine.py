"""The agent against the real in-process engine (a tiny random Qwen2 with the full vocabulary):
token exactness, engine logprobs and engine-stamped versions across a weight update."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from flax import nnx

from asearcher_jax.agent import AsearcherAgent, AsearcherAgentConfig
from asearcher_jax.model import transformer
from asearcher_jax.serving.driver import Driver, DriverConfig
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.testing import assert_token_exact, fake_toolbox
from asearcher_jax.testing.recording_client import RecordingClient
from tests.model.test_model import small_cfg


@pytest.mark.slow
async def test_asearcher_agent_on_the_real_engine(tok):
  cfg = small_cfg(vocab_size=tok.vocab_size)
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  engine = Engine.from_model(
    model, tok, EngineConfig(max_slots=2, max_seq_len=512, prefill_buckets=(256, 512))
  )
  driver = Driver(engine, DriverConfig(request_timeout_s=120))
  new_weights = nnx.state(transformer.Transformer(cfg, rngs=nnx.Rngs(1)))

  async def push_after_second_call(i: int) -> None:
    if i == 1:
      await asyncio.wait_for(asyncio.to_thread(driver.update_params, new_weights, 1), 120)

  client = RecordingClient(driver, after_call=push_after_second_call)
  try:
    agent = AsearcherAgent(
      client=client,
      tokenizer=tok,
      toolbox=fake_toolbox(),
      config=AsearcherAgentConfig(max_turns=4, max_new_tokens=8, max_tokens=512),
    )
    traj = await asyncio.wait_for(agent.run("Who wrote it?"), 300)
  finally:
    driver.close()
  # a random model emits no tags: four act turns cut at 8 tokens, continued in one sequence
  assert traj.finish_reason == "turn_limit" and len(traj.calls) == 4
  assert [c.stop_reason for c in traj.calls] == ["length"] * 4
  assert_token_exact(traj, client.calls)
  (seq,) = traj.training_sequences()
  gen = seq["loss_mask"] == 1
  assert seq["versions"][gen].tolist() == [0] * 16 + [1] * 16  # stamped by the engine
  assert np.all(seq["logprobs"][gen] < 0) and np.all(seq["logprobs"][~gen] == 0)
