"""The synthesis loop of one seed: a base QA, then injection / fuzzing edits, each one checked.

ASearcher's loop (spec §5), with its bugs left out: every candidate question (the base one and each
edit) goes through `checks.Checker`; a candidate failing any check is discarded with one counted
reason and the last good question is kept. A failed call (endpoint down, timeout, unparseable
output after all attempts) is a failed check like any other: nothing unchecked is ever accepted.
Difficulty does not reject an edit -- a base question is meant to be easy -- it decides which
accepted questions are hard enough to write out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import re
from typing import Any

from asearcher_jax.synthesis import prompts as P
from asearcher_jax.synthesis.checks import Checker
from asearcher_jax.synthesis.core import (
  QAState,
  Reject,
  Seed,
  Stats,
  SynthConfig,
  grounding,
  norm,
)
from asearcher_jax.synthesis.links import LinkGraph
from asearcher_jax.synthesis.llm import CallFailed, LLMRole
from asearcher_jax.synthesis.oracle import Fuzz, Oracle
from asearcher_jax.tools.retrieval.corpus import PageStore

log = logging.getLogger(__name__)

__all__ = ["QAState", "Reject", "Seed", "Stats", "SynthConfig", "Synthesizer"]


class Synthesizer:
  """Grows questions from seeds with three roles, a page store and a link graph."""

  def __init__(
    self,
    config: SynthConfig,
    *,
    generator: LLMRole,
    solver: LLMRole,
    judge: LLMRole,
    store: PageStore,
    graph: LinkGraph,
    oracle: Oracle | None = None,
    stats: Stats | None = None,
  ) -> None:
    self.config = config
    self.generator, self.solver, self.judge = generator, solver, judge
    self.store, self.graph, self.oracle = store, graph, oracle
    self.stats = stats or Stats()
    self.checker = Checker(
      config, generator=generator, solver=solver, judge=judge, oracle=oracle, stats=self.stats
    )

  # ---- one seed ---------------------------------------------------------------------------

  async def run_seed(self, seed: Seed, rng_seed: int = 0) -> dict[str, Any]:
    """The seed's trace: `{"seed", "status", "history", "row"}`; `row` is the hard question to
    write (None when none was reached). Never raises for model or endpoint trouble."""
    trace: dict[str, Any] = {"seed": dataclasses.asdict(seed), "history": [], "row": None}
    try:
      async with asyncio.timeout(self.config.seed_timeout_s):
        await self._grow(seed, random.Random(f"{rng_seed}:{seed.id}"), trace)
    except TimeoutError:
      self.stats.events["seed_timeout"] += 1
      trace["status"] = "seed_timeout"
    except Exception as e:  # a bug must cost one seed, loudly, not the whole run
      log.exception("synth: seed %s failed", seed.id)
      self.stats.events["seed_error"] += 1
      trace["status"] = f"error: {type(e).__name__}: {e}"[:300]
    trace.setdefault("status", "written" if trace["row"] else "no_hard_question")
    return trace

  async def _grow(self, seed: Seed, rng: random.Random, trace: dict[str, Any]) -> None:
    history = trace["history"]
    state, hard = None, None
    try:
      base = await self._base(seed)
    except Reject as r:
      self._reject(history, 0, "base", r)
      trace["status"] = "budget" if r.reason.endswith(":budget") else "no_base_question"
      return
    ok = await self._try(history, 0, "base", base, seed.id)
    if ok is None:
      budget = history[-1]["reason"].endswith(":budget")
      trace["status"] = "budget" if budget else "no_base_question"
      return
    state = base
    if ok:  # written even if the seed later times out: it passed every check
      hard = trace["row"] = self._row(seed, state, history[-1], history)
    for turn in range(1, self.config.max_turns + 1):
      if self.generator.budget.exhausted:
        trace["status"] = "budget"
        break
      action = await self._choose(state, hard is not None, rng, seed.id)
      if action == "exit":
        break
      try:
        cand = await (
          self._inject(state, rng, seed.id) if action == "inject" else self._fuzz(state, seed.id)
        )
      except Reject as r:
        self._reject(history, turn, action, r)
        continue
      ok = await self._try(history, turn, action, cand, seed.id)
      if ok is not None:
        state = cand
        if ok:
          hard = trace["row"] = self._row(seed, state, history[-1], history)

  def _reject(self, history: list, turn: int, action: str, r: Reject, **extra: Any) -> None:
    self.stats.candidates += 1
    self.stats.rejected[r.reason] += 1
    history.append({
      "turn": turn, "action": action, "accepted": False, "reason": r.reason,
      "verdicts": r.verdicts, **extra,
    })  # fmt: skip

  async def _try(
    self, history: list, turn: int, action: str, cand: QAState, seed_id: str
  ) -> bool | None:
    """Checks `cand`: None if rejected (recorded), else whether it is hard."""
    try:
      verdicts = await self.checker.validate(cand, seed_id)
    except Reject as r:
      self._reject(history, turn, action, r, question=cand.question)
      return None
    self.stats.candidates += 1
    self.stats.accepted += 1
    history.append({
      "turn": turn, "action": action, "accepted": True, "question": cand.question,
      "answer": cand.answer, "difficulty": verdicts["difficulty"]["accuracy"],
      "verdicts": verdicts,
    })  # fmt: skip
    return verdicts["difficulty"]["hard"]

  def _row(self, seed: Seed, state: QAState, entry: dict[str, Any], history: list) -> dict:
    v = entry["verdicts"]
    return {
      "id": f"synth-{seed.id}", "question": state.question, "answer": state.answer,
      "answers": [state.answer, *state.aliases], "aliases": list(state.aliases),
      "statements": list(state.statements),
      "relevant": list(state.relevant), "fuzzes": [dataclasses.asdict(f) for f in state.fuzzes],
      "difficulty": v["difficulty"]["accuracy"], "verdicts": v,
      "history": [h for h in history if h["turn"] <= entry["turn"]],
      "seed": dataclasses.asdict(seed), "prompts": dict(P.PROMPT_SET),
    }  # fmt: skip

  # ---- edits ------------------------------------------------------------------------------

  def _page(self, url: str) -> dict[str, str]:
    page = self.store.get(url)
    if page is None:
      raise Reject("page_missing")
    return page

  def _title(self, page: dict[str, str]) -> str:
    return page.get("title") or page["contents"].split("\n", 1)[0].strip().strip('"')

  async def _gen(self, step: str, keys: list[str], seed_id: str, **fields: Any) -> dict:
    try:
      return await self.generator.ask(
        P.render(step, **fields), lambda t: P.parse_json(t, keys), step=step, seed_id=seed_id
      )
    except CallFailed as e:
      raise Reject(f"{step}:{e.reason}") from None

  def _grounded(self, statement: str, page: dict[str, str]) -> None:
    g = self.config.min_grounding
    if g and grounding(statement, page["contents"]) < g:
      raise Reject("ungrounded_statement")

  async def _base(self, seed: Seed) -> QAState:
    if seed.question:
      statement = seed.statement or f"{seed.question} {seed.answer}."
      relevant = (seed.url,) if seed.url else ()
      return QAState(
        question=seed.question, answer=seed.answer, aliases=seed.aliases,
        statements=({"text": statement, "source": seed.source or seed.url},), relevant=relevant,
      )  # fmt: skip
    page = self._page(seed.url)
    out = await self._gen(
      "base_qa", ["question", "answer", "statement"], seed.id, title=self._title(page),
      url=page["url"], text=page["contents"][: self.config.page_chars],
    )  # fmt: skip
    self._grounded(out["statement"], page)
    return QAState(
      question=out["question"], answer=out["answer"],
      statements=({"text": out["statement"], "source": page["url"]},), relevant=(page["url"],),
    )  # fmt: skip

  async def _choose(self, state: QAState, ready: bool, rng: random.Random, seed_id: str) -> str:
    names = ["inject", "fuzz"]
    rng.shuffle(names)
    if self.config.action_policy == "random":
      return "exit" if ready else names[0]
    if ready:
      names.append("exit")
    fields = dict(
      question=state.question, answer=state.answer, names=", ".join(names),
      statements=P.format_statements([s["text"] for s in state.statements]),
      options="\n".join(f"- {P.ACTION_HELP[n]}" for n in names),
    )  # fmt: skip
    try:
      out = await self._gen("choose_action", ["action"], seed_id, **fields)
    except Reject as r:
      self.stats.events[r.reason] += 1  # not a candidate: fall back to a random edit
      return names[0] if names[0] != "exit" else names[1]
    action = out["action"].strip().lower()
    if action not in names:
      self.stats.events["choose_action:invalid"] += 1
      return names[0] if names[0] != "exit" else names[1]
    return action

  async def _inject(self, state: QAState, rng: random.Random, seed_id: str) -> QAState:
    """A fact from a page linked to one of the question's pages, merged in as a condition."""
    visited = set(state.relevant)
    options = []
    for url in state.relevant:
      options += [(url, n) for n in self.graph.neighbours(url) if n not in visited]
    options = [(u, n) for u, n in options if self.store.get(n) is not None]
    if not options:
      raise Reject("no_unvisited_neighbour")
    target_url, url = rng.choice(options)
    target_page, page = self._page(target_url), self._page(url)
    # The sub-answer: the answer itself when the neighbour's page names it, else the target page.
    target = state.answer if re.search(re.escape(state.answer), page["contents"]) else (
      self._title(target_page))  # fmt: skip
    sub = await self._gen(
      "link_fact", ["question", "answer", "statement"], seed_id, title=self._title(page),
      url=page["url"], text=page["contents"][: self.config.page_chars], target=target,
    )  # fmt: skip
    if sub["answer"] != target:
      raise Reject("link_answer_mismatch")
    if target.lower() not in sub["statement"].lower():
      raise Reject("link_fact_off_target")
    self._grounded(sub["statement"], page)
    texts = [s["text"] for s in state.statements]
    if norm(sub["statement"]) in {norm(t) for t in texts}:
      raise Reject("duplicate_fact")  # verbatim: no need to ask
    if self.config.check_duplicate:
      try:
        dup = await self.generator.ask(
          P.render("duplicate_fact", statements=P.format_statements(texts),
                   statement=sub["statement"]),
          lambda t: P.parse_yes_no(t, "duplicate"), step="duplicate_fact", seed_id=seed_id,
        )  # fmt: skip
      except CallFailed as e:
        raise Reject(f"duplicate_fact:{e.reason}") from None
      if dup:
        raise Reject("duplicate_fact")
    out = await self._gen(
      "combine", ["question", "answer"], seed_id, question=state.question, answer=state.answer,
      sub_question=sub["question"], sub_answer=sub["answer"], statement=sub["statement"],
    )  # fmt: skip
    if out["answer"] != state.answer:
      raise Reject("answer_changed")
    return dataclasses.replace(
      state, question=out["question"],
      statements=(*state.statements, {"text": sub["statement"], "source": page["url"]}),
      relevant=(*state.relevant, page["url"]),
    )  # fmt: skip

  async def _fuzz(self, state: QAState, seed_id: str) -> QAState:
    out = await self._gen(
      "fuzz", ["question", "answer", "original", "vague"], seed_id, question=state.question,
      answer=state.answer, statements=P.format_statements([s["text"] for s in state.statements]),
    )  # fmt: skip
    if out["answer"] != state.answer:
      raise Reject("answer_changed")
    if out["vague"].lower() not in out["question"].lower():
      raise Reject("fuzz_not_applied")
    fuzz = Fuzz(original=out["original"], vague=out["vague"])
    return dataclasses.replace(state, question=out["question"], fuzzes=(*state.fuzzes, fuzz))
