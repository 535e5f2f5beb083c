"""Every prompt of QA synthesis, by versioned name, with the parser of its output format.

Prompts are data: a run records the names it used (`PROMPT_SET`), so two output files made with
different wording are never mistaken for one another, and changing a prompt means adding `/v2`
rather than silently editing `/v1`. Each prompt's first line is `Task: <name>` so call logs (and the
test suite's scripted model) can tell them apart. Generator prompts answer with one JSON object;
the solver answers in `<answer>` tags as ASearcher's agents do; the judge reuses the evaluation
judge's prompt and parser, so difficulty is graded exactly as benchmark answers are.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from asearcher_jax.evaluation.judge import JUDGE_PROMPT, parse_verdict, prepare_prediction

_JSON_REPLY = "Reply with only a JSON object, no other text:\n"

PROMPTS: dict[str, str] = {
  "base_qa/v1": (
    "Task: base_qa\n"
    "You write quiz questions grounded in a web page.\n\n"
    "Page title: {title}\nPage URL: {url}\nPage text:\n{text}\n\n"
    "Write one simple question whose answer is a short name, date or number stated in the page. "
    "The question must be clear, answerable from the page and have exactly one correct answer; "
    "it must not contain the answer. Also write the statement: one sentence from the page that "
    "proves the answer.\n" + _JSON_REPLY +
    '{{"question": "...", "answer": "...", "statement": "..."}}'
  ),
  "choose_action/v1": (
    "Task: choose_action\n"
    "We make a question harder step by step; its answer never changes.\n\n"
    "Question: {question}\nAnswer: {answer}\nFacts:\n{statements}\n\n"
    "Actions:\n{options}\n" + _JSON_REPLY +
    '{{"action": "one of: {names}", "reason": "..."}}'
  ),
  "link_fact/v1": (
    "Task: link_fact\n"
    "Page title: {title}\nPage URL: {url}\nPage text:\n{text}\n\n"
    "Target: {target}\n"
    "Write one statement (a single sentence that is true according to the page) that mentions "
    "{target}, and a question that this statement answers with exactly \"{target}\". The question "
    "must not contain \"{target}\".\n" + _JSON_REPLY +
    '{{"question": "...", "answer": "{target}", "statement": "..."}}'
  ),
  "duplicate_fact/v1": (
    "Task: duplicate_fact\n"
    "Known facts:\n{statements}\n\nNew fact: {statement}\n\n"
    "Is the new fact already stated or implied by the known facts?\n" + _JSON_REPLY +
    '{{"duplicate": "yes or no"}}'
  ),
  "combine/v1": (
    "Task: combine\n"
    "Question A: {question}\nAnswer A: {answer}\n"
    "Question B: {sub_question}\nAnswer B: {sub_answer}\nFact B: {statement}\n\n"
    "Rewrite question A so that it also uses fact B. Where question A names {sub_answer}, "
    "replace the name with the description from question B so that \"{sub_answer}\" no longer "
    "appears; if question A does not mention it, add fact B as one more condition on the "
    "answer. Write a single question. The answer must stay exactly \"{answer}\".\n"
    + _JSON_REPLY + '{{"question": "...", "answer": "{answer}"}}'
  ),
  "fuzz/v1": (
    "Task: fuzz\n"
    "Question: {question}\nAnswer: {answer}\nFacts:\n{statements}\n\n"
    "Replace one precise detail of the question (a year, number, name or place) by a vaguer "
    "description (for example a year by its decade) so that the question still has exactly one "
    "correct answer, the same one.\n" + _JSON_REPLY +
    '{{"question": "...", "answer": "{answer}", "original": "the precise detail replaced", '
    '"vague": "the vaguer words now in the question"}}'
  ),
  "quality/v1": (
    "Task: quality_check\n"
    "Question: {question}\nProposed answer: {answer}\nFacts:\n{statements}\n\n"
    "Check three things: (1) it is one question, not several questions joined together; "
    "(2) the facts are enough to find the answer; (3) the proposed answer is correct and is the "
    "only correct answer.\n" + _JSON_REPLY +
    '{{"single_question": "yes or no", "solvable": "yes or no", "unique": "yes or no", '
    '"reason": "..."}}'
  ),
  "solve/v1": (
    "Task: solve\n"
    "Answer the question from your own knowledge, without searching. Think briefly, then give "
    "only the final answer inside <answer></answer>.\n\nQuestion: {question}\n"
  ),
  "alternative/v1": (
    "Task: alternative_check\n"
    "Question: {question}\nFacts:\n{statements}\nReference answer: {answer}\n"
    "Candidate answer: {candidate}\n\n"
    "Does the candidate answer also satisfy every condition of the question, so that the question "
    "would have two correct answers?\n" + _JSON_REPLY +
    '{{"satisfies_all": "yes or no", "reason": "..."}}'
  ),
  "judge/asearcher-v1": JUDGE_PROMPT,
}  # fmt: skip

# The prompt of each step; a run records this mapping in its summary and every output row.
PROMPT_SET: dict[str, str] = {
  "base_qa": "base_qa/v1",
  "choose_action": "choose_action/v1",
  "link_fact": "link_fact/v1",
  "duplicate_fact": "duplicate_fact/v1",
  "combine": "combine/v1",
  "fuzz": "fuzz/v1",
  "quality": "quality/v1",
  "solve": "solve/v1",
  "alternative": "alternative/v1",
  "judge": "judge/asearcher-v1",
}

ACTION_HELP = {
  "inject": "inject: add a fact about an entity linked to the question as one more condition",
  "fuzz": "fuzz: replace one precise detail by a vaguer description",
  "exit": "exit: the question is hard enough; stop",
}


def render(step: str, **fields: Any) -> str:
  """The prompt of `step` (see PROMPT_SET) with `fields` filled in."""
  return PROMPTS[PROMPT_SET[step]].format(**fields)


def format_statements(statements: Sequence[str]) -> str:
  return "\n".join(f"- {s}" for s in statements) or "- (none)"


def judge_prompt(question: str, answer: str, prediction: str) -> str:
  return PROMPTS[PROMPT_SET["judge"]].format(
    question=question, labeled=answer, predicted=prepare_prediction(prediction)
  )


def parse_json(text: str, keys: Sequence[str]) -> dict[str, str]:
  """The last JSON object in `text` (a ```json block first) holding every key as a non-empty
  string. Raises ValueError otherwise, which makes the caller retry the call."""
  blocks = []
  if "```json" in text:
    blocks.append(text.rsplit("```json", 1)[1].split("```", 1)[0])
  blocks.append(text)
  decoder = json.JSONDecoder()
  for block in blocks:
    found = None
    for m in re.finditer(r"\{", block):
      try:
        obj, _ = decoder.raw_decode(block, m.start())
      except json.JSONDecodeError:
        continue
      if isinstance(obj, dict):
        found = obj
    if found is not None:
      missing = [k for k in keys if not isinstance(found.get(k), str) or not found[k].strip()]
      if missing:
        raise ValueError(f"JSON object lacks non-empty string field(s) {missing}")
      return {k: str(v).strip() if isinstance(v, str) else v for k, v in found.items()}
  raise ValueError("no JSON object in the output")


def parse_yes_no(text: str, key: str) -> bool:
  """A "yes"/"no" field of a JSON reply (also true/false)."""
  value = parse_json(text, [])
  raw = value.get(key)
  word = str(raw).strip().lower() if raw is not None else ""
  if word.startswith("yes") or word == "true":
    return True
  if word.startswith("no") or word == "false":
    return False
  raise ValueError(f"field {key!r} is not yes/no: {raw!r}")


def parse_answer(text: str) -> str | None:
  """The solver's last `<answer>` (None when it gave none: counted as a wrong answer)."""
  found = re.findall(r"<answer>(.*?)</answer>", text, flags=re.S)
  return found[-1].strip() if found and found[-1].strip() else None


def parse_judgement(text: str) -> bool:
  verdict = parse_verdict(text)
  if verdict is None:
    raise ValueError("no judgement in the judge's output")
  return verdict == "correct"
