"""`asearcher serve-model` as a user runs it: a subprocess announcing itself in an address file,
serving the OpenAI facade and JetStream gRPC, and shutting down cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from asearcher_jax.model.loading import PolicyConfig
from asearcher_jax.serving.client import RemoteClientConfig, RemoteGenerationClient
from asearcher_jax.serving.jetstream import import_core
from asearcher_jax.serving.types import SamplingParams

REPO = Path(__file__).resolve().parents[2]
T = 60
SMALL_ENGINE = (
  "--gin_param=engine.EngineConfig.max_slots=2",
  "--gin_param=engine.EngineConfig.max_seq_len=64",
  "--gin_param=engine.EngineConfig.prefill_buckets=(16, 32)",
)


def _start(*gin_params: str) -> subprocess.Popen:
  return subprocess.Popen(
    [sys.executable, "-m", "asearcher_jax.main", "serve-model", *SMALL_ENGINE, *gin_params],
    cwd=REPO,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> dict:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline and proc.poll() is None:
    if path.exists():
      return json.loads(path.read_text())
    time.sleep(0.1)
  proc.kill()
  raise AssertionError(f"no address file in {timeout} s:\n{proc.communicate(timeout=T)[0]}")


@pytest.mark.slow
async def test_serve_model_serves_http_and_grpc_then_stops_on_sigterm(tmp_path, tokenizer):
  addr = tmp_path / "policy.addr"
  proc = _start(
    "--gin_param=openai_api.OpenAIServerConfig.port=0",
    f"--gin_param=serve_model.serve.address_file='{addr}'",
    "--gin_param=serve_model.serve.grpc_port=0",
  )
  try:
    info = await asyncio.to_thread(_wait_for, addr, proc)
    assert info["http"].startswith("127.0.0.1:") and info["grpc"].startswith("127.0.0.1:")
    assert info["pid"] == proc.pid
    config = RemoteClientConfig(timeout_s=T, retries=1, backoff_s=0.1)
    async with RemoteGenerationClient(address_file=addr, config=config) as client:
      prompt = tokenizer.encode_chat([{"role": "user", "content": "Hello"}])
      res = await asyncio.wait_for(
        client.generate(prompt, SamplingParams(temperature=0.0), 6, stop_token_ids=()), T
      )
      assert len(res.tokens) == 6 and res.versions == [0] * 6 and res.stop_reason == "length"
      with pytest.raises(ValueError, match="does not fit"):
        await asyncio.wait_for(client.generate([1] * 100, SamplingParams(), 2), T)
      health = await asyncio.wait_for(client.health(), T)
      assert health["status"] == "ok" and health["driver"]["requests_done"] >= 1

    core = import_core()
    pb2 = core.jetstream_pb2
    async with grpc.aio.insecure_channel(info["grpc"]) as channel:
      stub = core.jetstream_pb2_grpc.OrchestratorStub(channel)
      request = pb2.DecodeRequest(
        max_tokens=6, token_content=pb2.DecodeRequest.TokenContent(token_ids=prompt)
      )
      ids = []
      async for response in stub.Decode(request, timeout=T):
        ids.extend(response.stream_content.samples[0].token_ids)
      assert ids == res.tokens  # greedy: the gRPC path matches the facade's driver
  finally:
    proc.send_signal(signal.SIGTERM)
    try:
      out, _ = await asyncio.to_thread(proc.communicate, timeout=T)
    except subprocess.TimeoutExpired:
      proc.kill()
      out, _ = proc.communicate(timeout=T)
      raise AssertionError(f"serve-model did not exit on SIGTERM:\n{out}") from None
  assert proc.returncode == 0, out
  assert "serve-model: OpenAI API on http://127.0.0.1:" in out and "serve-model: stopped" in out
  assert not addr.exists()  # removed at shutdown
  assert "Traceback" not in out


def test_serve_model_bad_checkpoint_is_a_one_line_error(tmp_path):
  proc = subprocess.run(
    [
      sys.executable, "-m", "asearcher_jax.main", "serve-model",
      f"--gin_param=loading.PolicyConfig.model_dir='{tmp_path / 'nope'}'",
      "--gin_param=serve_model.serve.serve_seconds=1",
    ],
    cwd=REPO, capture_output=True, text=True, timeout=T,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )  # fmt: skip
  assert proc.returncode == 1, proc.stderr
  assert "asearcher serve-model: error:" in proc.stderr and "Traceback" not in proc.stderr


def test_serve_model_on_more_chips_than_visible_is_a_one_line_error():
  proc = subprocess.run(
    [sys.executable, "-m", "asearcher_jax.main", "serve-model", *SMALL_ENGINE,
     "--gin_param=mesh.ServingMeshConfig.tensor=16", "--gin_param=serve_model.serve.serve_seconds=1"],
    cwd=REPO, capture_output=True, text=True, timeout=T,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )  # fmt: skip
  assert proc.returncode == 1, proc.stderr
  assert "ServingMeshConfig.tensor=16 needs 16 devices, 8 are visible" in proc.stderr
  assert "Traceback" not in proc.stderr


def test_serve_model_on_a_taken_port_is_a_one_line_error():
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    proc = subprocess.run(
      [sys.executable, "-m", "asearcher_jax.main", "serve-model", *SMALL_ENGINE,
       f"--gin_param=openai_api.OpenAIServerConfig.port={port}", "--gin_param=serve_model.serve.serve_seconds=1"],
      cwd=REPO, capture_output=True, text=True, timeout=T,
      env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
  assert proc.returncode == 1, proc.stderr
  assert f"cannot listen on 127.0.0.1:{port}: address already in use" in proc.stderr
  assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("tensor", [4])  # one device: tests/rl/test_train_remote.py
async def test_serve_model_loads_each_version_a_trainer_publishes(tmp_path, tokenizer, tensor):
  """Disaggregated RL: the server compiles before announcing itself, then swaps in every newer
  version written to weights_dir; tokens carry the version and come from the new weights. With
  tensor = 4 each version lands in the engine's shardings over 4 of the 8 fake devices."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from asearcher_jax.model import presets, transformer
  from asearcher_jax.rl.weight_sync import DirectoryWeightPublisher
  from tests.serving.test_driver_correctness import greedy_reference

  addr, weights = tmp_path / "policy.addr", tmp_path / "weights"
  proc = _start(
    f"--gin_param=serve_model.serve.address_file='{addr}'",
    f"--gin_param=serve_model.serve.weights_dir='{weights}'",
    "--gin_param=serve_model.serve.weights_poll_s=0.1",
    "--gin_param=serve_model.serve.warmup_modes=('greedy',)",
    f"--gin_param=mesh.ServingMeshConfig.tensor={tensor}",
  )
  try:
    await asyncio.to_thread(_wait_for, addr, proc, 300)
    config = RemoteClientConfig(timeout_s=T, retries=1, backoff_s=0.1)
    cfg = presets.model_config(name="qwen2-tiny")
    prompt = tokenizer.encode_chat([{"role": "user", "content": "Hello"}])
    greedy = SamplingParams(temperature=0.0)
    async with RemoteGenerationClient(address_file=addr, config=config) as client:
      before = await asyncio.wait_for(client.generate(prompt, greedy, 6, stop_token_ids=()), T)
      assert before.versions == [0] * 6
      assert before.tokens == greedy_reference(
        transformer.Transformer(cfg, rngs=nnx.Rngs(0)), prompt, 6
      )

      trained = transformer.Transformer(cfg, rngs=nnx.Rngs(7))  # stands in for new weights
      graphdef, params = nnx.split(trained)
      DirectoryWeightPublisher(weights, graphdef).write(params, 3)
      deadline = time.monotonic() + T
      while (await asyncio.wait_for(client.health(), T))["version"] != 3:
        assert time.monotonic() < deadline, "the server never loaded version 3"
        await asyncio.sleep(0.1)
      after = await asyncio.wait_for(client.generate(prompt, greedy, 6, stop_token_ids=()), T)
      assert after.versions == [3] * 6
      assert (await asyncio.wait_for(client.health(), T))["mesh"]["tensor"] == tensor
      # The store holds bf16 (the publisher's default); the float32 server runs those values.
      rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype), params)
      assert after.tokens == greedy_reference(nnx.merge(graphdef, rounded), prompt, 6)
  finally:
    proc.send_signal(signal.SIGTERM)
    out, _ = await asyncio.to_thread(proc.communicate, timeout=T)
  assert proc.returncode == 0, out
  assert "Traceback" not in out


def test_serve_model_refuses_bad_new_options_before_loading_anything():
  from asearcher_jax.apps import serve_model as commands
  from asearcher_jax.errors import AsearcherError

  with pytest.raises(AsearcherError, match="cannot pin to cores"):
    commands.serve(cpus=(10_000,), serve_seconds=0.1)
  with pytest.raises(AsearcherError, match="unknown warmup_modes"):
    commands.serve(warmup_modes=("fast",), serve_seconds=0.1)
  with pytest.raises(AsearcherError, match="weights_poll_s"):
    commands.serve(weights_poll_s=0, serve_seconds=0.1)


def test_pin_cpus_narrows_and_widens_again():
  """The benchmark pins its trainer to the cores the engine does not use and restores the
  full set afterwards; widening back must not be mistaken for asking for forbidden cores."""
  import os

  from asearcher_jax.apps import serve_model as commands
  from asearcher_jax.errors import AsearcherError

  before = os.sched_getaffinity(0)
  if len(before) < 2:
    pytest.skip("needs two usable cores")
  one = {max(before)}
  try:
    commands.pin_cpus(one)
    assert os.sched_getaffinity(0) == one
    commands.pin_cpus(before)
    assert os.sched_getaffinity(0) == before
    with pytest.raises(AsearcherError, match="cannot pin to cores"):
      commands.pin_cpus(before | {10_000})
    assert os.sched_getaffinity(0) == before  # a refused pin leaves the mask as it was
  finally:
    os.sched_setaffinity(0, before)


def test_serve_model_refuses_to_serve_its_init_when_the_published_weights_are_unreadable(
  tmp_path,
):
  """A LATEST pointer to a missing or torn version: a clear error at start, not a server that
  answers with its own init under a version that is not its weights."""
  from asearcher_jax.apps import serve_model as commands
  from asearcher_jax.errors import AsearcherError
  from asearcher_jax.model.config import ModelConfig

  weights = tmp_path / "weights"
  weights.mkdir()
  (weights / "LATEST").write_text(json.dumps({"version": 3, "path": "v00000003", "time": 1.0}))
  tiny = ModelConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_layers=1,
                     num_heads=2, num_kv_heads=1, max_position_embeddings=64)  # fmt: skip
  addr = tmp_path / "addr.json"
  with pytest.raises(AsearcherError, match="cannot load the published weights"):
    commands.serve(
      policy=PolicyConfig(model=tiny),
      weights_dir=str(weights),
      address_file=str(addr),
      serve_seconds=5,
    )
  assert not addr.exists()  # never announced


# A float32 qwen3-tiny whose KV heads (4) and untied output head split over tensor = 4.
TP_GIN = """
from __gin__ import dynamic_registration
from asearcher_jax.model import loading
from asearcher_jax.model import presets

include 'gin/runs/serve_model.gin'

loading.PolicyConfig.model = @presets.model_config()
presets.model_config.name = "qwen3-tiny"
presets.model_config.num_kv_heads = 4
presets.model_config.tie_word_embeddings = False
presets.model_config.param_dtype = "float32"
presets.model_config.dtype = "float32"
"""


@pytest.mark.slow
async def test_serve_model_on_a_tensor_parallel_mesh_serves_what_one_device_does(tmp_path):
  """`serve-model` with engine.mesh.tensor = 4 (of 8 fake devices) and with tensor = 1, asked the
  same greedy completions over HTTP: same tokens, logprobs within 1e-4."""
  gin_file = tmp_path / "tp.gin"
  gin_file.write_text(TP_GIN)
  procs, addrs = {}, {}
  for t in (1, 4):
    addrs[t] = tmp_path / f"tensor{t}.addr"
    procs[t] = _start(
      f"--gin_file={gin_file}",
      f"--gin_param=mesh.ServingMeshConfig.tensor={t}",
      "--gin_param=engine.EngineConfig.max_slots=4",
      "--gin_param=openai_api.OpenAIServerConfig.port=0",
      f"--gin_param=serve_model.serve.address_file='{addrs[t]}'",
    )
  body = {
    "prompt": ["The capital of France is", "Search for the answer", [1, 2, 3, 4, 5, 6]],
    "max_tokens": 10, "temperature": 0.0, "logprobs": 0,
  }  # fmt: skip
  config = RemoteClientConfig(timeout_s=T, retries=1, backoff_s=0.1)
  answers, health = {}, {}
  try:
    for t in (1, 4):
      await asyncio.to_thread(_wait_for, addrs[t], procs[t], 300)
      async with RemoteGenerationClient(address_file=addrs[t], config=config) as client:
        answers[t] = await asyncio.wait_for(client.post("/v1/completions", body), T)
        health[t] = await asyncio.wait_for(client.health(), T)
  finally:
    outs = {}
    for t, proc in procs.items():
      proc.send_signal(signal.SIGTERM)
      outs[t], _ = await asyncio.to_thread(proc.communicate, timeout=T)
  assert all(p.returncode == 0 for p in procs.values()), outs
  # The model's 4 KV heads: all on one device, one a device over four.
  assert health[1]["mesh"] == {"tensor": 1, "devices": [0], "kv_heads_per_chip": 4}
  assert health[4]["mesh"] == {"tensor": 4, "devices": [0, 1, 2, 3], "kv_heads_per_chip": 1}
  assert "on 4 cpu device(s) (tensor=4)" in outs[4]
  one, four = answers[1]["choices"], answers[4]["choices"]
  assert len(one) == len(four) == 3
  for a, b in zip(one, four, strict=True):
    assert len(a["asearcher"]["token_ids"]) == 10
    assert b["asearcher"]["token_ids"] == a["asearcher"]["token_ids"]
    assert b["text"] == a["text"]
    got, want = b["logprobs"]["token_logprobs"], a["logprobs"]["token_logprobs"]
    assert max(abs(x - y) for x, y in zip(got, want, strict=True)) <= 1e-4, (got, want)
  assert len({tok for c in one for tok in c["asearcher"]["token_ids"]}) > 3  # not degenerate
