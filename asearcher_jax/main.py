"""The one command-line entry point: `asearcher <subcommand> --gin_file ... --gin_param ...`.

This is the only module that imports gin or parses flags. Each subcommand is a plain library
function taking keyword arguments; gin files bind those arguments (dynamic registration) and this
module calls the configured function. With no `--gin_file`, `gin/runs/<subcommand>.gin` is used
when it exists, so `asearcher demo` works as is.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from asearcher_jax.errors import AsearcherError

# Subcommand -> "module:function". Imported lazily so `asearcher --help` stays fast and a broken
# optional dependency of one subcommand does not break the others.
SUBCOMMANDS: dict[str, str] = {
  "demo": "asearcher_jax.apps.demo:run",
  "serve-model": "asearcher_jax.apps.serve_model:serve",
  "index": "asearcher_jax.apps.index:build_index",
  "serve-retrieval": "asearcher_jax.apps.serve_retrieval:serve",
  "train": "asearcher_jax.apps.train:train",
  "sft": "asearcher_jax.apps.sft:sft",
  "eval": "asearcher_jax.apps.evaluate:evaluate",
  "synth": "asearcher_jax.apps.synth:synth",
  "quickstart": "asearcher_jax.apps.quickstart:quickstart",
  "warm-start": "asearcher_jax.apps.warm_start:warm_start",
  "plan": "asearcher_jax.apps.plan:plan",
  "sweep": "asearcher_jax.apps.sweep:sweep",
}

# Where gin files are looked up: the working directory, then the repository root. Includes are
# written from the root ('gin/models/x.gin'): gin's package-path reader would mistake a bare
# 'runs/x.gin' for a Python namespace package when a runs/ directory exists.
_REPO_ROOT = Path(__file__).resolve().parents[1]
GIN_SEARCH_PATHS = (Path.cwd(), _REPO_ROOT)


def _resolve(target: str) -> Callable[..., object]:
  module_name, fn_name = target.split(":")
  return getattr(importlib.import_module(module_name), fn_name)


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="asearcher",
    description="asearcher_jax: train and evaluate LLM search agents with asynchronous RL.",
  )
  parser.add_argument("subcommand", choices=sorted(SUBCOMMANDS))
  parser.add_argument("gin_files", nargs="*", help="gin files, before any --gin_file")
  parser.add_argument(
    "--gin_file", action="append", default=[], help="gin file (repeatable, applied in order)"
  )
  parser.add_argument(
    "--gin_param",
    action="append",
    default=[],
    help="gin binding, e.g. --gin_param='demo.run.text=\"hi\"' (repeatable, applied last)",
  )
  parser.add_argument("--print_config", action="store_true", help="print the operative config")
  parser.add_argument("--operative_config", help="write gin's operative config here after the run")
  parser.add_argument("--log_level", default="INFO")
  return parser.parse_args(argv)


def configure(subcommand: str, gin_files: Sequence[str], gin_params: Sequence[str]) -> Callable:
  """Parses gin files and bindings; returns the configured subcommand function."""
  import gin

  for path in GIN_SEARCH_PATHS:
    gin.add_config_file_search_path(str(path))
  files = list(gin_files)
  if not files:
    default = _REPO_ROOT / "gin" / "runs" / f"{subcommand.replace('-', '_')}.gin"
    if default.exists():
      files = [str(default)]
  fn = _resolve(SUBCOMMANDS[subcommand])
  gin.parse_config_files_and_bindings(files, list(gin_params), skip_unknown=False)
  return gin.get_configurable(fn)


def main(argv: Sequence[str] | None = None) -> int:
  args = _parse_args(sys.argv[1:] if argv is None else argv)
  logging.basicConfig(
    level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
  )
  for noisy in ("absl", "orbax", "jax._src.xla_bridge"):  # per-step INFO chatter from libraries
    logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
  try:
    fn = configure(args.subcommand, [*args.gin_files, *args.gin_file], args.gin_param)
  except (OSError, ValueError) as e:  # gin reports unknown files/bindings as these
    print(f"asearcher {args.subcommand}: config error: {e}", file=sys.stderr)
    return 2
  if args.print_config:
    import gin

    print(gin.config_str())
  try:
    result = fn()
  except AsearcherError as e:
    # One line: gin appends "In call to configurable ..." lines to exceptions it passes through.
    message = str(e).splitlines()[0] if str(e) else type(e).__name__
    print(f"asearcher {args.subcommand}: error: {message}", file=sys.stderr)
    return 1
  if args.operative_config:
    import gin

    Path(args.operative_config).parent.mkdir(parents=True, exist_ok=True)
    Path(args.operative_config).write_text(gin.operative_config_str())
  return int(result) if isinstance(result, int) else 0


if __name__ == "__main__":
  sys.exit(main())
