"""LLM-as-judge: verdict parsing and its fallbacks, bounded retries, the verdict cache, a scripted
OpenAI-compatible endpoint, and the real serve-model facade over the tiny random policy."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from aiohttp import web

from asearcher_jax.agent import AsearcherAgent
from asearcher_jax.data import load_dataset
from asearcher_jax.evaluation import report
from asearcher_jax.evaluation.judge import (
  EndpointUnreachable,
  JudgeConfig,
  LLMJudge,
  VerdictCache,
  judge_prompt,
  parse_verdict,
  prepare_prediction,
)
from asearcher_jax.evaluation.runner import EvalRunner, RunnerConfig
from asearcher_jax.serving.openai_api import OpenAIServer, OpenAIServerConfig
from asearcher_jax.serving.types import SamplingParams
from asearcher_jax.tools.search import LocalRetrievalConfig
from asearcher_jax.tools.toolbox import make_toolbox
from tests.evaluation.helpers import ActingClient
from tests.evaluation.test_runner_e2e import AGENT
from tests.tools.conftest import LocalApp


def fenced(judgement: str, rationale: str = "same person") -> str:
  return f'Thinking.\n```json\n{{"rationale": "{rationale}", "judgement": "{judgement}"}}\n```'


@pytest.mark.parametrize(
  ("text", "expected"),
  [
    (fenced("Correct"), "correct"),
    (fenced("Incorrect"), "incorrect"),
    # the last ```json block wins
    (fenced("Incorrect") + "\nOn reflection:\n" + fenced("Correct"), "correct"),
    # not JSON but a Python literal (single quotes)
    ("```json\n{'rationale': 'x', 'judgement': 'Correct'}\n```", "correct"),
    # broken JSON: substring fallbacks, as the original
    ('```json\n{"rationale": "unterminated, "judgement": "Incorrect"\n```', "incorrect"),
    ('no block at all but "judgement": "correct" somewhere', "correct"),
    ('"judgement": correct', "correct"),
    # invalid: nothing usable
    ("Correct!", None),
    ('```json\n{"judgement": "maybe"}\n```', None),
    ("", None),
    ("```json\n[1, 2]\n```", None),
  ],
)
def test_parse_verdict_with_fallbacks(text, expected):
  assert parse_verdict(text) == expected


def test_prompt_shape_and_prediction_cut():
  cfg = JudgeConfig(base_url="http://127.0.0.1:1/v1")
  prompt = judge_prompt("Who?", ["Ann", "Anna"], "x" * 2000, cfg)
  assert prompt.startswith("You are an evaluation assistant.")
  assert "Question: Who?" in prompt and "Labeled Answer: Ann OR Anna" in prompt
  assert "Predicted Answer: " + "x" * 500 + "\n" in prompt and '"judgement"' in prompt
  assert prepare_prediction("Paris</answer> and more") == "Paris"


class ScriptedJudge:
  """An OpenAI-compatible chat endpoint answering from a script: a string is a completion, an
  int an HTTP error status."""

  def __init__(self, script: list) -> None:
    self.script = list(script)
    self.bodies: list[dict] = []

  def app(self) -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", self.chat)
    app.router.add_get("/v1/models", self.models)
    return app

  async def models(self, request: web.Request) -> web.Response:
    return web.json_response({"data": []})

  async def chat(self, request: web.Request) -> web.Response:
    self.bodies.append(await request.json())
    item = self.script.pop(0)
    if isinstance(item, int):
      return web.json_response({"error": {"message": "scripted"}}, status=item)
    return web.json_response({"choices": [{"message": {"role": "assistant", "content": item}}]})


async def _judge_with(script, tmp_path, **kw):
  fake = ScriptedJudge(script)
  local = await LocalApp(fake.app()).start()
  cfg = JudgeConfig(base_url=local.url + "/v1", backoff_s=0.01, **kw)
  judge = LLMJudge(cfg, cache=VerdictCache(tmp_path / "verdicts.jsonl"))
  return fake, local, judge


async def test_invalid_verdicts_are_retried_then_marked_failed(tmp_path):
  fake, local, judge = await _judge_with(["gibberish", 500, fenced("Correct")], tmp_path)
  try:
    ok = await asyncio.wait_for(judge.judge("Who?", ["Ann"], "Ann"), 30)
    assert (ok.judgement, ok.status, ok.attempts, ok.mbe) == ("correct", "success", 3, 1.0)
    assert [b["seed"] for b in fake.bodies] == [0, 1, 2]  # each retry samples anew
    assert fake.bodies[0]["temperature"] == 0.6 and fake.bodies[0]["max_tokens"] == 1024

    fake.script += ["still nothing", "no", "nope"]
    bad = await asyncio.wait_for(judge.judge("Who?", ["Ann"], "Bob"), 30)
    assert (bad.judgement, bad.status, bad.attempts, bad.mbe) == (None, "failed", 3, 0.0)
    assert bad.error.startswith("invalid verdict") and len(fake.bodies) == 6  # bounded

    fake.script += [400]
    refused = await asyncio.wait_for(judge.judge("Who?", ["Ann"], "Carl"), 30)
    assert refused.status == "failed" and refused.attempts == 1 and "HTTP 400" in refused.error
  finally:
    await judge.close()
    await local.stop()

  # successful verdicts are cached on disk (failed ones are asked again next time)
  again = LLMJudge(judge.config, cache=VerdictCache(tmp_path / "verdicts.jsonl"))
  cached = await asyncio.wait_for(again.judge("Who?", ["Ann"], "Ann"), 5)
  assert cached.judgement == "correct" and cached.attempts == 0 and again.requests == 0
  empty = await again.judge("Who?", ["Ann"], None)
  assert empty.judgement == "incorrect" and again.requests == 0
  await again.close()


async def test_unreachable_judge_fails_fast():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]  # closed again when the block ends: nobody listens there
  judge = LLMJudge(JudgeConfig(base_url=f"http://127.0.0.1:{port}/v1"))
  t0 = time.perf_counter()
  with pytest.raises(
    EndpointUnreachable, match=f"judge endpoint http://127.0.0.1:{port}/v1/models"
  ):
    await judge.preflight(timeout_s=5)
  assert time.perf_counter() - t0 < 5


@pytest.mark.slow
async def test_judge_against_serve_model_in_an_eval_run(
  tmp_path, tok, make_driver, retrieval_server
):
  """The tiny random policy writes garbage verdicts: each is parsed, found invalid, retried up to
  the bound, then marked failed; the run completes and the summary counts them."""
  driver = make_driver()
  api = OpenAIServer(driver, OpenAIServerConfig(port=0, model_name="tiny"))
  port = await asyncio.wait_for(api.start(), 30)
  judge = LLMJudge(
    JudgeConfig(
      base_url=f"http://127.0.0.1:{port}/v1", model="tiny", max_tokens=12, max_attempts=2
    ),
    cache=VerdictCache(tmp_path / "verdicts.jsonl"),
  )
  data = {"hotpotqa_train100": load_dataset("hotpotqa_train100", limit=3)}
  addr_dir = str(retrieval_server.addr_file.parent)
  try:
    async with make_toolbox(local=LocalRetrievalConfig(addr_dir=addr_dir)) as box:
      client = ActingClient(driver, tok)
      runner = EvalRunner(
        config=RunnerConfig(output_dir=str(tmp_path / "out"), concurrency=3, progress=False),
        agent_factory=lambda s: AsearcherAgent(
          client=client, tokenizer=tok, toolbox=box, config=AGENT, sampling=s
        ),
        identity={"agent": "asearcher", "model": "tiny-random"},
        sampling=SamplingParams(temperature=0.6, top_p=0.95),
        judge=judge,
        client=client,
        toolbox=box,
      )
      result = await asyncio.wait_for(runner.run(data), 180)
  finally:
    await judge.close()
    await api.stop()
  assert result.judged == 3
  assert api.requests["chat"] == judge.requests == 6  # 2 attempts per question, no more
  snaps = [json.loads(p.read_text()) for p in runner.run_dir.glob("*/run0/*.json")]
  verdicts = [s["judge"][judge.key] for s in snaps]
  assert all(v["status"] == "failed" and v["attempts"] == 2 for v in verdicts)
  assert all(v["raw"] and v["error"].startswith("invalid verdict") for v in verdicts)
  d = report.write_report(runner.run_dir)["datasets"]["hotpotqa_train100"]
  assert d["judge_judged"] == 3 and d["judge_failed"] == 3 and d["judge_accuracy"] == 0.0
