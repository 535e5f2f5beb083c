"""Copy drills: the expert's first search turn, again, with the question's start renamed (and,
when the expert reads pages, the turns through its opening of the start's page).

Why: the world splits questions by start entity, so no held-out start is ever a copy target in
the expert's data, and a small policy learns to copy each entity token on its own (2026-11-26,
2 cores: held-out first-turn copies 79 % right against 99.7 % on train questions; training the
first turns with the start renamed to any entity: 98 %; renamed only to entities that are no
held-out start: 71 %). A drill trains the copy alone: one act turn (the question with another
entity's name and the search naming it), never a held-out chain, fact, page or answer. With
snippets (a page-reading expert) it goes on through the note and the `access` of the start's
page, whose URL holds the name's bare token: the trained outputs name the entity and its URL,
the renamed snippet (its first sentence) is input only.

Renaming is token-exact: an entity that is one token both with and without a leading space is
swapped for another such entity in the turn's input and output ids, so the drill is the same
token sequence the engine would have seen for that question. Questions whose start is described
(injected) rather than named, or not a single token, give no drills.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Mapping, Sequence

import numpy as np

from asearcher_jax.agent.trajectory import LLMCall, Trajectory
from asearcher_jax.synthwiki.questions import SynthQuestion
from asearcher_jax.synthwiki.world import World
from asearcher_jax.tokenizer import Tokenizer


def single_token_names(world: World, tokenizer: Tokenizer) -> dict[str, tuple[int, int]]:
  """Entity name -> (id of " name", id of "name"), for names that are one token both ways."""
  out = {}
  for entity_id in world.ids:
    name = world.entities[entity_id].name
    spaced, bare = tokenizer.encode(" " + name), tokenizer.encode(name)
    if len(spaced) == 1 and len(bare) == 1:
      out[name] = (spaced[0], bare[0])
  return out


def _rename(ids: np.ndarray, old: tuple[int, int], new: tuple[int, int]) -> np.ndarray:
  out = ids.copy()
  for a, b in zip(old, new, strict=True):
    out[ids == a] = b
  return out


def _swap_name(text: str, old: str, new: str) -> str:
  """The name as a whole word only (a name may be the prefix of another: "Lam", "Lamaex")."""
  return re.sub(rf"\b{re.escape(old)}\b", lambda _: new, text)


def copy_drills(
  trajectories: Sequence[Trajectory],
  questions: Mapping[str, SynthQuestion],
  world: World,
  tokenizer: Tokenizer,
  *,
  per_trajectory: int,
  seed: int = 0,
) -> list[Trajectory]:
  """`per_trajectory` drills per expert trajectory whose first call is an act turn that writes
  its question's named start: that call alone (with a page-reading expert, through the access
  of the start's page: `_drilled_calls`), the start renamed to an entity drawn uniformly from
  every single-token entity (held-out starts included: that is the point)."""
  names = single_token_names(world, tokenizer)
  pool = sorted(names)
  rng = random.Random(seed)
  drills = []
  for t in trajectories:
    q = questions.get(t.qid)
    if q is None or q.constraints or q.start not in names or not t.calls:
      continue
    first = t.calls[0]
    old = names[q.start]
    if first.kind != "act" or not np.isin(first.output_ids, old).any():
      continue
    kept = t.calls[: _drilled_calls(t.calls, old)]
    for j in range(per_trajectory):
      name = rng.choice(pool)
      new = names[name]
      calls = [
        dataclasses.replace(
          c,
          input_ids=_rename(c.input_ids, old, new),
          output_ids=_rename(c.output_ids, old, new),
          text=_swap_name(c.text, q.start, name),
        )
        for c in kept
      ]
      drills.append(_drill(t, q, name, calls, j))
  return drills


def _drilled_calls(calls: Sequence[LLMCall], old: tuple[int, int]) -> int:
  """1, or 3 when the expert read pages (act, read, act): its second act turn opens the start's
  page, and the URL writes the start's bare-name token ("Laezinak", not " Laezinak"), a copy
  target the first turn never trains (2026-11-27: a page-world fine-tune garbled those URLs)."""
  if (
    len(calls) >= 3
    and calls[1].kind == "read"
    and calls[2].kind == "act"
    and np.isin(calls[2].output_ids, old[1]).any()
  ):
    return 3
  return 1


def _drill(t: Trajectory, q: SynthQuestion, name: str, calls: list[LLMCall], j: int) -> Trajectory:
  """An episode cut after its drilled turns: no finish reason (not a budget stop), not scored."""
  return Trajectory(
    agent=t.agent, question=_swap_name(t.question, q.start, name), qid=f"{t.qid}/drill{j}",
    prompt_text=_swap_name(t.prompt_text, q.start, name), calls=calls,
    extra={"copy_drill_of": t.qid, "start": name},
  )  # fmt: skip
