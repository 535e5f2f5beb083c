"""`asearcher inspect`: a run's episodes in the terminal, turn by turn and token by token.

  asearcher inspect RUN_DIR [--episode ID | --question QID | --worst N]
  asearcher inspect --gin_param='inspect.inspect.run_dir="RUN_DIR"' --gin_param=inspect.inspect.worst=5

RUN_DIR is any directory a run wrote (`asearcher quickstart`, `train`, `eval`): training episode
exports and evaluation snapshots below it are found wherever they are (`views.runs`). Without a
selector it lists what the directory holds and its episodes; `--episode` draws one episode (turns,
reward and its parts, tool calls with failure attribution, the training sequences coloured by
loss mask and policy version); `--question` every episode of one question (e.g. before and after
RL); `--worst` the N lowest-scoring ones.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console

from asearcher_jax.errors import AsearcherError, ConfigValueError
from asearcher_jax.views import runs, terminal


def inspect(
  *,
  run_dir: str = "runs/quickstart",
  episode: str | None = None,
  question: str | None = None,
  worst: int | None = None,
  tokens: bool = True,
  width: int | None = None,
  limit: int = 40,
) -> int:
  """Prints a run's episodes; returns 0.

  Args:
    run_dir: the run directory to read.
    episode: id of one episode to draw in full (ids are listed without a selector).
    question: a question id: every episode of it, training and each evaluation.
    worst: the N lowest-scoring episodes (ties: more tool failures, more turns first).
    tokens: with `episode`, also draw the training sequences token by token.
    width: console width (None: the terminal's).
    limit: most rows of the episode list drawn without a selector.
  """
  chosen = [x for x in (episode, question, worst) if x is not None]
  if len(chosen) > 1:
    raise ConfigValueError(
      "give at most one of episode, question and worst (--episode, --question, --worst)"
    )
  if worst is not None and worst < 1:
    raise ConfigValueError(f"worst (--worst) must be >= 1, got {worst}")
  if width is not None and width < 20:
    raise ConfigValueError(f"width (--width) must be >= 20 columns, got {width}")
  if limit < 1:
    raise ConfigValueError(f"limit must be >= 1, got {limit}")
  run = runs.RunDir(run_dir)
  console = Console(width=width, highlight=False)
  tok = run.tokenizer
  if episode is not None:
    terminal.print_episode(run.episode(episode), console, tok, tokens=tokens)
  elif question is not None:
    eps = run.question(question)
    terminal.print_table(eps, console, title=f"question {question}")
    for e in eps:
      console.print(terminal.header(e))
      console.print(terminal.turns_view(e, tok))
  elif worst is not None:
    eps = runs.worst(run.episodes, worst)
    terminal.print_table(eps, console, title=f"{len(eps)} worst episodes")
    for e in eps:
      console.print(terminal.header(e))
      console.print(terminal.turns_view(e, tok))
  else:
    if not run.episodes:
      raise AsearcherError(
        f"no episodes under {run_dir}: neither a training export (episodes.jsonl.gz) nor "
        "evaluation snapshots with trajectories"
      )
    found = {
      "training episodes": sum(e.source == "train" for e in run.episodes),
      "evaluation episodes": sum(e.source.startswith("eval") for e in run.episodes),
      "evaluation runs": len(run.eval_dirs),
      "metrics logs": len(run.metrics_files),
      "synthesis runs": len(run.synthesis_dirs),
      "tokenizer": "yes" if tok is not None else "no (token ids shown raw)",
    }
    console.print(", ".join(f"{k}: {v}" for k, v in found.items()))
    terminal.print_table(run.episodes[:limit], console, title=f"episodes (first {limit})")
    console.print("next: --episode ID | --question QID | --worst N")
  return 0


def main(argv: Sequence[str] | None = None) -> int:
  """The positional command line (`RUN_DIR [--episode ID | --question QID | --worst N]`)."""
  p = argparse.ArgumentParser(prog="asearcher inspect", description=__doc__.splitlines()[0])
  p.add_argument("run_dir")
  g = p.add_mutually_exclusive_group()
  g.add_argument("--episode", help="episode id (listed when no selector is given)")
  g.add_argument("--question", help="question id: every episode of it")
  g.add_argument("--worst", type=int, metavar="N", help="the N lowest-scoring episodes")
  p.add_argument("--no_tokens", action="store_true", help="skip the token-level view")
  p.add_argument("--width", type=int, default=None, help="console width")
  a = p.parse_args(argv)
  try:
    return inspect(
      run_dir=a.run_dir, episode=a.episode, question=a.question, worst=a.worst,
      tokens=not a.no_tokens, width=a.width,
    )  # fmt: skip
  except AsearcherError as e:  # exit status as the gin-bound form gives it
    config = isinstance(e, ConfigValueError)
    print(f"asearcher inspect: {'config error' if config else 'error'}: {e}", file=sys.stderr)
    return 2 if config else 1


if __name__ == "__main__":
  sys.exit(main())
