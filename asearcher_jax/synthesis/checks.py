"""The checks every candidate question passes, in order, each failure one counted reason.

Local format checks (one bounded question that does not contain its answer), the LLM quality
check (one question, solvable from the statements, the answer the only correct one), the oracle
when the world has one, the difficulty test (the solver answers the bare question n times
without tools; the judge or EM/F1 grades them) and the alternative-answer check (no wrong solver
answer satisfies every condition too). A call that fails after its attempts fails the check.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from typing import Any

from asearcher_jax.evaluation import metrics
from asearcher_jax.synthesis import prompts as P
from asearcher_jax.synthesis.core import QAState, Reject, Stats, SynthConfig, norm
from asearcher_jax.synthesis.llm import CallFailed, LLMRole
from asearcher_jax.synthesis.oracle import Oracle, OracleQuery, check


class Checker:
  """Runs every check of one candidate; `validate` returns the verdicts or raises `Reject`."""

  def __init__(
    self,
    config: SynthConfig,
    *,
    generator: LLMRole,
    solver: LLMRole,
    judge: LLMRole,
    oracle: Oracle | None,
    stats: Stats,
  ) -> None:
    self.config = config
    self.generator, self.solver, self.judge = generator, solver, judge
    self.oracle = oracle
    self.stats = stats

  def check_format(self, cand: QAState) -> None:
    """Local checks: one bounded question that does not give its answer away."""
    q, a = cand.question.strip(), cand.answer.strip()
    if not q or not a:
      raise Reject("format:empty")
    if len(q) > self.config.max_question_chars:
      raise Reject("format:too_long")
    if q.count("?") > 1:
      raise Reject("format:several_questions")
    na = norm(a)
    if len(na) > 1 and re.search(rf"(?<!\w){re.escape(na)}(?!\w)", norm(q)):
      raise Reject("format:answer_in_question")

  async def validate(self, cand: QAState, seed_id: str) -> dict[str, Any]:
    """All checks in order; returns the verdicts or raises `Reject` (verdicts so far attached)."""
    self.check_format(cand)
    verdicts: dict[str, Any] = {}
    texts = [s["text"] for s in cand.statements]
    oracle = None
    if self.oracle is not None:
      query = OracleQuery(
        question=cand.question, answer=cand.answer, statements=tuple(texts), fuzzes=cand.fuzzes
      )
      oracle = check(self.oracle, query)
      verdicts["oracle"] = dataclasses.asdict(oracle)
    try:
      quality = await self.generator.ask(
        P.render("quality", question=cand.question, answer=cand.answer,
                 statements=P.format_statements(texts)),
        lambda t: P.parse_json(t, ["single_question", "solvable", "unique"]),
        step="quality", seed_id=seed_id,
      )  # fmt: skip
    except CallFailed as e:
      raise Reject(f"quality:{e.reason}", verdicts) from None
    flags = {}
    for k in ("single_question", "solvable", "unique"):
      flags[k] = str(quality[k]).strip().lower()
      if not flags[k].startswith(("yes", "no")):
        raise Reject("quality:malformed", verdicts)
    verdicts["quality"] = {**flags, "reason": str(quality.get("reason", ""))[:500]}
    quality_ok = all(v.startswith("yes") for v in flags.values())
    if oracle is not None:
      self.stats.agree("quality", quality_ok, oracle.ok)
    failed = [k for k, v in flags.items() if not v.startswith("yes")]
    if failed:
      raise Reject(f"quality:not_{failed[0]}", verdicts)
    if oracle is not None and self.config.oracle_gate and not oracle.ok:
      raise Reject(oracle.reason, verdicts)
    preds = await self._solve(cand, seed_id, verdicts)
    correct = await self._grade(cand, preds, seed_id, verdicts)
    acc = sum(correct) / len(correct)
    verdicts["difficulty"] = {
      "accuracy": acc, "correct": sum(correct), "n": len(correct), "answers": preds,
      "hard": acc <= self.config.max_solver_accuracy,
    }  # fmt: skip
    if self.config.check_alternatives:
      await self._alternatives(cand, preds, correct, oracle, seed_id, verdicts)
    return verdicts

  async def _solve(self, cand: QAState, seed_id: str, verdicts: dict) -> list[str | None]:
    prompt = P.render("solve", question=cand.question)
    jobs = [
      self.solver.ask(prompt, P.parse_answer, step="solve", seed_id=seed_id, sample=i)
      for i in range(self.config.num_solver_samples)
    ]
    return await _gather_or_reject("solve", verdicts, jobs)

  async def _grade(
    self, cand: QAState, preds: list[str | None], seed_id: str, verdicts: dict
  ) -> list[bool]:
    cfg = self.config
    golds = [cand.answer, *cand.aliases]
    if cfg.grader == "em":
      return [p is not None and metrics.exact_match(p, golds) > 0 for p in preds]
    if cfg.grader == "f1":
      return [p is not None and metrics.f1(p, golds) >= cfg.f1_threshold for p in preds]
    cache: dict[str, bool] = {}
    ask: dict[str, str] = {}
    for p in preds:
      if p is not None and norm(p) not in cache and norm(p) not in ask:
        if metrics.exact_match(p, golds) > 0:  # an exact match needs no judge
          cache[norm(p)] = True
        else:
          ask[norm(p)] = p
    judged = await _gather_or_reject("judge", verdicts, [
      self.judge.ask(P.judge_prompt(cand.question, cand.answer, p), P.parse_judgement,
                     step="judge", seed_id=seed_id)
      for p in ask.values()
    ])  # fmt: skip
    cache.update(zip(ask, judged))
    return [p is not None and cache[norm(p)] for p in preds]

  async def _alternatives(self, cand, preds, correct, oracle, seed_id: str, verdicts) -> None:
    wrong: dict[str, str] = {}
    for p, ok in zip(preds, correct):
      if p is not None and not ok:
        wrong.setdefault(norm(p), p)
    texts = P.format_statements([s["text"] for s in cand.statements])
    alts = await _gather_or_reject("alternative", verdicts, [
      self.generator.ask(
        P.render("alternative", question=cand.question, statements=texts, answer=cand.answer,
                 candidate=p),
        lambda t: P.parse_yes_no(t, "satisfies_all"), step="alternative", seed_id=seed_id,
      )
      for p in wrong.values()
    ])  # fmt: skip
    found = []
    for p, alt in zip(wrong.values(), alts, strict=True):
      if oracle is not None and oracle.reason != "oracle_unverifiable":
        truth = any(self.oracle.same(p, a) for a in oracle.answers)  # type: ignore[union-attr]
        self.stats.agree("alternative", not alt, not truth)
      if alt:
        found.append(p)
    verdicts["alternatives"] = {"checked": list(wrong.values()), "valid": found}
    if found:
      raise Reject("alternative_answer", verdicts)


async def _gather_or_reject(step: str, verdicts: dict, jobs: list) -> list:
  """All calls at once (each role's semaphore bounds them); the first failed one fails the
  check with its reason."""
  results = await asyncio.gather(*jobs, return_exceptions=True)
  for r in results:
    if isinstance(r, CallFailed):
      raise Reject(f"{step}:{r.reason}", verdicts)
    if isinstance(r, BaseException):
      raise r
  return list(results)
