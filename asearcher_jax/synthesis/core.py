"""The synthesis loop's configuration and data: seeds, question states, rejections, counts."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Literal

from asearcher_jax.evaluation import metrics
from asearcher_jax.synthesis.oracle import Fuzz


@dataclasses.dataclass(frozen=True, kw_only=True)
class SynthConfig:
  """How each seed is grown and checked."""

  # Edits after the base question (ASearcher: 16).
  max_turns: int = 6
  # Solver samples per candidate for the difficulty test (ASearcher: 8).
  num_solver_samples: int = 8
  # A question counts as hard when solver accuracy <= this (ASearcher: 0, i.e. 0/8 correct).
  max_solver_accuracy: float = 0.0
  # How solver answers are graded: "judge" (LLM judge role), "em" or "f1" (>= f1_threshold).
  grader: Literal["judge", "em", "f1"] = "judge"
  f1_threshold: float = 0.8
  # "llm": the generator picks each action; "random": a seeded coin between inject and fuzz,
  # exiting as soon as a hard question is accepted.
  action_policy: Literal["llm", "random"] = "llm"
  # Ask whether an injected fact is already covered by the statements (ASearcher's check 1).
  check_duplicate: bool = True
  # Ask, for each distinct wrong solver answer, whether it also satisfies every condition.
  check_alternatives: bool = True
  # With an oracle: a candidate must also pass it (False: the oracle only audits the LLM checks).
  oracle_gate: bool = True
  # Characters of a page shown to the generator.
  page_chars: int = 3000
  # Longest question accepted (characters).
  max_question_chars: int = 1200
  # Fraction of a statement's words that must occur in its source page (0 disables).
  min_grounding: float = 0.6
  # Seconds one seed may take in all; then it ends with reason "seed_timeout".
  seed_timeout_s: float = 900.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Seed:
  """Where a question starts: a page URL, or a seed QA (question, answer, statement)."""

  id: str
  url: str = ""
  question: str = ""
  answer: str = ""
  aliases: tuple[str, ...] = ()
  statement: str = ""
  source: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class QAState:
  """A question with everything that grounds it."""

  question: str
  answer: str
  statements: tuple[dict[str, str], ...]  # {"text", "source"}
  relevant: tuple[str, ...]  # URLs of the pages the question is built from
  fuzzes: tuple[Fuzz, ...] = ()
  aliases: tuple[str, ...] = ()  # other spellings of the answer (from a seed QA)


class Reject(Exception):
  def __init__(self, reason: str, verdicts: dict[str, Any] | None = None) -> None:
    super().__init__(reason)
    self.reason = reason
    self.verdicts = verdicts or {}


@dataclasses.dataclass(kw_only=True)
class Stats:
  """Counts over a run: candidates, accepted, rejections by reason, oracle agreement."""

  candidates: int = 0
  accepted: int = 0
  rejected: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  events: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  agreement: dict[str, collections.Counter] = dataclasses.field(
    default_factory=lambda: {"quality": collections.Counter(), "alternative": collections.Counter()}
  )

  def agree(self, check_name: str, llm_ok: bool, oracle_ok: bool) -> None:
    key = "agree" if llm_ok == oracle_ok else f"llm_{_pf(llm_ok)}_oracle_{_pf(oracle_ok)}"
    self.agreement[check_name][key] += 1

  def to_json(self) -> dict[str, Any]:
    agreement = {}
    for name, c in self.agreement.items():
      total = sum(c.values())
      agreement[name] = {**c, "total": total, "rate": c["agree"] / total if total else None}
    return {
      "candidates": self.candidates, "accepted": self.accepted,
      "rejected": dict(self.rejected.most_common()), "events": dict(self.events),
      "oracle_agreement": agreement,
    }  # fmt: skip


def _pf(ok: bool) -> str:
  return "pass" if ok else "fail"


def norm(s: str) -> str:
  return metrics.normalize_answer(s)


def grounding(statement: str, page: str) -> float:
  """Fraction of the statement's words that occur in the page (a cheap fabrication check)."""
  words = set(norm(statement).split())
  return len(words & set(norm(page).split())) / len(words) if words else 0.0
