"""A small tokenizer for one SynthWiki world: every entity name and agent tag is one token.

A policy trained from scratch learns far faster when an entity is one symbol it can copy from a
search result into a query or an answer, instead of a different split of syllables in every
position. So each name is an added token (with and without its leading space, the two ways text
writes it), the ChatML specials and the agent's tags are single tokens, and the rest is a byte-level
BPE of a couple of thousand pieces trained on the world's own text (pages as search results show
them, questions, the compact prompt, the expert's phrases). Byte-level means any text at all
(tool results, a model's garbage) encodes and decodes back unchanged.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from asearcher_jax.agent import prompts
from asearcher_jax.synthwiki.questions import SynthQuestion
from asearcher_jax.synthwiki.world import URL_PREFIX, World
from asearcher_jax.tokenizer import ENDOFTEXT, IM_END, IM_START, Tokenizer

SPECIALS = (ENDOFTEXT, IM_START, IM_END)
AGENT_TAGS = tuple(
  tag
  for name in ("think", "search", "access", "answer", "information")
  for tag in (f"<{name}>", f"</{name}>")
)
# Fixed texts the agent and the expert write around the world's own sentences.
_AGENT_TEXTS = (
  "No search results are found.",
  "No More Information is Found for this URL.",
  ">>>> Page 1 >>>>",
  "I need facts about {n}. I need the person first. {n} is the person in question.",
  "{n} is not in these results. No city here matches.",
)


def training_texts(world: World, questions: Iterable[SynthQuestion] = ()) -> list[str]:
  """What the BPE is trained on: text as the agent's context shows it."""
  texts = []
  for k, row in enumerate(world.corpus_rows()):
    texts.append(f"[Doc {k % 5 + 1}]({row['url']}):\n{row['contents']}\n\n")
    texts.append(f">>>> Page 1 >>>>\n\n{row['contents'][1:].replace(chr(34), '', 1)}")
  for q in questions:
    texts.append(prompts.synthwiki_prompt(q.question))
    texts.append(f"<answer> {q.answer} </answer>")
  texts += [t.format(n="Name") for t in _AGENT_TEXTS]
  return texts


def _strip(texts: Sequence[str], names: set[str]) -> list[str]:
  """Training text without names and tags: they are whole tokens, merges for them are waste."""
  pattern = re.compile("|".join(map(re.escape, sorted(AGENT_TAGS))) + r"|\b[A-Z][a-z]+\b")
  keep = lambda m: "" if m.group(0) in names or "<" in m.group(0) else m.group(0)  # noqa: E731
  return [pattern.sub(keep, t) for t in texts]


def build_world_tokenizer(
  world: World,
  questions: Iterable[SynthQuestion] = (),
  *,
  vocab_size: int = 2048,
  extra_texts: Sequence[str] = (),
) -> Tokenizer:
  """The world's tokenizer: `vocab_size` BPE pieces (bytes and specials included), then the agent
  tags, then each entity name as " Name" and "Name". Deterministic for a given world."""
  names = [world.entities[i].name for i in world.ids]
  texts = _strip([*training_texts(world, questions), *extra_texts, URL_PREFIX], set(names))
  hf = HFTokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False)
  hf.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    min_frequency=2,
    special_tokens=list(SPECIALS),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  hf.train_from_iterator(texts, trainer)
  hf.add_tokens([AddedToken(t, normalized=False) for t in AGENT_TAGS])
  hf.add_tokens([AddedToken(f"{p}{n}", normalized=False) for n in names for p in (" ", "")])
  return Tokenizer(hf)


def save_world_tokenizer(tokenizer: Tokenizer, out_dir: str | Path) -> Path:
  """A directory `Tokenizer.from_dir` loads: tokenizer.json and a tokenizer_config.json."""
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  tokenizer.backend.save(str(out / "tokenizer.json"))
  config = {"eos_token": IM_END, "pad_token": ENDOFTEXT, "tokenizer_class": "SynthWikiBPE"}
  (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
  return out
