"""SynthWiki: a procedurally generated encyclopedia and multi-hop question set for the quickstart.

A tiny policy trained from scratch cannot know any real-world fact, so the quickstart needs a world
whose every answer must be searched for: invented entities, their facts as compact pages (a wiki-18
corpus that `asearcher index` and the BM25 server take as is) and questions whose chains are walked
through the pages, verified unique. Everything follows from one seed.

    sw = build_synthwiki(SynthWikiConfig(seed=0))
    paths = sw.write("runs/quickstart/data")   # corpus.jsonl, train.jsonl, test.jsonl, world.json
    paths = prepare_synthwiki("runs/quickstart/data")  # the same, plus tokenizer/
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from asearcher_jax.synthwiki.questions import (
  COMPARISONS,
  Constraint,
  SynthQuestion,
  candidates,
  generate_questions,
  read_questions,
  resolve,
  write_questions,
)
from asearcher_jax.synthwiki.world import (
  KINDS,
  RELATIONS,
  TINY,
  TYPES,
  URL_PREFIX,
  Entity,
  Fact,
  Relation,
  SynthWikiConfig,
  World,
  build_world,
  fact_table,
  parse_facts,
  render_fact,
)

__all__ = [
  "COMPARISONS",
  "KINDS",
  "RELATIONS",
  "TINY",
  "TYPES",
  "URL_PREFIX",
  "Constraint",
  "Entity",
  "Fact",
  "Relation",
  "SynthQuestion",
  "SynthWiki",
  "SynthWikiConfig",
  "World",
  "build_synthwiki",
  "build_world",
  "candidates",
  "fact_table",
  "generate_questions",
  "parse_facts",
  "prepare_synthwiki",
  "read_questions",
  "render_fact",
  "resolve",
  "write_questions",
]


@dataclasses.dataclass(frozen=True)
class SynthWiki:
  """A generated world and its questions (each tagged with its split)."""

  world: World
  questions: list[SynthQuestion]

  @property
  def train(self) -> list[SynthQuestion]:
    return [q for q in self.questions if q.split == "train"]

  @property
  def test(self) -> list[SynthQuestion]:
    return [q for q in self.questions if q.split == "test"]

  @property
  def tokenizer_questions(self) -> list[SynthQuestion]:
    """The questions the world tokenizer is trained on (`SynthWikiConfig.tokenizer_max_hops`)."""
    limit = self.world.config.tokenizer_max_hops
    return [q for q in self.questions if limit is None or q.hops <= limit]

  def digest(self) -> str:
    """sha256 over the corpus and every question row: equal digests, identical data."""
    h = hashlib.sha256()
    for row in self.world.corpus_rows():
      h.update(json.dumps(row, sort_keys=True).encode())
    for q in self.questions:
      h.update(json.dumps(q.to_row(), sort_keys=True).encode())
    return h.hexdigest()

  def write(self, out_dir: str | Path) -> dict[str, Path]:
    """corpus.jsonl (wiki-18), train.jsonl / test.jsonl (QA rows + metadata), world.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "world.json").write_text(json.dumps(self.world.to_json(), indent=1) + "\n")
    return {
      "corpus": self.world.write_corpus(out / "corpus.jsonl"),
      "train": write_questions(self.train, out / "train.jsonl"),
      "test": write_questions(self.test, out / "test.jsonl"),
      "world": out / "world.json",
    }


def build_synthwiki(config: SynthWikiConfig | None = None) -> SynthWiki:
  """The world and its verified questions for `config` (default: the quickstart size)."""
  config = config or SynthWikiConfig()
  world = build_world(config)
  return SynthWiki(world=world, questions=generate_questions(world, config))


def prepare_synthwiki(
  out_dir: str | Path, config: SynthWikiConfig | None = None, *, vocab_size: int = 2048
) -> dict[str, Path]:
  """Everything the quickstart reads from disk: the data files and the world tokenizer
  (`tokenizer/`, loaded by `Tokenizer.from_dir`). Returns the paths by name."""
  from asearcher_jax.synthwiki.tokenizer import build_world_tokenizer, save_world_tokenizer

  sw = build_synthwiki(config)
  paths = sw.write(out_dir)
  tok = build_world_tokenizer(sw.world, sw.tokenizer_questions, vocab_size=vocab_size)
  paths["tokenizer"] = save_world_tokenizer(tok, Path(out_dir) / "tokenizer")
  return paths
