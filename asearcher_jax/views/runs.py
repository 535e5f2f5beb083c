"""What a run directory holds, found by the files runs write (never by a fixed layout): training
episode exports (`rl.episodes`), evaluation snapshots (`evaluation.runner`), metrics JSONL
(`metric_writer`), synthesis outputs (`synthesis.run`) and the tokenizer of the token ids.

`asearcher quickstart`, `asearcher train`, `asearcher eval` and `asearcher synth` each write a
different tree; a `RunDir` over any of them (or over a directory holding several) lists what is
there, so a notebook or `asearcher inspect` takes one path.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from asearcher_jax import storage
from asearcher_jax.agent.trajectory import Trajectory
from asearcher_jax.errors import AsearcherError
from asearcher_jax.evaluation import metrics as eval_metrics
from asearcher_jax.rl.episodes import EPISODES_FILE, read_episodes
from asearcher_jax.tokenizer import Tokenizer
from asearcher_jax.views.episode import tool_attribution


@dataclasses.dataclass(kw_only=True)
class Episode:
  """One episode found in a run, with what the run knew about it.

  Attributes:
    id: stable id for `asearcher inspect --episode` ("train:<group id>#<n>" or
      "eval:<config dir>/<dataset>/run<r>/<qid>").
    source: "train", or "eval:<label>" (the evaluated policy, e.g. "eval:sft", "eval:rl").
    trajectory: the full episode.
    score: the reward the run gave it (training), or F1 (evaluation); None when excluded.
    em: exact match of its answer against the gold answers (None without answers).
    version: policy version the episode started under (training only).
    accepted: its group was pushed for training (training only).
    meta: the remaining fields of the record (advantage, rejection, dataset, run, seed, ...).
  """

  id: str
  source: str
  trajectory: Trajectory
  score: float | None
  em: float | None
  version: int | None = None
  accepted: bool | None = None
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def qid(self) -> str:
    return self.trajectory.qid

  @property
  def turns(self) -> int:
    return len(self.trajectory.calls)

  @property
  def tool_calls(self) -> int:
    return len(self.trajectory.tools)

  @property
  def tool_failures(self) -> int:
    """Tool calls that failed: the environment's fault (outage, timeout) or the policy's
    (an invalid call, e.g. an unknown URL)."""
    return sum(bool(tool_attribution(t)) for t in self.trajectory.tools)

  @property
  def correct(self) -> bool | None:
    return None if self.em is None else self.em >= 1.0

  def summary(self) -> dict[str, Any]:
    """One flat row for tables."""
    t = self.trajectory
    return {
      "id": self.id, "source": self.source, "qid": self.qid, "question": t.question,
      "answer": t.pred_answer, "gold": " | ".join(t.answers), "score": self.score, "em": self.em,
      "turns": self.turns, "tool_calls": self.tool_calls, "tool_failures": self.tool_failures,
      "finish": t.finish_reason, "version": self.version, "accepted": self.accepted,
    }  # fmt: skip


def _em(traj: Trajectory) -> float | None:
  return eval_metrics.exact_match(traj.pred_answer, traj.answers) if traj.answers else None


def _train_episodes(path: Path, root: Path) -> list[Episode]:
  prefix = "" if path.parent == root else f"{path.parent.relative_to(root)}:"
  out = []
  for n, rec in enumerate(read_episodes(path), 1):
    try:
      traj = Trajectory.from_json(rec["trajectory"])
      episode_id = f"train:{prefix}{rec['group_id']}#{rec['episode']}"
    except (KeyError, TypeError, ValueError) as e:
      what = f"no {e.args[0]!r} field" if isinstance(e, KeyError) else str(e).splitlines()[0]
      raise AsearcherError(f"{path}: episode record {n}: {what}") from None
    meta = {k: v for k, v in rec.items() if k != "trajectory"}
    out.append(
      Episode(
        id=episode_id,
        source="train",
        trajectory=traj,
        score=rec.get("score"),
        em=_em(traj),
        version=rec.get("created_version"),
        accepted=rec.get("accepted"),
        meta=meta,
      )
    )
  return out


def eval_label(config_dir: Path) -> str:
  """A short name for an evaluation directory: the part of its `policy` identity before ':'
  (the quickstart's "sft" / "rl"), else the directory name."""
  try:
    policy = json.loads((config_dir / "config.json").read_text()).get("policy")
  except (OSError, json.JSONDecodeError):
    policy = None
  return str(policy).split(":", 1)[0] if policy else config_dir.name


def _eval_episodes(config_dir: Path) -> list[Episode]:
  label = eval_label(config_dir)
  out = []
  for path in sorted(config_dir.glob("*/run*/*.json")):
    try:
      snap = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
      continue
    if not isinstance(snap, dict):
      raise AsearcherError(f"{path}: not an evaluation snapshot (a JSON object)")
    if "trajectory" not in snap:
      continue  # sensitive sets and save_trajectories=False keep no episode
    try:
      traj = Trajectory.from_json(snap["trajectory"])
      meta = {k: v for k, v in snap.items() if k != "trajectory"}
      meta["config_dir"] = str(config_dir)
      episode = Episode(
        id=f"eval:{config_dir.name}/{snap['dataset']}/run{snap['run']}/{snap['qid']}",
        source=f"eval:{label}",
        trajectory=traj,
        score=snap["scores"].get("f1"),
        em=snap["scores"].get("em"),
        meta=meta,
      )
    except (KeyError, TypeError, AttributeError, ValueError) as e:  # written by another version
      raise AsearcherError(
        f"{path}: not an evaluation snapshot this version reads ({type(e).__name__}: {e})"
      ) from None
    out.append(episode)
  return out


# A small real run shipped with the package (`sample_run`): the views and notebooks have
# something to show before the user's first run.
SAMPLE_RUN = Path(__file__).resolve().parents[1] / "assets" / "sample_run"


def sample_run() -> Path:
  """The shipped sample run: the CI-size quickstart's episodes, evaluations, metrics and report
  (asearcher_jax/assets/sample_run/README.md says how it was made)."""
  return SAMPLE_RUN


class RunDir:
  """Everything inspectable under one directory (searched recursively, lazily). A gs:// URL is
  copied to the local cache first (`storage.local_copy`: everything but checkpoints, replay and
  weights), and read there."""

  def __init__(self, root: str | Path) -> None:
    if not str(root).strip():
      raise AsearcherError("no run directory given (an empty path)")
    if storage.is_url(root):
      try:
        local = storage.local_copy(str(root), what="run directory", skip=storage.RUN_HEAVY)
      except (FileNotFoundError, OSError) as e:
        raise AsearcherError(f"cannot read run directory {root}: {e}") from None
      self.url: str | None = str(root)
      root = local
    else:
      self.url = None
    self.root = Path(root)
    if self.root.is_file():
      raise AsearcherError(f"{str(self.root)!r} is a file, not a run directory")
    if not self.root.is_dir():
      raise AsearcherError(f"run directory {str(self.root)!r} does not exist")

  def _find(self, name: str) -> list[Path]:
    return sorted(self.root.rglob(name), key=lambda p: (len(p.parts), str(p)))

  @functools.cached_property
  def eval_dirs(self) -> list[Path]:
    """Evaluation configuration directories (`config.json` next to `<dataset>/run<r>/`)."""
    return [p.parent for p in self._find("config.json") if any(p.parent.glob("*/run*/*.json"))]

  @functools.cached_property
  def metrics_files(self) -> list[Path]:
    return self._find("metrics.jsonl")

  @functools.cached_property
  def synthesis_dirs(self) -> list[Path]:
    return [
      p.parent for p in self._find("progress.jsonl") if (p.parent / "questions.jsonl").exists()
    ]

  @functools.cached_property
  def episodes(self) -> list[Episode]:
    """Training episodes (in export order), then evaluation episodes (by directory, file)."""
    out = []
    logs = self._find(EPISODES_FILE)
    # A pod trainer's log, shipped in segments (`storage.ShippedLogs`): read where it would be.
    logs += [s.parent / EPISODES_FILE for s in self._find(EPISODES_FILE + ".segments")
             if s.parent / EPISODES_FILE not in logs]  # fmt: skip
    for path in logs:
      out.extend(_train_episodes(path, self.root))
    for d in self.eval_dirs:
      out.extend(_eval_episodes(d))
    return out

  @functools.cached_property
  def tokenizer(self) -> Tokenizer | None:
    """The tokenizer of the run's token ids (a run's own `tokenizer/`, else the shallowest
    tokenizer.json below the root); None when the run keeps none (ids are shown raw)."""
    for p in self._find("tokenizer.json"):
      try:
        return Tokenizer.from_dir(p.parent)
      except Exception:  # a broken file must not stop an inspection
        continue
    return None

  def episode(self, episode_id: str) -> Episode:
    for e in self.episodes:
      if e.id == episode_id:
        return e
    near = [e.id for e in self.episodes if episode_id in e.id][:5]
    hint = f"; did you mean {', '.join(near)}" if near else ""
    raise AsearcherError(
      f"no episode {episode_id!r} in {self.root} ({len(self.episodes)} episodes){hint}"
    )

  def question(self, qid: str) -> list[Episode]:
    """Every episode of one question, training first, then each evaluation."""
    found = [e for e in self.episodes if e.qid == qid]
    if not found:
      raise AsearcherError(f"no episode of question {qid!r} in {self.root}")
    return found


def _score_key(e: Episode) -> float:
  return e.score if e.score is not None and math.isfinite(e.score) else -math.inf


def worst(episodes: Sequence[Episode], n: int) -> list[Episode]:
  """The n lowest-scoring episodes (excluded ones first: they failed), ties broken by more tool
  failures, then more turns: the ones worth reading first when debugging."""
  return sorted(episodes, key=lambda e: (_score_key(e), -e.tool_failures, -e.turns))[:n]


def select(
  episodes: Iterable[Episode],
  *,
  source: str | None = None,
  correct: bool | None = None,
  min_turns: int = 0,
  max_turns: int | None = None,
  tool_failures: bool | None = None,
) -> list[Episode]:
  """Filters for browsing: by source prefix ("train", "eval", "eval:rl"), correctness (exact
  match), number of LLM turns, and whether any tool call failed."""
  out = []
  for e in episodes:
    if source is not None and not e.source.startswith(source):
      continue
    if correct is not None and e.correct is not correct:
      continue
    if e.turns < min_turns or (max_turns is not None and e.turns > max_turns):
      continue
    if tool_failures is not None and (e.tool_failures > 0) is not tool_failures:
      continue
    out.append(e)
  return out


def by_question(episodes: Iterable[Episode], source: str = "eval") -> dict[str, dict[str, Episode]]:
  """qid -> {source: its first episode there}, over episodes whose source starts with `source`:
  the same question under each evaluated policy (e.g. before and after RL)."""
  out: dict[str, dict[str, Episode]] = {}
  for e in episodes:
    if e.source.startswith(source):
      out.setdefault(e.qid, {}).setdefault(e.source, e)
  return out


def compared(episodes: Iterable[Episode], source: str = "eval") -> list[Episode]:
  """One episode per source for the first question that several sources answered (e.g. the
  warm start's and the RL policy's attempt at one held-out question); [] if none."""
  for per_source in by_question(episodes, source).values():
    if len(per_source) > 1:
      return list(per_source.values())
  return []
