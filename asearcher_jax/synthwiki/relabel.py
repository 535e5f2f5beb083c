"""Expert relabelling (DAgger): the scripted expert's next turn in the states the policy reaches.

Why: a warm start cloned from the expert's own episodes is 99 % token-accurate on them and still
finishes few of its own 17-call page episodes (2026-11-27, 2 cores: 1.6 % of train questions,
where the expert answers 28.9 %), because one wrong URL, entity or relation puts it in contexts
the expert never showed it, and it has learned nothing there. DAgger (Ross, Gordon and Bagnell,
2011) trains on the states the policy visits, labelled by the expert. The expert here is a pure
function of the context (`SynthWikiExpert` reads everything from it), so any recorded call of a
policy episode can be labelled after the fact, token-exact: the label is the expert's turn for
exactly the input ids the engine saw, with the agent's stops for that kind of turn.

Only the calls where the policy's turn differs from the expert's are kept (the corrections); each
becomes its own training sequence (its input, loss on the expert's turn), since the policy's next
input continues its own turn, not the label. The expert trusts the notes in the context, as it
does in its own episodes, so a misread note is carried on, not corrected.

With `keep_guesses`, an answer the policy gives where the expert would search on is left as it
is (counted, not corrected): the round then corrects the chain (relations, entities, notes) and
not when to stop, so a warm start that gives up early keeps that weakness for RL to fix. With
`first_only`, only an episode's first correction is kept: after it the policy is off the
expert's path and the expert's later turns recover ("X is not in these results", then X's search
again), which the policy never reaches in its own on-path episodes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from asearcher_jax.agent import protocol
from asearcher_jax.agent.trajectory import LLMCall, Trajectory
from asearcher_jax.serving.types import SamplingParams
from asearcher_jax.synthwiki.expert import SynthWikiExpert


@dataclasses.dataclass(frozen=True)
class Relabelled:
  """The corrections of a set of policy episodes and how often the policy agreed."""

  # One trajectory per episode with at least one correction: its calls are the corrected ones.
  trajectories: list[Trajectory]
  # (kind of turn, "agree" / "differ" / "unlabelled" / "guess kept") -> calls.
  counts: Counter
  # Where each episode first left the expert (`disagreement`) -> episodes.
  first: Counter = dataclasses.field(default_factory=Counter)

  def stats(self) -> dict[str, Any]:
    """Agreement per kind of turn (act, read), the corrections' totals and where the episodes
    first left the expert."""
    out: dict[str, Any] = {"episodes": len(self.trajectories)}
    for kind in sorted({"act", "read", *(k for k, _ in self.counts)}):
      agree, differ = self.counts[(kind, "agree")], self.counts[(kind, "differ")]
      calls = sum(self.counts[(kind, w)] for w in ("agree", "differ", "unlabelled", "guess kept"))
      out[kind] = {
        "calls": calls,
        "agree": agree,
        "differ": differ,
        "agreement": round(agree / max(agree + differ, 1), 4),
      }
      if self.counts[(kind, "guess kept")]:
        out[kind]["guesses_kept"] = self.counts[(kind, "guess kept")]
    out["corrections"] = sum(len(t.calls) for t in self.trajectories)
    out["first_disagreement"] = dict(self.first.most_common())
    return out


_ACTION_RE = re.compile(r"<(search|access|answer)>\s*(.*?)\s*</\1>", re.S)


def disagreement(kind: str, policy_text: str, expert_text: str) -> str:
  """What differs between two turns, in words: "note" for read turns; for act turns another
  action ("answer instead of search"), or the same action with another argument ("search: wrong
  relation", "search: wrong entity", "search: wrong entity and relation", "access: another
  page", "answer: another value")."""
  if kind == "read":
    return "note"
  p, e = _ACTION_RE.search(policy_text), _ACTION_RE.search(expert_text)
  p_tag, e_tag = (p.group(1) if p else "no action"), (e.group(1) if e else "no action")
  if p_tag != e_tag or p is None or e is None:
    return f"{p_tag} instead of {e_tag}" if p_tag != e_tag else "other text"
  if p_tag == "search":
    (p_ent, *p_rel), (e_ent, *e_rel) = p.group(2).split(" ", 1), e.group(2).split(" ", 1)
    wrong = [w for w, bad in (("entity", p_ent != e_ent), ("relation", p_rel != e_rel)) if bad]
    return "search: wrong " + " and ".join(wrong) if wrong else "search: other text"
  return {"access": "access: another page", "answer": "answer: another value"}[p_tag]


def _seed(traj: Trajectory, salt: int) -> int:
  """A sampling seed per episode for the expert's own draws (its give-up, its sloppiness)."""
  key = f"{salt}|{traj.qid}|{traj.started_at}|{traj.question}".encode()
  return int.from_bytes(hashlib.sha256(key).digest()[:4], "little")


def _label_call(call: LLMCall, label: Any, index: int, text: str) -> LLMCall:
  n = len(label.tokens)
  return LLMCall(
    index=index,
    kind=call.kind,
    input_ids=call.input_ids.copy(),
    output_ids=np.asarray(label.tokens, np.int32),
    logprobs=np.zeros(n, np.float32),
    versions=np.zeros(n, np.int32),
    stop_reason=label.stop_reason,
    max_new_tokens=call.max_new_tokens,
    text=text,
  )


async def relabel_episode(
  traj: Trajectory,
  expert: SynthWikiExpert,
  *,
  seed: int = 0,
  keep_guesses: bool = False,
  first_only: bool = False,
) -> tuple[Trajectory | None, Counter]:
  """The expert's turn for every call of `traj`; returns a trajectory of the calls where it
  differs from the policy's (None if none) and the per-kind counts, with ("first", what) for
  the episode's first disagreement. Calls whose context the expert cannot read (no known
  question) are counted as unlabelled; with `keep_guesses`, an answer where the expert searches
  or opens a page is counted as a kept guess, not corrected; with `first_only` the trajectory
  holds the first correction only (every disagreement is still counted)."""
  counts: Counter = Counter()
  kept: list[LLMCall] = []
  first = None
  sampling = SamplingParams(seed=_seed(traj, seed))
  for call in traj.calls:
    stop = protocol.READ_STOPS if call.kind == "read" else protocol.ACT_STOPS
    try:
      label = await expert.generate(call.input_ids.tolist(), sampling, call.max_new_tokens, stop)
    except ValueError:
      counts[(call.kind, "unlabelled")] += 1
      continue
    label_text = expert.tokenizer.decode(label.tokens)
    policy_text = expert.tokenizer.decode(call.output_ids.tolist())
    if label_text.strip() == policy_text.strip():
      counts[(call.kind, "agree")] += 1
      continue
    what = disagreement(call.kind, policy_text, label_text)
    if keep_guesses and what.startswith("answer instead of"):
      counts[(call.kind, "guess kept")] += 1
      continue
    counts[(call.kind, "differ")] += 1
    if first is None:
      first = what
      counts[("first", first)] += 1
    if not (first_only and kept):
      kept.append(_label_call(call, label, len(kept), label_text))
  if not kept:
    return None, counts
  out = Trajectory(
    agent=traj.agent,
    question=traj.question,
    qid=traj.qid,
    answers=list(traj.answers),
    prompt_text=traj.prompt_text,
    calls=kept,
    finish_reason="relabelled",
    extra={"relabelled_from": traj.qid, "policy_score": traj.score},
  )
  return out, counts


def relabel(
  trajectories: Iterable[Trajectory],
  expert: SynthWikiExpert,
  *,
  seed: int = 0,
  keep_guesses: bool = False,
  first_only: bool = False,
) -> Relabelled:
  """`relabel_episode` over policy episodes (environment failures skipped: their states are the
  tools', not the policy's)."""

  async def run(trajs: Sequence[Trajectory]) -> list[tuple[Trajectory | None, Counter]]:
    return [
      await relabel_episode(t, expert, seed=seed, keep_guesses=keep_guesses, first_only=first_only)
      for t in trajs
    ]

  done = asyncio.run(run([t for t in trajectories if not t.environment_failure]))
  total: Counter = Counter()
  first: Counter = Counter()
  kept = []
  for traj, counts in done:
    for (kind, what), n in counts.items():
      if kind == "first":
        first[what] += n
      else:
        total[(kind, what)] += n
    if traj is not None:
      kept.append(traj)
  return Relabelled(trajectories=kept, counts=total, first=first)
