"""Evaluating the versions a training run publishes, each pinned to one version: `evaluate(watch=)`
loads every chosen version of a weights store into its own engine between two evaluations, and
the versions the engine stamps on each result are checked; a result of another version is
refused by the pinning client."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from flax import nnx

from asearcher_jax.agent.asearcher import AsearcherAgentConfig
from asearcher_jax.apps import evaluate as commands
from asearcher_jax.errors import AsearcherError
from asearcher_jax.evaluation.clients import PinnedVersionClient
from asearcher_jax.evaluation.runner import RunnerConfig
from asearcher_jax.model import presets, transformer
from asearcher_jax.model.loading import PolicyConfig
from asearcher_jax.serving.driver import EngineError
from asearcher_jax.serving.engine import EngineConfig
from asearcher_jax.serving.types import GenerationResult, SamplingParams
from asearcher_jax.serving.weights_dir import WeightStore

TINY = presets.model_config(name="qwen2-tiny", param_dtype="float32", dtype="float32")


class _Stamped:
  """A client whose results carry the versions it is given."""

  def __init__(self, versions: list[int]) -> None:
    self.versions = versions
    self.closed = False

  async def close(self) -> None:
    self.closed = True

  async def generate(self, token_ids, sampling, max_new_tokens, stop=(), stop_token_ids=None):
    n = len(self.versions)
    return GenerationResult(tokens=[1] * n, logprobs=[0.0] * n, versions=self.versions,
                            stop_reason="stop")  # fmt: skip


async def test_pinned_client_refuses_tokens_of_another_version():
  ok = PinnedVersionClient(_Stamped([3, 3, 3]), 3)
  assert (await ok.generate([1], SamplingParams(), 3)).versions == [3, 3, 3]
  assert ok.checked_tokens == 3
  mixed = PinnedVersionClient(_Stamped([3, 4]), 3)
  with pytest.raises(EngineError, match=r"pinned to weights version 3, .* version\(s\) \[4\]"):
    await mixed.generate([1], SamplingParams(), 2)
  await mixed.close()  # the rest of the client is the wrapped one's (a remote session's close)
  assert mixed.inner.closed and mixed.base_url is None


def _publish(root: Path, version: int) -> None:
  model = transformer.Transformer(TINY, rngs=nnx.Rngs(version))
  WeightStore(root).publish(model, version, dtype="float32")


@pytest.mark.slow
async def test_watch_evaluates_each_published_version_pinned_to_it(tmp_path, retrieval_server):
  """Versions 1 and 2 of a store (different weights), evaluated one after the other by one
  engine; each result directory records its version, every generated token carries it."""
  store = tmp_path / "weights"
  for v in (1, 2):
    _publish(store, v)
  out = tmp_path / "eval"
  kwargs = dict(
    data=commands.EvalData(datasets=("hotpotqa_train100",), limit=2),
    agent_config=AsearcherAgentConfig(max_turns=2, max_new_tokens=8, max_tokens=1024,
                                      prompt="eval"),
    generation=commands.Generation(
      policy=PolicyConfig(model=TINY),
      engine=EngineConfig(max_slots=4, max_seq_len=1024, prefill_buckets=(1024,)),
    ),
    runner=RunnerConfig(output_dir=str(out), num_runs=2, progress=False),
    tools=commands.EvalTools(
      retrieval_addr_dir=str(retrieval_server.addr_file.parent), cache="off"
    ),
    watch=commands.VersionWatch(weights_dir=str(store), poll_s=0.5, last_version=2),
  )  # fmt: skip
  rc = await asyncio.wait_for(asyncio.to_thread(commands.evaluate, **kwargs), 600)
  assert rc == 0
  lines = [json.loads(x) for x in (out / "versions.jsonl").read_text().splitlines()]
  assert [x["version"] for x in lines] == [1, 2]
  preds = {}
  for line in lines:
    v, run_dir = line["version"], Path(line["run_dir"])
    assert run_dir.parent == out / f"v{v:08d}"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["weights_version"] == v and config["weights_dir"] == str(store)
    assert line["datasets"]["hotpotqa_train100"]["k"] == 2 and line["checked_tokens"] > 0
    snaps = [json.loads(p.read_text()) for p in run_dir.glob("hotpotqa_train100/run*/*.json")]
    assert len(snaps) == 4
    stamped = {int(t) for s in snaps for c in s["trajectory"]["calls"] for t in c["versions"]}
    assert stamped == {v}  # every generated token of this evaluation came from version v
    preds[v] = [c["output_ids"] for s in sorted(snaps, key=lambda s: (s["qid"], s["run"]))
                for c in s["trajectory"]["calls"]]  # fmt: skip
  assert preds[1] != preds[2]  # two versions, two policies (the same seeds)
  # A restarted watch finds both versions done and evaluates nothing again.
  assert await asyncio.wait_for(asyncio.to_thread(commands.evaluate, **kwargs), 300) == 0
  assert len((out / "versions.jsonl").read_text().splitlines()) == 2
  assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["v00000001", "v00000002"]
  # Nothing new for idle_timeout_s: the watch gives up with status 1.
  idle = dict(kwargs, watch=commands.VersionWatch(weights_dir=str(store), poll_s=0.2,
                                                  idle_timeout_s=0.5))  # fmt: skip
  assert await asyncio.wait_for(asyncio.to_thread(commands.evaluate, **idle), 300) == 1


@pytest.mark.slow
async def test_one_version_of_a_store_is_evaluated_pinned_to_it(tmp_path, retrieval_server):
  """`Generation.weights_version` without a watch: that version in the engine, recorded in the
  configuration (so another version lands in another run directory)."""
  store = tmp_path / "weights"
  _publish(store, 3)
  rc = await asyncio.wait_for(asyncio.to_thread(
    commands.evaluate,
    data=commands.EvalData(datasets=("hotpotqa_train100",), limit=1),
    agent_config=AsearcherAgentConfig(max_turns=1, max_new_tokens=4, max_tokens=1024),
    generation=commands.Generation(
      policy=PolicyConfig(model=TINY), weights_dir=str(store), weights_version=3,
      engine=EngineConfig(max_slots=2, max_seq_len=1024, prefill_buckets=(1024,)),
    ),
    runner=RunnerConfig(output_dir=str(tmp_path / "eval"), progress=False),
    tools=commands.EvalTools(retrieval_addr_dir=str(retrieval_server.addr_file.parent)),
  ), 300)  # fmt: skip
  assert rc == 0
  (config,) = [json.loads(p.read_text()) for p in (tmp_path / "eval").glob("*/config.json")]
  assert config["weights_version"] == 3
  (snap,) = [json.loads(p.read_text()) for p in (tmp_path / "eval").glob("*/*/run0/*.json")]
  assert {t for c in snap["trajectory"]["calls"] for t in c["versions"]} == {3}


def test_weights_version_needs_a_backend_that_stamps_versions():
  with pytest.raises(AsearcherError, match="stamps no versions"):
    commands._generation_client(commands.Generation(
      backend="openai", server_url="http://127.0.0.1:1/v1", weights_version=2))  # fmt: skip
  with pytest.raises(AsearcherError, match="watch loads each version into its own engine"):
    commands.evaluate(
      generation=commands.Generation(backend="remote", server_url="http://127.0.0.1:1"),
      watch=commands.VersionWatch(weights_dir="w"),
    )
  with pytest.raises(AsearcherError, match="every must be >= 1"):
    commands.VersionWatch(weights_dir="w", every=0)
