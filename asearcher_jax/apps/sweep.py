"""`asearcher sweep SWEEP.gin`: a grid (or list) of gin bindings run one after another, each in
its own run directory, and one results table merged from their summaries and metrics.

A sweep file binds `sweeping.sweep.*` (see gin/sweeps/quickstart_ci.gin):
  command        the subcommand every point runs ("train", "quickstart", ...; default "train")
  gin_files      the experiment (and overlays) every point starts from
  grid           {binding: (gin literal, ...)}: the cartesian product of the values
  points         ({binding: gin literal, ...}, ...): explicit points, after the grid's
  run_dir_param  the binding that sets a point's run directory (root/<point name>)
Every point is a separate `python -m asearcher_jax.main` process (its own XLA runtime; a point
that crashes does not take the sweep with it), and leaves in its run directory `command.json`
(the exact argv), `operative_config.gin` (gin's operative config of that run), its log and
`summary.json` (the command's own, else the JSON its last output line printed). A point whose
summary exists is not run again, so an interrupted sweep resumes. `parallel` points run at once.
The table (`results.md`, `results.jsonl` under root) has one row per point: its bindings, then
the chosen metrics from summary.json (the command's own figures: a quickstart's evaluation
scores), from the last row of metrics/metrics.jsonl ("last/" prefix) and, since one step's
figure of an RL run is noise, each metric's smoothed final value ("smooth/" prefix: the
debiased moving average TensorBoard draws, `plotting.smooth`, at the last step). `Table.curves`
names metrics.jsonl keys drawn for every point overlaid, one panel a key, in `curves.png`.

With `launch` (`Launch`: a launch TOML spec) every point is instead a launched run of that spec on
its backend ("local": the roles as processes on this machine; "gcloud": the spec's slices,
already up and set up, reused point after point; several specs are several slice sets, each
running its share of the points, all at once): `python -m launch start --run_dir D` with the
point's bindings as --gin_param, a wait for the trainer's end, `stop`, the trainer's summary
from `logs` and (gcloud) its metrics from `fetch` (asearcher_jax/apps/sweep_launch.py; gin/sweeps/recipe_tiny_launch.gin and
asearcher_local_7b_v5p.gin). A point whose launch fails is a failed row and the sweep goes on.
`dry_run` prints every point's commands and runs nothing. Either way every point's configuration
is checked first (one `asearcher --check-each` process): a mistake in any point stops the
sweep before the first starts.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from asearcher_jax import plotting
from asearcher_jax.apps import gin_config, sweep_launch
from asearcher_jax.errors import AsearcherError, ConfigValueError

# What `asearcher sweep S.gin --check` calls the sweep with (`main.deep_check`, its output
# dropped): a dry run checks every point's configuration and runs nothing.
CHECK_KWARGS = {"dry_run": True}


def expand(
  grid: Mapping[str, Sequence[str]], points: Sequence[Mapping[str, str]]
) -> list[dict[str, str]]:
  """The grid's cartesian product (in the grid's key order), then the explicit points."""
  keys = list(grid)
  for k in keys:
    if not isinstance(grid[k], list | tuple) or not grid[k]:
      raise ConfigValueError(
        f"sweeping.sweep.grid[{k!r}]: give a non-empty tuple of gin literals, got {grid[k]!r}"
      )
  for i, point in enumerate(points):
    if not isinstance(point, Mapping):
      raise ConfigValueError(
        f"sweeping.sweep.points[{i}]: give a dict of binding -> gin literal, got {point!r}"
      )
  out = (
    [dict(zip(keys, vals)) for vals in itertools.product(*(grid[k] for k in keys))] if keys else []
  )
  return out + [dict(p) for p in points]


def point_name(i: int, point: Mapping[str, str]) -> str:
  """p00-learning_rate=1e-4-max_staleness=0: the index, then each binding's last name=value."""
  parts = [f"{k.rsplit('.', 1)[-1]}={v}" for k, v in point.items()]
  slug = re.sub(r"[^A-Za-z0-9_.=-]+", "_", "-".join(parts))[:80]
  return f"p{i:02d}" + (f"-{slug}" if slug else "")


def _last_json(text: str) -> dict | None:
  for line in reversed(text.strip().splitlines()):
    if line.startswith("{"):
      try:
        return json.loads(line)
      except json.JSONDecodeError:
        return None
  return None


def _scalars(d: Mapping, prefix: str = "") -> dict:
  return {f"{prefix}{k}": v for k, v in d.items() if isinstance(v, int | float | str | bool)}


def run_point(
  argv: list[str], run_dir: Path, timeout_s: float
) -> tuple[dict | None, str]:  # fmt: skip
  """Runs one point (unless its summary exists); returns (summary, status)."""
  summary_path = run_dir / "summary.json"
  if summary_path.exists():
    return json.loads(summary_path.read_text()), "done before"
  run_dir.mkdir(parents=True, exist_ok=True)
  (run_dir / "command.json").write_text(json.dumps(argv, indent=1) + "\n")
  t0 = time.time()
  with open(run_dir / "sweep.log", "w") as log:
    try:
      r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=log, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
      return None, f"timed out after {timeout_s:.0f} s"
  (run_dir / "stdout.txt").write_text(r.stdout)
  if r.returncode:
    return None, f"exit {r.returncode} (see {run_dir / 'sweep.log'})"
  summary = json.loads(summary_path.read_text()) if summary_path.exists() else _last_json(r.stdout)
  if summary is None:
    return None, "no summary (the command printed no JSON line)"
  summary.setdefault("sweep_wall_s", round(time.time() - t0, 1))
  summary_path.write_text(json.dumps(summary, indent=2) + "\n")
  return summary, "ran"


def metric_rows(run_dir: Path) -> list[dict]:
  """A point's metrics.jsonl rows (its own, or a launched point's trainer's under train/), the
  last row of a step winning (a resumed run writes a step again); a torn last line skipped."""
  for metrics in (run_dir / "metrics" / "metrics.jsonl",
                  run_dir / "train" / "metrics" / "metrics.jsonl"):  # fmt: skip
    if metrics.exists():
      by_step: dict[int, dict] = {}
      for line in metrics.read_text().splitlines():
        try:
          row = json.loads(line)
        except json.JSONDecodeError:
          continue
        if isinstance(row, dict) and "step" in row:
          by_step[int(row["step"])] = row
      return [by_step[k] for k in sorted(by_step)]
  return []


def series(rows: Sequence[Mapping], key: str) -> list[tuple[float, float]]:
  """(step, value) of `key` over metric rows, where it is a finite number."""
  return [(float(r["step"]), float(r[key])) for r in rows
          if isinstance(r.get(key), int | float) and math.isfinite(r[key])]  # fmt: skip


def row_of(
  run_dir: Path,
  point: Mapping[str, str],
  summary: dict | None,
  status: str,
  smoothing: float = plotting.DEFAULT_SMOOTHING,
) -> dict:
  row = {"point": run_dir.name, **{k.rsplit(".", 1)[-1]: v for k, v in point.items()},
         "status": status}  # fmt: skip
  row.update(_scalars(summary or {}))
  rows = metric_rows(run_dir)
  if rows:
    row.update(_scalars(rows[-1], "last/"))
    keys = dict.fromkeys(k for r in rows for k in r if k not in ("step", "time"))
    for key in keys:
      if pts := series(rows, key):
        row[f"smooth/{key}"] = float(plotting.smooth([v for _, v in pts], smoothing)[-1])
  return row


def curves_png(path: Path, run_dirs: Sequence[Path], keys: Sequence[str], smoothing: float) -> None:
  """Every point's curve of each metric in `keys`, overlaid, one panel a key."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = {d.name: metric_rows(d) for d in run_dirs}
  panels = [(key, {name: pts for name, r in rows.items() if (pts := series(r, key))})
            for key in keys]  # fmt: skip
  fig = plotting.overlay_figure(panels, smoothing=smoothing)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def run_lanes(jobs: Sequence[Callable[[], tuple[dict | None, str]]], lanes: int) -> list[tuple]:
  """Runs the jobs on `lanes` threads, job i on lane i % lanes, each lane's jobs in order (a
  lane is one slice set, or one slot of `parallel`); returns their results in job order. A job
  that raises is a failed point, not a dead sweep."""
  results: list[tuple | None] = [None] * len(jobs)

  def lane(k: int) -> None:
    for i in range(k, len(jobs), lanes):
      try:
        results[i] = jobs[i]()
      except Exception as e:  # one point's crash is that point's row, not a dead sweep
        results[i] = (None, f"failed: {type(e).__name__}: {e}")

  threads = [threading.Thread(target=lane, args=(k,), name=f"sweep-lane-{k}")
             for k in range(min(lanes, len(jobs)))]  # fmt: skip
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return results  # type: ignore[return-value]


def markdown_table(rows: Sequence[Mapping], columns: Sequence[str]) -> str:
  """A markdown table of `columns` (missing values blank; floats to 4 significant digits)."""

  def cell(v) -> str:
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
  return "\n".join(lines)


def check_points(argvs: Sequence[Sequence[str]], names: Sequence[str]) -> None:
  """Every point's configuration checked (as `--check` would: parsed, type-checked, nothing
  run) before any point runs, so a typo in the grid's last point costs seconds, not the earlier
  points' hours. One `asearcher --check-each` process checks them all (its imports paid once:
  ~3 s, then ~20 ms a point). The first mistake is one line naming the point."""
  prefix = [sys.executable, "-m", "asearcher_jax.main"]
  for argv in argvs:
    if list(argv[: len(prefix)]) != prefix:
      raise ValueError(f"a point's argv must start with {prefix}, got {list(argv[:3])}")
  try:
    results = gin_config.check_elsewhere([a[len(prefix) :] for a in argvs])
  except AsearcherError as e:
    raise AsearcherError(f"sweep: {e}") from None
  bad = [(name, r) for name, r in zip(names, results, strict=True) if r]
  if bad:
    more = f" (and {len(bad) - 1} more points)" if len(bad) > 1 else ""
    raise ConfigValueError(f"sweep: {bad[0][0]}: {bad[0][1]}{more}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Table:
  """What the results table and the curves show."""

  # Columns after the bindings; () = every scalar of the first summary (and of the last metrics
  # row, "last/"). "smooth/<key>" is a metric's smoothed final value.
  metrics: tuple[str, ...] = ()
  # metrics.jsonl keys drawn in root/curves.png, every point overlaid; () = no figure.
  curves: tuple[str, ...] = ()
  # The moving average's weight of the smoothed columns and curves (0 = raw).
  smoothing: float = plotting.DEFAULT_SMOOTHING

  def __post_init__(self):
    if not 0.0 <= self.smoothing < 1.0:
      raise ConfigValueError(f"sweeping.Table.smoothing: a weight in [0, 1), got {self.smoothing}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Launch:
  """Points as launched runs (asearcher_jax/apps/sweep_launch.py) instead of local processes."""

  # A launch TOML spec (launch/specs/*.toml), or several (slice sets): point i runs on spec
  # i % len(specs), the specs' points at once.
  spec: str | tuple[str, ...]
  # "local" (the roles as processes on this machine, one spec) or "gcloud" (the spec's slices,
  # already `up` and `setup`).
  backend: str = "local"

  @property
  def specs(self) -> list[str]:
    return [self.spec] if isinstance(self.spec, str) else list(self.spec)


DEFAULT_TABLE = Table()


def sweep(
  *,
  command: str = "train",
  gin_files: Sequence[str] = (),
  grid: Mapping[str, Sequence[str]] | None = None,
  points: Sequence[Mapping[str, str]] = (),
  run_dir_param: str | None = None,
  root: str = "runs/sweep",
  table: Table = DEFAULT_TABLE,
  gin_params: Sequence[str] = (),
  timeout_s: float = 7200.0,
  parallel: int = 1,
  launch: Launch | None = None,
  dry_run: bool = False,
) -> int:
  """Runs every point and prints the merged table; 1 if any point failed.

  Args:
    command: the subcommand each point runs.
    gin_files / gin_params: what every point starts from (its own bindings come last).
    grid / points: see the module docstring.
    run_dir_param: the binding set to root/<point name> (None: the command has no run dir;
      its outputs are still kept there).
    root: where the points' run directories and the results go.
    table: the table's columns and the curves (`Table`).
    timeout_s: longest run of one point (launched: from `start` to the trainer's end).
    parallel: local process points run at once (each its own process; mind the cores).
    launch: every point a launched run (its trainer, servers and retrieval server; `command`
      must be "train"), see `Launch` and asearcher_jax/apps/sweep_launch.py. None: every point
      is a local process.
    dry_run: print every point's commands and run nothing.
  """
  todo = expand(grid or {}, points)
  if not todo:
    raise ConfigValueError("sweep: no points (bind sweeping.sweep.grid or sweeping.sweep.points)")
  if parallel < 1:
    raise ConfigValueError(f"sweeping.sweep.parallel: at least 1 point at a time, got {parallel}")
  out = Path(root)
  names = [point_name(i, p) for i, p in enumerate(todo)]
  specs = launch.specs if launch is not None else []
  backend = launch.backend if launch is not None else "local"
  if specs:  # a mistake is one line before any point starts
    if command != "train":
      raise ConfigValueError(
        f"sweeping.sweep.command: a launched point runs train, not {command!r}"
      )
    if backend == "local" and len(specs) > 1:
      raise ConfigValueError(
        "sweeping.Launch.spec: several specs run at once on separate slice sets; the local "
        "backend runs on this machine's ports, one point at a time: give one spec"
      )
    launched = [
      sweep_launch.launch_point(specs[i % len(specs)], backend, out, name,
                                [*gin_params, *(f"{k}={v}" for k, v in point.items())])
      for i, (name, point) in enumerate(zip(names, todo, strict=True))
    ]  # fmt: skip
    sweep_launch.check(launched, names)
  argvs = []
  for name, point in zip(names, todo, strict=True):
    run_dir = out / name
    argvs.append([sys.executable, "-m", "asearcher_jax.main", command,
            *(f"--gin_file={f}" for f in gin_files), *(f"--gin_param={p}" for p in gin_params),
            *(f"--gin_param={k}={v}" for k, v in point.items()),
            *([f"--gin_param={run_dir_param}={json.dumps(str(run_dir))}"] if run_dir_param else []),
            f"--operative_config={run_dir / 'operative_config.gin'}"])  # fmt: skip
  if not specs:
    check_points(argvs, names)
  run_dirs = [out / name for name in names]
  if dry_run:
    for i, run_dir in enumerate(run_dirs):
      lines = sweep_launch.plan(launched[i], timeout_s) if specs else [shlex.join(argvs[i])]
      print("\n".join(f"sweep: {run_dir.name}: {c}" for c in lines))
    return 0

  def job(i: int) -> Callable[[], tuple[dict | None, str]]:
    def go() -> tuple[dict | None, str]:
      where = f" (launch {backend}, {Path(launched[i].spec).name})" if specs else ""
      print(f"sweep: {names[i]}{where} ...", flush=True)
      if specs:
        result = sweep_launch.run(launched[i], run_dirs[i], timeout_s)
      else:
        result = run_point(argvs[i], run_dirs[i], timeout_s)
      print(f"sweep: {names[i]} {result[1]}", flush=True)
      return result

    return go

  results = run_lanes([job(i) for i in range(len(todo))], len(specs) or parallel)
  rows = [row_of(d, p, summary, status, table.smoothing)
          for d, p, (summary, status) in zip(run_dirs, todo, results, strict=True)]  # fmt: skip
  keys = [k.rsplit(".", 1)[-1] for k in dict.fromkeys(k for p in todo for k in p)]
  first = next((r for r in rows if r["status"] != "failed"), rows[0])
  chosen = list(table.metrics) or [
    k for k in first if k not in {"point", "status", *keys} and not k.startswith("smooth/")
  ]
  text = markdown_table(rows, ["point", *keys, *chosen, "status"])
  out.mkdir(parents=True, exist_ok=True)
  (out / "results.md").write_text(text + "\n")
  (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  if table.curves:
    curves_png(out / "curves.png", run_dirs, table.curves, table.smoothing)
  print(text, flush=True)
  return 0 if all(r["status"] in ("ran", "done before") for r in rows) else 1
