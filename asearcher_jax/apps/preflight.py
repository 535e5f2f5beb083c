"""`asearcher SUBCOMMAND ... --check`: the preflight, what a run needs besides a well-formed configuration, checked before anything is paid for.

The configuration's own checks (apps/gin_config.py: names, types, values) pass a recipe whose
model, questions and index are on no disk, a slice no compiler knows, a dataset that does not
exist, or a trainer the plan already says will not fit; each of those surfaced hours later on
the slice. Here, in order, each a `ConfigError` line naming the binding or the path:
  paths      every input path the configuration binds (`INPUT_PATHS`: models, tokenizers,
             questions, corpora, indexes, warm starts) exists here, local or gs:// (through
             etils.epath, with a timeout); a path inside the run's own output directory is
             made by the run and not checked;
  datasets   every evaluation dataset is shipped, a file, or a directory under data_dir;
  slices     a named topology is a known slice (`v5litepod-16` and `v5e-16` both), the plan's
             chip a known chip, and the recipe's trainer and serving slices exist;
  fit        the planner's memory per chip (rl/plan_memory.py) for the recipe's trainer and
             serving replica fits its chip (train and serve-model);
  rehearsal  where libtpu is installed and the recipe names a TPU slice, the role's programs
             handed to `asearcher rehearse` (apps/rehearsal.py) for that slice: "arguments"
             (weights, optimizer state and caches a chip; seconds) unless `--check_programs`
             asks for more.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import io
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from asearcher_jax.apps import gin_config
from asearcher_jax.apps.gin_config import ConfigError
from asearcher_jax.errors import AsearcherError

# The parameters that name what a run reads, by (module, qualified name) of the function or
# config class that takes them. Outputs (run_dir, out_dir, an index build's index_dir) are not
# here: the run makes them.
INPUT_PATHS: dict[tuple[str, str], tuple[str, ...]] = {
  ("asearcher_jax.apps.train", "train"): (
    "model_dir", "tokenizer_dir", "questions", "retrieval_index_dir",
  ),
  ("asearcher_jax.model.loading", "PolicyConfig"): ("model_dir", "tokenizer_dir"),
  ("asearcher_jax.apps.serve_retrieval", "serve"): ("index_dir",),
  ("asearcher_jax.apps.index", "build_index"): ("corpus", "pages_file"),
  ("asearcher_jax.apps.synth", "SeedSource"): (
    "corpus_files", "pages_file", "links_file", "seed_qa_file",
  ),
  ("asearcher_jax.apps.long_horizon", "long_horizon"): ("warm_start_dir",),
  ("asearcher_jax.apps.quickstart", "quickstart"): ("warm_start_dir",),
  ("asearcher_jax.apps.demo", "run"): ("model_dir", "tokenizer_dir"),
  ("asearcher_jax.apps.evaluate", "EvalData"): ("data_dir",),
  ("asearcher_jax.apps.export", "export"): ("model_dir",),
}  # fmt: skip

# The run's own output directories: an input inside one is made by an earlier stage of the run.
OUTPUT_DIRS = ("run_dir", "out_dir", "output_dir", "workdir")

# Longest wait for a gs:// path's existence (a bucket that does not answer is a failure).
REMOTE_TIMEOUT_S = 30.0

# Subcommands whose run the recipe's plan describes (its fit is checked, and rehearsed), and
# the role each one is: the slice its programs run on.
ROLES = {"train": "trainer", "serve-model": "serving"}

# What `--check` rehearses where libtpu is installed ("none": no rehearsal).
CHECK_PROGRAMS = ("none", "arguments", "largest", "all")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Binding:
  """One bound parameter, its macros resolved."""

  # The full gin selector, e.g. 'asearcher_jax.apps.commands.train'.
  selector: str
  # The parameter, e.g. 'model_dir'.
  name: str
  # The value the run gets.
  value: Any
  # The object the selector names (function or class); None where it does not resolve.
  target: Any


def _bindings() -> list[Binding]:
  return [
    Binding(selector=s, name=n, value=v, target=gin_config._resolve(s))
    for s, n, v in gin_config.bindings()
  ]


def _key(obj: Any) -> tuple[str, str]:
  return getattr(obj, "__module__", ""), getattr(obj, "__qualname__", "")


def _short(b: Binding) -> str:
  return f"{'.'.join(b.selector.split('.')[-2:])}.{b.name}"


def _paths(value: Any) -> list[str]:
  if isinstance(value, str | Path) and str(value).strip():
    return [str(value)]
  if isinstance(value, list | tuple):
    return [p for v in value for p in _paths(v)]
  return []


def exists(path: str, timeout_s: float = REMOTE_TIMEOUT_S) -> bool:
  """Whether `path` exists, local or remote (gs://, through etils.epath); a remote store that
  does not answer within `timeout_s` raises AsearcherError naming it."""
  if "://" not in path:
    return Path(path).expanduser().exists()
  from etils import epath

  pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
  try:
    return bool(pool.submit(lambda: epath.Path(path).exists()).result(timeout=timeout_s))
  except concurrent.futures.TimeoutError:
    raise AsearcherError(f"{path}: no answer within {timeout_s:.0f} s") from None
  except Exception as e:  # credentials, an unknown bucket: the store's own words
    raise AsearcherError(
      f"{path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    ) from None
  finally:
    pool.shutdown(wait=False)


def _made_by_run(path: str, outputs: Sequence[str]) -> bool:
  p = Path(path).expanduser()
  return any(p == Path(o).expanduser() or Path(o).expanduser() in p.parents for o in outputs)


def check_paths(bindings: Sequence[Binding], where: Callable[[Binding], str]) -> int:
  """Every input path exists here; returns how many were checked. Raises ConfigError."""
  outputs = [str(b.value) for b in bindings if b.name in OUTPUT_DIRS and _paths(b.value)]
  checked = 0
  for b in bindings:
    if b.name not in INPUT_PATHS.get(_key(b.target), ()):
      continue
    for path in _paths(b.value):
      if _made_by_run(path, outputs):
        continue
      try:
        found = exists(path)
      except AsearcherError as e:
        raise ConfigError(f"{where(b)}: {_short(b)} = {path!r}: {e}") from None
      if not found:
        hint = "build it with `asearcher index`" if "index" in b.name else "copy or mount it"
        raise ConfigError(
          f"{where(b)}: {_short(b)} = {path!r} does not exist on this host ({hint})"
        )
      checked += 1
  return checked


def check_datasets(bindings: Sequence[Binding], where: Callable[[Binding], str]) -> int:
  """Every evaluation dataset named exists; returns how many. Raises ConfigError."""
  from asearcher_jax.apps.evaluate import EvalData
  from asearcher_jax.data.qa import dataset_problem

  checked = 0
  data_dirs = {
    b.selector: b.value for b in bindings if b.target is EvalData and b.name == "data_dir"
  }
  for b in bindings:
    if b.target is not EvalData or b.name != "datasets":
      continue
    for spec in [b.value] if isinstance(b.value, str) else list(b.value or ()):
      if problem := dataset_problem(str(spec), data_dir=data_dirs.get(b.selector)):
        raise ConfigError(f"{where(b)}: {_short(b)}: {problem}")
      checked += 1
  return checked


def _plan_bound(bindings: Sequence[Binding]) -> Binding | None:
  """The recipe's `planning.plan.chip` binding (None where it binds no plan)."""
  from asearcher_jax.apps import plan as planning

  return next((b for b in bindings if b.target is planning.plan and b.name == "chip"), None)


def check_slices(
  bindings: Sequence[Binding], where: Callable[[Binding], str], overrides: Mapping[str, Any]
) -> dict[str, str]:
  """A named topology is a known slice (either spelling) and the plan's chip a known chip;
  returns the recipe's slices by role ({"trainer": "v5p-32", "serving": "v5p-8"}) where its
  plan names a TPU chip. Raises ConfigError."""
  from asearcher_jax.apps import compile as compiling
  from asearcher_jax.rl import aot
  from asearcher_jax.rl import plan_memory as mem

  if (name := overrides.get("topology")) is not None:
    try:
      aot.tpu_slice(name)
    except AsearcherError as e:
      raise ConfigError(f"--topology {name}: {e}") from None
  for b in bindings:
    if b.target is compiling.compile_recipe and b.name == "topology" and b.value is not None:
      try:
        aot.tpu_slice(b.value)
      except AsearcherError as e:
        raise ConfigError(f"{where(b)}: {_short(b)}: {e}") from None
  chip = _plan_bound(bindings)
  if chip is None:
    return {}
  if mem.chip_name(str(chip.value)) not in mem.CHIPS:
    raise ConfigError(
      f"{where(chip)}: {_short(chip)}: unknown chip {chip.value!r} (known: {', '.join(mem.CHIPS)})"
    )
  if not any(s.startswith(f"{mem.chip_name(chip.value)}-") for s in aot.SLICES):
    return {}  # a GPU plan: no TPU slice to name
  recipe = compiling.recipe_from_gin()
  out = {}
  for role, shape in (("trainer", recipe.trainer), ("serving", recipe.serving)):
    try:
      out[role] = aot.slice_for(recipe.chip, shape.chips).name
    except AsearcherError as e:
      raise ConfigError(f"{where(chip)}: the plan's {role} ({shape.chips} chips): {e}") from None
  return out


def check_fit(subcommand: str, bindings: Sequence[Binding], where: Callable[[Binding], str]) -> str:
  """The planner's memory per chip for the recipe's trainer and serving replica (serve-model:
  the replica alone) fits the plan's chip; returns a summary. Raises ConfigError."""
  from asearcher_jax.apps import compile as compiling
  from asearcher_jax.rl import plan_memory as mem

  chip = _plan_bound(bindings)
  if chip is None or subcommand not in ROLES:
    return ""
  try:
    recipe = compiling.recipe_from_gin()
  except AsearcherError:  # no policy bound: nothing to size
    return ""
  parts = [("serving", mem.serving_memory(recipe.model, recipe.serving)["total"], recipe.serving)]
  if subcommand == "train":
    trainer = mem.trainer_memory(recipe.model, recipe.trainer)["total"]
    parts.insert(0, ("trainer", trainer, recipe.trainer))
  said = []
  hbm = mem.CHIPS[recipe.chip].hbm_gb
  for role, total, shape in parts:
    if not mem.fits(total)[recipe.chip]:
      raise ConfigError(
        f"{where(chip)}: the plan's {role} needs {mem.gb(total)} GB a chip on {shape.chips} "
        f"{recipe.chip} chips of {hbm:g} GB (`asearcher plan` shows its parts): more chips, "
        "fewer slots or shorter rows"
      )
    said.append(f"{role} {mem.gb(total)} of {hbm:g} GB")
  return f"plan fits {recipe.chip} ({', '.join(said)})"


def rehearse(
  subcommand: str, fn: Callable[..., Any], slices: Mapping[str, str], programs: str,
  overrides: Mapping[str, Any],
) -> str:  # fmt: skip
  """The role's programs handed to the rehearsal for its slice (apps/rehearsal.py) where
  libtpu is installed; returns a summary ("" where nothing was rehearsed). Raises ConfigError
  for a role that does not fit."""
  from asearcher_jax import tpu_env

  role = ROLES.get(subcommand)
  if programs == "none" or role not in slices or not tpu_env.libtpu_installed():
    return ""
  from asearcher_jax.apps import rehearsal

  target = rehearsal.Target(topology=slices[role], programs=programs)
  with rehearsal.rehearsing(target), contextlib.redirect_stdout(io.StringIO()):
    report = fn(**overrides)
  if not isinstance(report, dict):
    return ""
  if not report["fits"]:
    worst = next((r for r in report.get("program_reports", []) if not r.get("fits")), {})
    name = worst.get("name") or report.get("largest_program") or "its programs"
    raise ConfigError(
      f"the rehearsal ({programs}) of the {role} on {target.topology}: {name} needs "
      f"{worst.get('total_gib', report.get('hbm_gib_per_chip_max'))} GiB a chip of "
      f"{report.get('hbm_gib_per_chip', '?')} (`asearcher rehearse` shows every program)"
    )
  gib = report.get("hbm_gib_per_chip_max")
  if gib is None:  # "arguments": what lies on a chip before any program runs
    gib = report.get("train_state_gib", report.get("arguments_gib_per_chip"))
  return f"rehearsal ({programs}) fits {target.topology}: {gib} GiB a chip"


def preflight(
  subcommand: str,
  fn: Callable[..., Any],
  *,
  files: Sequence[str],
  params: Sequence[str],
  overrides: Mapping[str, Any] | None = None,
  programs: str = "arguments",
) -> list[str]:
  """Runs every check of the module docstring on the parsed configuration (gin must hold the
  subcommand's); returns what was checked, a line each. Raises ConfigError (one line)."""
  if programs not in CHECK_PROGRAMS:
    raise ConfigError(
      f"--check_programs must be one of {', '.join(CHECK_PROGRAMS)}, got {programs!r}"
    )
  overrides = dict(overrides or {})
  bindings = _bindings()

  def where(b: Binding) -> str:
    return gin_config.locate(b.selector, b.name, files, params)

  n = check_paths(bindings, where)
  said = [
    f"input paths: {n} bound, all exist" if n else "input paths: none bound (the package's own)"
  ]
  if n := check_datasets(bindings, where):
    said.append(f"{n} dataset(s) known")
  slices = check_slices(bindings, where, overrides)
  if slices:
    said.append("slices " + ", ".join(f"{r} {s}" for r, s in slices.items()))
  if line := check_fit(subcommand, bindings, where):
    said.append(line)
  try:
    if line := rehearse(subcommand, fn, slices, programs, overrides):
      said.append(line)
  except AsearcherError as e:
    raise ConfigError(f"the rehearsal: {str(e).splitlines()[0]}") from None
  return said
