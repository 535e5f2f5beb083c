"""A local stand-in for the two models an evaluation talks to, over the OpenAI API.

An evaluation recipe's budgets (64 LLM calls, 4,096 tokens a call, a 32k context, k = 4, the
judge) are only exercised by a policy that searches and answers: a random tiny policy never
writes a tag, so on CPU it would only show the decode loop. This server plays both parts for the
questions it is given, so `asearcher eval` with a real recipe runs end to end offline
(gin/overlays/eval_tiny.gin):
  /v1/completions       the policy: finds which known question the prompt holds; with no
                        `<information>` yet it searches for the question, after one it answers,
                        the gold answer with probability `accuracy` (drawn from the request's
                        seed, so a run is repeatable and k seeded runs differ), else a wrong one;
                        a read turn (stop ["</think>"]) says it read the documents. Text stops
                        before the stop string, as an OpenAI server's does. The reasoning agent's
                        single-turn prompts get `<thought>` replies: a search while it may only
                        search, a note on each read turn, an answer once it may answer.
  /v1/chat/completions  the judge: reads ASearcher's judge prompt and answers in its fenced JSON,
                        "Correct" when the normalised prediction equals a labelled answer.
  /v1/models, /health   what the preflight checks ask.

  python -m asearcher_jax.testing.standin_server --port 8011 --datasets bamboogle nq17
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
from collections.abc import Sequence

from aiohttp import web

from asearcher_jax.data.qa import QAExample, load_dataset
from asearcher_jax.evaluation.metrics import normalize_answer

MODEL = "standin"
# What tells the reasoning agent's prompts apart (agent/prompts.py): any of them, a read turn's,
# and an act turn's once answering is allowed.
_REASONING = "Reasoning history:"
_READ = "generate a thought after reading"
_MAY_ANSWER = "3. Answering the question"
_LABELED = re.compile(r"Labeled Answer: (.*?)\n\nPredicted Answer: (.*?)\n\nAre these", re.S)


class StandinServer:
  """The policy and the judge for `examples` (see the module docstring); counts its requests."""

  def __init__(
    self, examples: Sequence[QAExample], *, accuracy: float = 0.5, host: str = "127.0.0.1",
    port: int = 0,
  ) -> None:  # fmt: skip
    self.examples = sorted(examples, key=lambda e: -len(e.question))  # longest match first
    self.accuracy = accuracy
    self.host, self.port = host, port
    self.requests = {"completions": 0, "chat": 0}
    self._runner: web.AppRunner | None = None

  def app(self) -> web.Application:
    app = web.Application()
    app.router.add_get("/health", self._health)
    app.router.add_get("/v1/models", self._models)
    app.router.add_post("/v1/completions", self._completions)
    app.router.add_post("/v1/chat/completions", self._chat)
    return app

  async def start(self) -> int:
    """Serves on host:port (0: a free port); returns the port."""
    self._runner = web.AppRunner(self.app())
    await self._runner.setup()
    site = web.TCPSite(self._runner, self.host, self.port)
    await site.start()
    self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return self.port

  async def stop(self) -> None:
    if self._runner is not None:
      await self._runner.cleanup()
      self._runner = None

  async def _health(self, request: web.Request) -> web.Response:
    return web.json_response({"ok": True})

  async def _models(self, request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

  def _example(self, prompt: str) -> QAExample | None:
    return next((e for e in self.examples if e.question in prompt), None)

  def act(self, prompt: str, stop: Sequence[str], seed: int | None) -> str:
    """The policy's next text for `prompt` (module docstring)."""
    if list(stop) == ["</think>"]:
      return "I read the documents."
    ex = self._example(prompt)
    if ex is None:
      return "<answer>unknown"
    right = random.Random(f"{seed}/{ex.id}").random() < self.accuracy
    answer = ex.answers[0] if right else "not " + ex.answers[0]
    if _REASONING in prompt:  # the reasoning agent: a fresh single-turn prompt each call
      if _READ in prompt:
        return "<thought>I read them.</thought>"
      if _MAY_ANSWER in prompt:
        return f"<thought>The documents say it.</thought>\n<answer>{answer}</answer>"
      return f"<thought>I should look this up.</thought>\n<search>{ex.question}</search>"
    history = prompt.split(ex.question, 1)[-1]
    if "<information>" not in history:
      return f"I should look this up.</think>\n<search>{ex.question}"
    return f"The documents say it.</think>\n<answer>{answer}"

  @staticmethod
  def verdict(prompt: str) -> str:
    """The judge's reply to ASearcher's judge prompt (module docstring)."""
    m = _LABELED.search(prompt)
    labeled, predicted = (m.group(1), m.group(2)) if m else ("", "")
    same = any(normalize_answer(a) == normalize_answer(predicted) for a in labeled.split(" OR "))
    judgement = "Correct" if m and same else "Incorrect"
    body = {"rationale": "normalised strings compared", "judgement": judgement}
    return f"```json\n{json.dumps(body)}\n```"

  async def _completions(self, request: web.Request) -> web.Response:
    body = await request.json()
    self.requests["completions"] += 1
    text = self.act(str(body.get("prompt", "")), body.get("stop") or [], body.get("seed"))
    return web.json_response({
      "object": "text_completion", "model": MODEL,
      "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
    })  # fmt: skip

  async def _chat(self, request: web.Request) -> web.Response:
    body = await request.json()
    self.requests["chat"] += 1
    prompt = str(body["messages"][-1]["content"])
    return web.json_response({
      "object": "chat.completion", "model": MODEL,
      "choices": [{"index": 0, "message": {"role": "assistant", "content": self.verdict(prompt)},
                   "finish_reason": "stop"}],
    })  # fmt: skip


async def _serve(server: StandinServer) -> None:
  port = await server.start()
  print(f"stand-in policy and judge on http://{server.host}:{port}/v1", flush=True)
  try:
    await asyncio.Event().wait()
  finally:
    await server.stop()


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--host", default="127.0.0.1")
  parser.add_argument("--port", type=int, default=8011)
  parser.add_argument("--datasets", nargs="+", default=["bamboogle", "nq17"])
  parser.add_argument("--data_dir", default=None)
  parser.add_argument("--accuracy", type=float, default=0.5)
  a = parser.parse_args(argv)
  examples = [e for d in a.datasets for e in load_dataset(d, data_dir=a.data_dir)]
  server = StandinServer(examples, accuracy=a.accuracy, host=a.host, port=a.port)
  with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how it is stopped
    asyncio.run(_serve(server))


if __name__ == "__main__":
  main()
