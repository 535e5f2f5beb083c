"""A scripted "capable model" behind a real OpenAI-compatible HTTP server on loopback.

It reads each synthesis prompt (by its `Task:` line and labelled fields) and answers in exactly
the output format the prompt asks for, reasoning over the toy world's fact sentences, so that the
real client, parsers and checks run end to end. It is deliberately imperfect in one way: its
quality check ignores fuzzing (it judges uniqueness on the precise facts), so on some fuzzed
questions it disagrees with the oracle -- which is what the agreement report must show.

`faults` makes a task misbehave: "invalid_json", "empty", "wrong_format", "http500", "bad_body"
(HTTP 200 that is not JSON) or "hang" (answers after `hang_s`).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable

from aiohttp import web

from asearcher_jax.synthesis.oracle import OracleQuery
from asearcher_jax.testing import synth_toyworld as W


def _field(prompt: str, label: str) -> str:
  m = re.search(rf"^{re.escape(label)}: (.*)$", prompt, flags=re.M)
  return m.group(1).strip() if m else ""


def _facts(prompt: str) -> list[str]:
  m = re.search(r"(?:^|\n)(?:Known facts|Facts):\n", prompt)
  block = prompt[m.end() :] if m else ""
  return [line[2:] for line in block.splitlines() if line.startswith("- ")]


_PASSIVE = {
  "born_in": "where {s} was born",
  "member_of": "that {s} is a member of",
  "based_in": "where {s} is based",
}
_ACTIVE = {
  "born_in": "was born in {o}",
  "birth_year": "was born in the year {o}",
  "member_of": "is a member of {o}",
  "based_in": "is based in {o}",
  "founded_year": "was founded in the year {o}",
  "population": "has a population of {o}",
}
_ASK = {
  "born_in": "Which city was {s} born in?",
  "member_of": "Which guild is {s} a member of?",
  "based_in": "Which city is {s} based in?",
}


def describe(fact: tuple[str, str, str], target: str) -> str:
  s, r, o = fact
  if target == o and r in _PASSIVE:
    return f"the {W.TYPES[o]} " + _PASSIVE[r].format(s=s)
  return f"the {W.TYPES[s]} that " + _ACTIVE[r].format(o=o)


def ask(fact: tuple[str, str, str], target: str) -> str:
  s, r, o = fact
  if target == o and r in _ASK:
    return _ASK[r].format(s=s)
  return f"Which {W.TYPES[s]} " + _ACTIVE[r].format(o=o) + "?"


class ScriptedModel:
  """Answers by task; `calls` counts requests per task."""

  def __init__(self, *, solver_right_on_base: bool = True) -> None:
    self.oracle = W.oracle()
    self.solver_right_on_base = solver_right_on_base
    self.calls: dict[str, int] = {}

  def reply(self, prompt: str) -> str:
    task = _field(prompt, "Task") or ("judge" if "Labeled Answer:" in prompt else "")
    self.calls[task] = self.calls.get(task, 0) + 1
    return getattr(self, task, lambda p: "I cannot help with that.")(prompt)

  def base_qa(self, p: str) -> str:
    title = _field(p, "Page title")
    facts = [f for f in W.parse(p) if f[0] == title]
    rel_pref = ["born_in", "founded_year", "population"]
    fact = min(facts, key=lambda f: rel_pref.index(f[1]) if f[1] in rel_pref else 9)
    target = fact[2] if fact[1] in _ASK else fact[0]
    return json.dumps(
      {"question": ask(fact, target), "answer": target, "statement": W.sentence(fact)}
    )

  def choose_action(self, p: str) -> str:
    if "\n- exit:" in p:
      return '{"action": "exit", "reason": "hard enough"}'
    action = "fuzz" if re.search(r"\b\d{3,5}\b", _field(p, "Question")) else "inject"
    return json.dumps({"action": action, "reason": "scripted"})

  def link_fact(self, p: str) -> str:
    target = _field(p, "Target")
    title = _field(p, "Page title")
    page = p.split("Page text:\n", 1)[1].split("\n\nTarget:", 1)[0]
    facts = [f for f in W.parse(page) if target in (f[0], f[2]) and title in (f[0], f[2])]
    if not facts:
      facts = [f for f in W.parse(page) if target in (f[0], f[2])]
    if not facts:  # the page does not mention the target: say something else (off target)
      fact = W.parse(page)[0]
      return json.dumps({"question": ask(fact, fact[2]), "answer": target,
                         "statement": W.sentence(fact)})  # fmt: skip
    fact = facts[0]
    return json.dumps(
      {"question": ask(fact, target), "answer": target, "statement": W.sentence(fact)}
    )

  def duplicate_fact(self, p: str) -> str:
    new = _field(p, "New fact")
    return json.dumps({"duplicate": "yes" if new in _facts(p) else "no"})

  def combine(self, p: str) -> str:
    qa, answer = _field(p, "Question A"), _field(p, "Answer A")
    sub = _field(p, "Answer B")
    (fact,) = W.parse(_field(p, "Fact B"))
    desc = describe(fact, sub)
    if re.search(rf"\b{sub}\b", qa):
      question = re.sub(rf"\b{sub}\b", desc, qa, count=1)
    else:
      question = qa.rstrip("?") + f", being {desc}?"
    return json.dumps({"question": question, "answer": answer})

  def fuzz(self, p: str) -> str:
    q, answer = _field(p, "Question"), _field(p, "Answer")
    m = re.search(r"\b(\d{3,5})\b", q)
    if m is None:  # nothing numeric: blur a name (the oracle cannot evaluate this one)
      names = [n for n in W.TYPES if re.search(rf"\b{n}\b", q)]
      if not names:
        return json.dumps({"question": q, "answer": answer, "original": "", "vague": ""})
      orig, vague = names[0], f"a certain {W.TYPES[names[0]]}"
    else:
      orig = m.group(1)
      v = int(orig)
      vague = f"the {v // 10 * 10}s" if len(orig) == 4 else f"between {v // 2} and {v * 2}"
    return json.dumps({"question": q.replace(orig, vague, 1), "answer": answer,
                       "original": orig, "vague": vague})  # fmt: skip

  def quality_check(self, p: str) -> str:
    q, answer, facts = _field(p, "Question"), _field(p, "Proposed answer"), _facts(p)
    # Sloppy on purpose: a fuzzed number is read as if the precise one were still there.
    numbers = " ".join(re.findall(r"\b\d{3,5}\b", " ".join(facts)))
    query = OracleQuery(question=f"{q} {numbers}", answer=answer, statements=tuple(facts))
    found = self.oracle.answers(query)
    true = all(self.oracle.statement_true(s) for s in facts)
    solvable = true and found is not None and answer in found
    unique = solvable and len(found or ()) == 1
    return json.dumps({
      "single_question": "yes" if q.count("?") == 1 else "no",
      "solvable": "yes" if solvable else "no", "unique": "yes" if unique else "no",
      "reason": "scripted",
    })  # fmt: skip

  def solve(self, p: str) -> str:
    q = _field(p, "Question")
    names = [n for n in W.TYPES if re.search(rf"\b{n}\b", q)]
    # A base question names its entity: the solver "knows" it. Edited ones it gets wrong.
    if self.solver_right_on_base and len(names) == 1 and " the " not in q and "being" not in q:
      answer = self._truth(q)
      if answer:
        return f"Easy. <answer>{answer}</answer>"
    kind = re.match(r"Which (\w+)", q)
    wrong = next((n for n, t in W.TYPES.items() if kind and t == kind.group(1)), "Nobody")
    return f"I guess. <answer>{wrong}</answer>"

  def _truth(self, q: str) -> str | None:
    for s, r, o in W.FACTS:
      if ask((s, r, o), o) == q:
        return o
      if ask((s, r, o), s) == q:
        return s
    return None

  def judge(self, p: str) -> str:
    gold, pred = _field(p, "Labeled Answer"), _field(p, "Predicted Answer")
    verdict = "Correct" if gold.lower() == pred.lower() else "Incorrect"
    return f'```json\n{{"rationale": "scripted", "judgement": "{verdict}"}}\n```'

  def alternative_check(self, p: str) -> str:
    q, cand, facts = _field(p, "Question"), _field(p, "Candidate answer"), _facts(p)
    answer = _field(p, "Reference answer")
    found = self.oracle.answers(OracleQuery(question=q, answer=answer, statements=tuple(facts)))
    return json.dumps({"satisfies_all": "yes" if cand in (found or ()) else "no", "reason": "-"})


class ScriptedServer:
  """aiohttp server speaking /v1/chat/completions and /v1/completions with `model.reply`."""

  def __init__(
    self,
    model: ScriptedModel | None = None,
    *,
    latency_s: float = 0.0,
    faults: dict[str, str] | None = None,
    hang_s: float = 5.0,
  ) -> None:
    self.model = model or ScriptedModel()
    self.latency_s = latency_s
    self.faults = faults or {}
    self.hang_s = hang_s
    self.requests = 0
    self._runner: web.AppRunner | None = None
    self.url = ""

  async def start(self) -> str:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", self._handle(chat=True))
    app.router.add_post("/v1/completions", self._handle(chat=False))
    self._runner = web.AppRunner(app)
    await self._runner.setup()
    site = web.TCPSite(self._runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    self.url = f"http://127.0.0.1:{port}/v1"
    return self.url

  async def stop(self) -> None:
    if self._runner is not None:
      await asyncio.wait_for(self._runner.cleanup(), 10)

  def _handle(self, chat: bool) -> Callable:
    async def handle(request: web.Request) -> web.Response:
      self.requests += 1
      body = await request.json()
      prompt = body["messages"][-1]["content"] if chat else body["prompt"]
      task = _field(prompt, "Task") or "judge"
      fault = self.faults.get(task)
      if self.latency_s:
        await asyncio.sleep(self.latency_s)
      if fault == "hang":
        await asyncio.sleep(self.hang_s)
      if fault == "http500":
        return web.Response(status=500, text="internal error")
      if fault == "bad_body":
        return web.Response(status=200, text="<html>not json</html>")
      text = self.model.reply(prompt)
      if fault == "invalid_json":
        text = '{"question": "Which city was Aldo born in?", "answer": '
      elif fault == "empty":
        text = ""
      elif fault == "wrong_format":
        text = json.dumps({"q": "Which city?", "a": "Brin"})
      choice = {"index": 0, "finish_reason": "stop"}
      if chat:
        choice["message"] = {"role": "assistant", "content": text}
      else:
        choice["text"] = text
      usage = {"prompt_tokens": len(prompt) // 4, "completion_tokens": len(text) // 4}
      usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
      return web.json_response({"object": "chat.completion", "choices": [choice], "usage": usage})

    return handle


async def toy_synthesis(out_dir: str, *, seeds: int = 12, timeout_s: float = 60.0) -> dict:
  """A small synthesis run, offline: the toy world, this scripted model as every role behind a
  loopback server, the triple oracle. For notebooks and tests that need a real synthesis output
  directory without an LLM; returns the run's summary."""
  import hashlib

  from asearcher_jax.synthesis import RoleConfig, Roles, SynthConfig, run_synthesis
  from asearcher_jax.synthesis.links import sample_pages
  from asearcher_jax.synthesis.loop import Seed

  server = ScriptedServer()
  await asyncio.wait_for(server.start(), timeout_s)
  try:
    store, graph = W.store(), W.graph()
    urls = sample_pages(store, graph, seeds, seed=0, min_degree=1)
    role = RoleConfig(base_url=server.url, timeout_s=5.0, backoff_s=0.01)
    result = await asyncio.wait_for(
      run_synthesis(
        [Seed(id="p" + hashlib.sha256(u.encode()).hexdigest()[:12], url=u) for u in urls],
        store=store, graph=graph, output_dir=out_dir, roles=Roles(generator=role, solver=role, judge=role),
        config=SynthConfig(num_solver_samples=4, max_turns=4, seed_timeout_s=20),
        oracle=W.oracle(), run_timeout_s=timeout_s,
      ),
      timeout_s + 5,
    )  # fmt: skip
    return result.summary
  finally:
    await server.stop()
