"""The one command-line entry point: `asearcher <subcommand> --gin_file ... --gin_param ...`.

This is the only module that parses flags. Each subcommand is a plain library function taking
keyword arguments; gin files bind those arguments (dynamic registration) and this module calls
the configured function. With no `--gin_file`, `gin/runs/<subcommand>.gin` is used when it
exists, so `asearcher demo` works as is. `asearcher SUBCOMMAND --help` lists what it binds
(apps/cli_help.py); every configuration mistake is one line and exit status 2
(apps/gin_config.py).

Before the subcommand runs (and so before any jax array exists) the process joins its
multi-process program, if it is one: `distributed.DistributedConfig` bound in gin
(`distributed.DistributedConfig.num_processes = 2`, ...) or the JAX_COORDINATOR_ADDRESS /
JAX_NUM_PROCESSES / JAX_PROCESS_ID environment; automatic on a Cloud TPU VM. It also points JAX at
the persistent compilation cache (`compile_cache.CompileCacheConfig`, or $ASEARCHER_COMPILE_CACHE;
"off" for none), so a re-run, a resumed life or another host reads compiled programs back.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from asearcher_jax.errors import AsearcherError, ConfigValueError

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
  "long-horizon": "asearcher_jax.apps.long_horizon:long_horizon",
  "inspect": "asearcher_jax.apps.inspect:inspect",
  "audit": "asearcher_jax.apps.audit:audit",
  "export": "asearcher_jax.apps.export:export",
  "plan": "asearcher_jax.apps.plan:plan",
  "compile": "asearcher_jax.apps.compile:compile_recipe",
  "sweep": "asearcher_jax.apps.sweep:sweep",
  "fetch": "asearcher_jax.apps.fetch:fetch",
}

# Commands that take another subcommand's whole command line: `asearcher rehearse --topology
# SLICE serve-model ...` configures that role as it would run and compiles its programs instead.
WRAPPERS = {"rehearse": "compile a role's programs for its TPU slice, as the role builds them"}

# Subcommands that need no accelerator: JAX runs on the CPU platform and the process never joins
# a multi-process program, whatever the environment says. On a pod the retrieval server runs on
# trainer worker 0 beside the trainer, which owns the chips and the slice's jax.distributed: a
# retrieval server that joined would wait for peers that never come and open a TPU the trainer
# needs (its encoder and BM25 want cores, not HBM). An export restores the whole policy unsharded
# into host memory, from one process; inspect and audit read a run's files. A subcommand that runs
# no model on an accelerator belongs here. (`sweep` does not: its points inherit its environment
# and train on the accelerator.)
CPU_ONLY = frozenset({"serve-retrieval", "index", "plan", "export", "inspect", "audit", "fetch"})

# Config classes this module builds through gin itself (`distributed_config`, `compile_cache_config`).
ROOT_CONFIGS = (
  "asearcher_jax.distributed:DistributedConfig",
  "asearcher_jax.compile_cache:CompileCacheConfig",
)

# Where gin files are looked up: the working directory, then the repository root, so the default
# files and their includes ('gin/models/x.gin', written from the root) resolve wherever the
# command runs. (gin's package-path reader would mistake a bare 'runs/x.gin' for a Python
# namespace package when a runs/ directory exists.)
_REPO_ROOT = Path(__file__).resolve().parents[1]
GIN_SEARCH_PATHS = (Path.cwd(), _REPO_ROOT)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# Libraries whose INFO/DEBUG chatter is not ours to show at the default level.
QUIET_LOGGERS = ("absl", "orbax", "jax._src.xla_bridge", "urllib3", "httpx", "httpx2", "filelock")


def _resolve(target: str) -> Callable[..., object]:
  module_name, fn_name = target.split(":")
  return getattr(importlib.import_module(module_name), fn_name)


def default_gin_file(subcommand: str) -> Path | None:
  path = _REPO_ROOT / "gin" / "runs" / f"{subcommand.replace('-', '_')}.gin"
  return path if path.exists() else None


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
  from asearcher_jax.apps import cli_help

  lines = [f"  {name:16} {cli_help.summary(target)}" for name, target in SUBCOMMANDS.items()]
  lines += [f"  {name:16} {summary}" for name, summary in WRAPPERS.items()]
  parser = argparse.ArgumentParser(
    prog="asearcher",
    description="asearcher_jax: train and evaluate LLM search agents with asynchronous RL.",
    epilog="subcommands (`asearcher SUBCOMMAND --help` lists its parameters):\n" + "\n".join(lines),
    formatter_class=argparse.RawDescriptionHelpFormatter,
    add_help=False,
  )
  parser.add_argument(
    "-h", "--help", action="store_true", help="show this help (or a subcommand's)"
  )
  parser.add_argument("subcommand", nargs="?", choices=sorted(SUBCOMMANDS), metavar="SUBCOMMAND")
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
  parser.add_argument(
    "--check",
    action="store_true",
    help="check the configuration (exit 2 on a mistake), run nothing",
  )
  parser.add_argument(
    "--check_programs", default="arguments", choices=("none", "arguments", "largest", "all"),
    help="with --check where libtpu is installed: what the rehearsal compiles for the recipe's "
    "slice (arguments: weights and state a chip, seconds; largest: the largest programs; all: "
    "every program; none: no rehearsal)",
  )  # fmt: skip
  parser.add_argument("--operative_config", help="write gin's operative config here after the run")
  parser.add_argument(
    "--log_level", default="INFO", type=str.upper, choices=LOG_LEVELS, metavar="LEVEL",
    help=f"one of {', '.join(LOG_LEVELS)} (default INFO)",
  )  # fmt: skip
  args = parser.parse_intermixed_args(argv)  # gin files may follow flags (`demo --check x.gin`)
  if args.subcommand is None:
    if args.help:
      parser.print_help()
      parser.exit(0)
    parser.error("a SUBCOMMAND is required")
  return args


def _help(subcommand: str, gin_files: Sequence[str]) -> str:
  from asearcher_jax.apps import cli_help

  if gin_files:
    found = [
      next((b / f for b in GIN_SEARCH_PATHS if (b / f).is_file()), Path(f)) for f in gin_files
    ]
    for name, path in zip(gin_files, found, strict=True):
      if not path.is_file():
        raise OSError(f"{name}: {'a directory, not a' if path.is_dir() else 'no such'} gin file")
    files = [p for f in found for p in cli_help.gin_includes(f, GIN_SEARCH_PATHS)]
  else:
    default = default_gin_file(subcommand)
    files = cli_help.gin_includes(default, GIN_SEARCH_PATHS) if default else []
  from asearcher_jax.apps import gin_config

  # The values a recipe given binds, shown in place of the code's defaults (a file that does
  # not parse still gets its help: the code's defaults, and `--check` names the mistake).
  bound = {}
  if gin_files:
    try:
      configure(subcommand, list(gin_files), [])
      bound = gin_config.bound_values()
    except (gin_config.ConfigError, AsearcherError, ValueError):
      pass
  return cli_help.command_help(
    subcommand, SUBCOMMANDS[subcommand], files, _REPO_ROOT, default=not gin_files, bound=bound
  )


def configure(subcommand: str, gin_files: Sequence[str], gin_params: Sequence[str]) -> Callable:
  """Parses and checks gin files and bindings; returns the configured subcommand function.
  Raises gin_config.ConfigError (one line naming the file:line or the flag) on any mistake."""
  import gin

  from asearcher_jax.apps import gin_config

  gin.clear_config()
  gin_config.use_package_paths(GIN_SEARCH_PATHS)
  files = list(gin_files)
  if not files and (default := default_gin_file(subcommand)) is not None:
    files = [str(default)]
  fn = _resolve(SUBCOMMANDS[subcommand])
  own = [target.split(":")[0] for target in ROOT_CONFIGS]  # flags may bind main's own configs
  file_macros = gin_config.parse(files, list(gin_params), fn, extra_modules=own)
  # Built through gin besides the subcommand: by `main` itself, or by another subcommand that
  # reads the same recipe (a train recipe also configures its serve-model processes).
  roots = {*ROOT_CONFIGS, *SUBCOMMANDS.values()}
  gin_config.check(fn, files, list(gin_params), roots=roots, file_macros=file_macros)
  try:
    return gin.get_configurable(fn)
  except ValueError:  # nothing binds it (no gin file, or files for other things): its defaults
    return fn


def distributed_config():
  """The gin-bound `DistributedConfig` (library defaults when no gin file binds it)."""
  import gin

  from asearcher_jax.distributed import DistributedConfig

  try:
    configured = gin.get_configurable(DistributedConfig)
  except ValueError:  # not in the gin registry: nothing binds it
    return DistributedConfig()
  return configured()  # a bad bound value raises (a config error), not the defaults


def compile_cache_config():
  """The gin-bound `CompileCacheConfig` (library defaults when no gin file binds it)."""
  import gin

  from asearcher_jax.compile_cache import CompileCacheConfig

  try:
    configured = gin.get_configurable(CompileCacheConfig)
  except ValueError:  # not in the gin registry: nothing binds it
    return CompileCacheConfig()
  return configured()


def _check_writable(flag: str, path: Path) -> None:
  from asearcher_jax.apps.gin_config import ConfigError

  if not str(path).strip() or str(path) == ".":
    raise ConfigError(f"{flag}= needs a file path (got an empty one)")
  for parent in path.parents:
    if parent.is_file():
      raise ConfigError(f"{flag}={path}: {parent} is a file, not a directory")
  if path.is_dir():
    raise ConfigError(f"{flag}={path}: is a directory, not a file")


def deep_check(subcommand: str, fn: Callable) -> None:
  """What `--check` adds to the configuration's own checks for a subcommand that configures
  others (a sweep: every point's): its module's `CHECK_KWARGS`, the arguments with which a call
  checks everything and runs nothing; the call's output is dropped. Raises AsearcherError."""
  import contextlib
  import io

  module = importlib.import_module(SUBCOMMANDS[subcommand].split(":")[0])
  kwargs = getattr(module, "CHECK_KWARGS", None)
  if kwargs is not None:
    with contextlib.redirect_stdout(io.StringIO()):
      fn(**kwargs)


def check_each(argvs: Sequence[Sequence[str]]) -> list[str | None]:
  """Checks several command lines (`asearcher` argv without the program) in this one process,
  as `--check` would one by one: None for one that is fine, else the line `--check` would end
  with. A sweep's points and a launched run's roles are checked so before anything starts: the
  imports are paid once (~3 s on 2 cores), each configuration then takes ~20 ms."""
  import contextlib
  import io

  from asearcher_jax.apps.gin_config import ConfigError

  out: list[str | None] = []
  for argv in argvs:
    command = argv[0] if argv else "?"
    usage = io.StringIO()
    try:
      with contextlib.redirect_stderr(usage), contextlib.redirect_stdout(io.StringIO()):
        args = _parse_args(list(argv))
    except SystemExit:  # argparse's usage error (or a --help): its last line says what
      lines = usage.getvalue().strip().splitlines() or [f"bad command line {list(argv)}"]
      out.append(lines[-1])
      continue
    try:
      fn = configure(args.subcommand, [*args.gin_files, *args.gin_file], args.gin_param)
      if args.operative_config is not None:
        _check_writable("--operative_config", Path(args.operative_config))
      deep_check(args.subcommand, fn)
    except (ConfigError, AsearcherError) as e:
      out.append(f"asearcher {command}: config error: {str(e).splitlines()[0]}")
      continue
    out.append(None)
  return out


def _check_each_main() -> int:
  """`asearcher --check-each`: one JSON argv list a line on stdin, one JSON line out for each
  (`null`, or the message `--check` would end with); exit 2 when any is a mistake."""
  import json

  argvs = []
  for n, line in enumerate(sys.stdin, 1):
    try:
      argv = json.loads(line) if line.strip() else []
    except json.JSONDecodeError:
      argv = None
    if not isinstance(argv, list) or not all(isinstance(x, str) for x in argv):
      print(
        f"asearcher --check-each: stdin line {n} is not a JSON list of strings", file=sys.stderr
      )
      return 2
    if argv:
      argvs.append(argv)
  results = check_each(argvs)
  for r in results:
    print(json.dumps(r))
  return 2 if any(results) else 0


def cpu_only() -> None:
  """This process and every process it starts (a retrieval server's workers) on the CPU
  platform: JAX's platform set before any backend starts (jax may already be imported by the
  gin files), and the environment for children."""
  import jax

  os.environ["JAX_PLATFORMS"] = "cpu"
  jax.config.update("jax_platforms", "cpu")


def rehearse_main(argv: Sequence[str]) -> int:
  """`asearcher rehearse --topology SLICE [--programs all|largest|arguments] ROLE ARGS...`: the
  role's command line (`serve-model ...`, `train ...`, `serve-retrieval ...`, as launch/roles.py
  writes it) configured exactly as it would run, then its programs compiled for SLICE instead
  of run (apps/rehearsal.py); one JSON line, exit 0 when every program fits, 1 when one does
  not, 2 for a configuration mistake. No jax.distributed, no compile cache: nothing runs."""
  if list(argv) == ["--each"]:
    return _rehearse_each()
  parser = argparse.ArgumentParser(prog="asearcher rehearse", description=rehearse_main.__doc__)
  parser.add_argument("--topology", required=True, help="the role's slice, e.g. v5p-8; cpu: none")
  parser.add_argument("--programs", default="all", help="all, largest or arguments")
  parser.add_argument("role", nargs=argparse.REMAINDER, help="the role's subcommand and flags")
  a = parser.parse_args(list(argv))
  if not a.role or a.role[0] not in SUBCOMMANDS:
    parser.error(f"a role's subcommand must follow the flags (one of {', '.join(SUBCOMMANDS)})")
  from asearcher_jax.apps import rehearsal
  from asearcher_jax.apps.gin_config import ConfigError

  logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  args = _parse_args(a.role)
  name = f"asearcher rehearse {args.subcommand}"
  try:
    target = rehearsal.Target(topology=a.topology, programs=a.programs)
    fn = configure(args.subcommand, [*args.gin_files, *args.gin_file], args.gin_param)
    t0 = time.perf_counter()
    with rehearsal.rehearsing(target):
      report = fn()
  except (ConfigError, AsearcherError) as e:
    print(f"{name}: config error: {str(e).splitlines()[0]}", file=sys.stderr)
    return 2
  if not isinstance(report, dict):
    print(f"{name}: error: {args.subcommand} has no rehearsal", file=sys.stderr)
    return 2
  return rehearsal.finish(report, t0)


def _rehearse_each() -> int:
  """`asearcher rehearse --each`: one JSON object a line on stdin ({"topology": T, "programs": P,
  "argv": [ROLE, ...]}), each role rehearsed in turn in this one process (the imports and
  libtpu's start paid once: a launch checks every role of a spec so); the role's JSON line, or
  {"error": "..."} for a configuration mistake, on stdout for each."""
  import contextlib
  import io
  import json

  for n, line in enumerate(sys.stdin, 1):
    if not line.strip():
      continue
    try:
      job = json.loads(line)
      argv = ["--topology", job["topology"], "--programs", job.get("programs", "all"), *job["argv"]]
    except (json.JSONDecodeError, KeyError, TypeError):
      print(f"asearcher rehearse --each: stdin line {n} is not a rehearsal job", file=sys.stderr)
      return 2
    out, err = io.StringIO(), io.StringIO()
    # SystemExit: argparse's usage error, whose last line on stderr says what
    with (
      contextlib.redirect_stdout(out),
      contextlib.redirect_stderr(err),
      contextlib.suppress(SystemExit),
    ):
      rehearse_main(argv)
    lines = [x for x in out.getvalue().splitlines() if x.startswith("{")]
    if lines:
      print(lines[-1], flush=True)
    else:
      said = (err.getvalue().strip().splitlines() or ["no report"])[-1]
      print(json.dumps({"error": said}), flush=True)
  return 0


def _fetch_argv(argv: list[str]) -> list[str]:
  """`asearcher fetch BUNDLE --to DEST`: the bundle (a positional that is not a gin file) and
  `--to` become fetch's bindings; the gin-bound form stays for scripts."""
  import json

  out: list[str] = []
  rest = iter(argv[1:])
  for arg in rest:
    if arg == "--to" or arg.startswith("--to="):
      dest = arg.partition("=")[2] if "=" in arg else next(rest, "")
      out.append(f"--gin_param=fetch.fetch.to={json.dumps(dest)}")
    elif arg in ("--gin_param", "--gin_file", "--log_level", "--operative_config"):
      out += [arg, next(rest, "")]  # a flag's value, not a bundle
    elif not arg.startswith("-") and not arg.endswith(".gin"):
      out.append(f"--gin_param=fetch.fetch.bundle={json.dumps(arg)}")
    else:
      out.append(arg)
  return ["fetch", *out]


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  from asearcher_jax import tpu_env

  # Before anything imports jax: libtpu (installed with the project) on a host without a TPU
  # would print its metadata-server warnings at start-up (asearcher_jax/tpu_env.py).
  tpu_env.quiet_libtpu()
  command = list(argv)  # as typed, for invocation.recorded
  overrides: dict = {}
  if argv[:1] == ["compile"]:
    # `asearcher compile RECIPE.gin --topology v5p-32 [--row_len N] [--attention A]`: JAX on
    # the CPU (no TPU is needed to compile for one); the flags become compile_recipe's arguments.
    tpu_env.for_ahead_of_time()
    from asearcher_jax.apps import compile as compiling

    rest, overrides = compiling.split_flags(argv[1:])
    argv = ["compile", *rest]
  if argv[:1] == ["fetch"]:
    argv = _fetch_argv(argv)
  if argv == ["--check-each"]:
    return _check_each_main()
  if "--check" in argv:
    # Nothing runs: JAX on the CPU, libtpu quiet, so the preflight's rehearsal compiles for the
    # recipe's slice as `asearcher rehearse` does.
    tpu_env.for_ahead_of_time()
  if argv[:1] == ["rehearse"]:
    tpu_env.for_ahead_of_time()  # like compile: JAX on the CPU, libtpu's compiler for the slice
    return rehearse_main(argv[1:])
  if argv[:1] == ["inspect"] and argv[1:2] and not argv[1].startswith("-"):
    # `asearcher inspect RUN_DIR [--episode ID | --question QID | --worst N]`: a positional run
    # directory, not a gin file (the gin-bound form stays for scripts).
    from asearcher_jax.apps import inspect

    return inspect.main(argv[1:])
  if argv[:1] == ["audit"] and argv[1:2] and not argv[1].startswith("-"):
    from asearcher_jax.apps import audit  # `asearcher audit RUN_DIR [--eta N]`: positional too

    return audit.main(argv[1:])
  args = _parse_args(argv)
  if args.help:
    try:
      text = _help(args.subcommand, [*args.gin_files, *args.gin_file])
    except (OSError, UnicodeDecodeError) as e:  # a gin file missing, a directory, not UTF-8
      print(f"asearcher {args.subcommand}: config error: {str(e).splitlines()[0]}",
            file=sys.stderr)  # fmt: skip
      return 2
    try:
      print(text, flush=True)
    except BrokenPipeError:  # `asearcher train --help | head`: the reader has what it wanted
      os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
  logging.basicConfig(
    level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
  )
  for noisy in QUIET_LOGGERS:
    logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
  from asearcher_jax.apps.gin_config import ConfigError

  try:
    fn = configure(args.subcommand, [*args.gin_files, *args.gin_file], args.gin_param)
    if args.operative_config is not None:
      _check_writable("--operative_config", Path(args.operative_config))
  except ConfigError as e:
    print(f"asearcher {args.subcommand}: config error: {e}", file=sys.stderr)
    return 2
  if args.check:
    from asearcher_jax.apps import preflight

    if args.print_config:
      import gin

      print(gin.config_str())
    try:
      deep_check(args.subcommand, fn)
      checked = preflight.preflight(
        args.subcommand, fn, files=[*args.gin_files, *args.gin_file], params=args.gin_param,
        overrides=overrides, programs=args.check_programs,
      )  # fmt: skip
    except (ConfigError, AsearcherError) as e:
      print(f"asearcher {args.subcommand}: config error: {str(e).splitlines()[0]}", file=sys.stderr)
      return 2
    for line in checked:
      print(f"asearcher {args.subcommand}: {line}")
    print(f"asearcher {args.subcommand}: configuration ok")
    return 0
  from asearcher_jax import compile_cache, distributed

  if args.subcommand in CPU_ONLY:
    cpu_only()
  try:
    compile_cache.enable(compile_cache_config())
    if args.subcommand not in CPU_ONLY:
      distributed.initialize(distributed_config())
  except ValueError as e:  # one line: gin appends "In call to configurable ..." lines
    print(f"asearcher {args.subcommand}: config error: {str(e).splitlines()[0]}", file=sys.stderr)
    return 2
  if args.print_config:
    import gin

    print(gin.config_str())
  from asearcher_jax.apps import invocation

  try:
    with invocation.recorded(command):  # what model cards and summaries print as their command
      result = fn(**overrides)
  except AsearcherError as e:
    # One line: gin appends "In call to configurable ..." lines to exceptions it passes through.
    message = str(e).splitlines()[0] if str(e) else type(e).__name__
    config = isinstance(e, ConfigValueError)
    print(f"asearcher {args.subcommand}: {'config error' if config else 'error'}: {message}",
          file=sys.stderr)  # fmt: skip
    return 2 if config else 1
  except OSError as e:
    # A path, address or port the system refused (a file where a directory must be, a port in
    # use, an unknown host): one line; the traceback is logged at DEBUG.
    logging.getLogger(__name__).debug("%s failed", args.subcommand, exc_info=True)
    message = str(e).splitlines()[0] if str(e) else type(e).__name__
    print(f"asearcher {args.subcommand}: error: {message} (--log_level DEBUG for where)",
          file=sys.stderr)  # fmt: skip
    return 1
  if args.operative_config:
    import gin

    Path(args.operative_config).parent.mkdir(parents=True, exist_ok=True)
    Path(args.operative_config).write_text(gin.operative_config_str())
  return int(result) if isinstance(result, int) else 0


if __name__ == "__main__":
  sys.exit(main())
