"""`asearcher plan RECIPE` and `asearcher sweep SWEEP.gin` through the real entry point."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import gin
import pytest

from asearcher_jax import main as cli
from asearcher_jax.apps import sweep as sweeping

REPO = Path(__file__).resolve().parents[2]
RECIPES = [  # the training recipes (the eval_*.gin ones configure `asearcher eval`, no plan)
  *sorted(
    p
    for p in (REPO / "gin" / "experiments").glob("*_qwen2_5_*.gin")
    if not p.stem.startswith("eval_")
  ),
  REPO / "gin" / "experiments" / "asearcher_web_qwq_32b.gin",
]


def run_main(argv: list[str]) -> tuple[int, str]:
  gin.clear_config()
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    rc = cli.main(argv)
  gin.clear_config()
  return rc, out.getvalue()


# The 7B recipe in the fast tier; the others (~7 s each) in the slow one.
@pytest.mark.parametrize(
  "recipe",
  [r if "asearcher_local_qwen2_5_7b" in r.stem else pytest.param(r, marks=pytest.mark.slow)
   for r in RECIPES],
  ids=lambda p: p.stem,
)  # fmt: skip
def test_plan_of_every_recipe(recipe):
  rc, out = run_main(["plan", str(recipe.relative_to(REPO))])
  p = json.loads(out.strip().splitlines()[-1])
  assert rc == (0 if p["trainer_fits"]["v5p"] and p["serving_fits"]["v5p"] else 1)
  t = p["trainer_gb_per_chip"]
  assert t["total"] == pytest.approx(sum(v for k, v in t.items() if k != "total"), abs=0.05)
  assert p["speedup_async_vs_sync"] >= 1.0 and p["train_step_s"] > 0
  # The recipe headers quote the planner; a figure that drifts must be updated there.
  header = recipe.read_text().split("from __gin__")[0]
  assert f"{t['total']} GB" in header, (t["total"], header)
  assert f"{p['serving_gb_per_chip']['total']} GB" in header


def test_sweep_expansion_names_and_table():
  pts = sweeping.expand({"a.b.lr": ("1e-4", "3e-4"), "c.eta": ("0", "4")}, [{"c.eta": "8"}])
  assert pts == [
    {"a.b.lr": "1e-4", "c.eta": "0"}, {"a.b.lr": "1e-4", "c.eta": "4"},
    {"a.b.lr": "3e-4", "c.eta": "0"}, {"a.b.lr": "3e-4", "c.eta": "4"}, {"c.eta": "8"},
  ]  # fmt: skip
  assert sweeping.point_name(3, pts[3]) == "p03-lr=3e-4-eta=4"
  assert sweeping.point_name(1, {"x.s": '"a b/c"'}) == "p01-s=_a_b_c_"
  with pytest.raises(Exception, match="non-empty tuple"):
    sweeping.expand({"a": "1e-4"}, [])
  t = sweeping.markdown_table([{"point": "p0", "x": 0.123456, "y": None}], ["point", "x", "y"])
  assert t.splitlines()[2] == "| p0 | 0.1235 |  |"


@pytest.mark.slow
def test_sweep_of_plans_runs_points_as_processes_and_resumes(tmp_path):
  """A 2 x 2 grid of `asearcher plan` (seconds per point): each point a process with its own
  operative config, the table from their JSON lines; a rerun runs nothing again."""
  sweep_file = tmp_path / "s.gin"
  sweep_file.write_text(f"""
from __gin__ import dynamic_registration
from asearcher_jax.apps import sweep as sweeping
sweeping.sweep.command = "plan"
sweeping.sweep.gin_files = ("{REPO}/gin/experiments/asearcher_local_qwen2_5_7b.gin",)
sweeping.sweep.root = "{tmp_path}/runs"
sweeping.sweep.grid = {{
  "plan_memory.TrainerShape.chips": ("16", "64"),
  "plan_memory.TrainerShape.row_len": ("4096", "8192"),
}}
sweeping.sweep.table = @sweeping.Table()
sweeping.Table.metrics = ("train_step_s", "speedup_async_vs_sync")
""")
  rc, out = run_main(["sweep", str(sweep_file)])
  assert rc == 0, out
  rows = [json.loads(x) for x in (tmp_path / "runs" / "results.jsonl").read_text().splitlines()]
  assert [r["point"] for r in rows] == [
    "p00-chips=16-row_len=4096", "p01-chips=16-row_len=8192",
    "p02-chips=64-row_len=4096", "p03-chips=64-row_len=8192",
  ]  # fmt: skip
  assert all(r["status"] == "ran" for r in rows)
  # More chips: a shorter step; the operative config names the point's own binding.
  assert rows[2]["train_step_s"] < rows[0]["train_step_s"]
  op = (tmp_path / "runs" / rows[3]["point"] / "operative_config.gin").read_text()
  assert "TrainerShape.row_len = 8192" in op and "TrainerShape.chips = 64" in op
  assert "| p03-chips=64-row_len=8192 | 64 | 8192 |" in out
  rc, out = run_main(["sweep", str(sweep_file)])
  assert rc == 0 and out.count("| done before |") == 4


@pytest.mark.slow
def test_a_mistake_in_any_point_stops_the_sweep_before_the_first_runs(tmp_path, capsys):
  """A typo in the last point (or two) is one config error naming the first bad point, found by
  one checking process before any point runs (also under dry_run): nothing runs, no point's
  directory is made."""
  sweep_file = tmp_path / "s.gin"
  sweep_file.write_text(f"""
from __gin__ import dynamic_registration
from asearcher_jax.apps import sweep as sweeping
sweeping.sweep.command = "plan"
sweeping.sweep.gin_files = ("{REPO}/gin/experiments/asearcher_local_qwen2_5_7b.gin",)
sweeping.sweep.root = "{tmp_path}/runs"
sweeping.sweep.grid = {{"plan_memory.TrainerShape.chips": ("16", "64")}}
sweeping.sweep.points = ({{"plan_memory.TrainerShape.row_lenn": "4096"}},)
""")
  for extra in ([], ["--gin_param=sweeping.sweep.dry_run=True"], ["--check"]):
    rc, out = run_main(["sweep", str(sweep_file), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and "sweep: p0" not in out, out
    assert err.startswith(
      "asearcher sweep: config error: sweep: p02-row_lenn=4096: asearcher plan:"
    )
    assert "row_lenn" in err and err.count("\n") == 1 and "more points" not in err
  assert not (tmp_path / "runs").exists()
  two = sweep_file.read_text().replace('("16", "64")', '("16", "sixty-four")')
  sweep_file.write_text(two)
  rc, _ = run_main(["sweep", str(sweep_file)])
  err = capsys.readouterr().err
  assert rc == 2 and "sweep: p01-chips=sixty-four:" in err and "(and 1 more points)" in err


def test_the_shipped_quickstart_sweep_is_a_two_by_two_grid():
  """gin/sweeps/quickstart_ci.gin as shipped expands to learning rate x eta, four points."""
  gin.clear_config()
  gin.parse_config_file(str(REPO / "gin" / "sweeps" / "quickstart_ci.gin"))
  grid = gin.query_parameter("sweeping.sweep.grid")
  gin.clear_config()
  names = [sweeping.point_name(i, p) for i, p in enumerate(sweeping.expand(grid, []))]
  assert names == [
    "p00-learning_rate=1e-4-max_staleness=0", "p01-learning_rate=1e-4-max_staleness=4",
    "p02-learning_rate=3e-4-max_staleness=0", "p03-learning_rate=3e-4-max_staleness=4",
  ]  # fmt: skip


@pytest.mark.slow
def test_sweep_of_the_ci_sized_quickstart(tiny_run):
  """gin/sweeps/quickstart_ci.gin with its grid cut to one point (the full 2 x 2 table is in
  docs/measurements.md; several points, resume and the merged table are the plan sweep's test):
  the point ran as a quickstart process and its summary landed in the table. The session's tiny
  run is that sweep (tests/notebooks/tiny_run.py), so the CI-size quickstart runs once."""
  root = tiny_run / "sweep"
  out = (tiny_run / "sweep_stdout.txt").read_text()
  table = out[out.index("| point |") :].splitlines()
  assert table[0] == "| point | max_staleness | avg4_sft | avg4_rl | pass4_rl | wall_s | status |"
  assert len(table) == 2 + 1 and table[2].endswith("| ran |")
  rows = [json.loads(x) for x in (root / "results.jsonl").read_text().splitlines()]
  assert [r["point"] for r in rows] == ["p00-max_staleness=4"]
  for r in rows:
    assert 0.0 <= r["avg4_rl"] <= 1.0 and r["wall_s"] > 0
    op = (root / r["point"] / "operative_config.gin").read_text()
    assert f"StalenessConfig.max_staleness = {r['point'][-1]}" in op


@pytest.mark.slow
def test_sweep_compares_three_training_points_run_two_at_once(tmp_path):
  """Three short CPU training runs, two at a time (log-probs over 128-position chunks: the whole
  152k-vocabulary logits of a row peak at 9 GB a run, 2.9 GB chunked, so two fit beside another
  test): the table holds each point's smoothed final
  metrics (the moving average at its last step, from its own metrics.jsonl) beside the last raw
  row, and curves.png overlays the three runs' curves."""
  sweep_file = tmp_path / "s.gin"
  sweep_file.write_text(f"""
from __gin__ import dynamic_registration
from asearcher_jax.apps import sweep as sweeping
sweeping.sweep.command = "train"
sweeping.sweep.gin_params = ("train_config.TrainConfig.train_steps=3",
                             "presets.model_config.logits_chunk=128")
sweeping.sweep.run_dir_param = "commands.train.run_dir"
sweeping.sweep.root = "{tmp_path}/runs"
sweeping.sweep.grid = {{"steps.OptimizerConfig.learning_rate": ("1e-5", "1e-4", "1e-3")}}
sweeping.sweep.parallel = 2
sweeping.sweep.table = @sweeping.Table()
sweeping.Table.curves = ("ppo/loss", "rollout/reward")
sweeping.Table.metrics = ("reward", "smooth/rollout/reward", "last/rollout/reward")
""")
  rc, out = run_main(["sweep", str(sweep_file)])
  assert rc == 0, out
  root = tmp_path / "runs"
  rows = [json.loads(x) for x in (root / "results.jsonl").read_text().splitlines()]
  assert [r["point"] for r in rows] == [
    "p00-learning_rate=1e-5", "p01-learning_rate=1e-4", "p02-learning_rate=1e-3",
  ]  # fmt: skip
  spans = []  # (start, end) of each point's run, from the files it wrote first and last
  for r in rows:
    assert r["status"] == "ran"
    metrics = sweeping.metric_rows(root / r["point"])
    assert [m["step"] for m in metrics] == [1, 2, 3]
    rewards = [m["rollout/reward"] for m in metrics if "rollout/reward" in m]
    # The smoothed column is the debiased moving average of the point's own curve, not its
    # last raw value (which is the last/ column).
    want = sweeping.plotting.smooth(rewards)[-1]
    assert r["smooth/rollout/reward"] == pytest.approx(want)
    assert r["last/rollout/reward"] == pytest.approx(rewards[-1])
    assert "step 3" in (root / r["point"] / "sweep.log").read_text()
    spans.append(((root / r["point"] / "command.json").stat().st_mtime,
                  (root / r["point"] / "summary.json").stat().st_mtime))  # fmt: skip
  # Two at once: the second point started before the first ended, the third only after one of
  # them ended; the printed table holds the smoothed column.
  assert spans[1][0] < spans[0][1] and spans[2][0] >= min(spans[0][1], spans[1][1]) - 1.0
  header = out[out.index("| point |") :].splitlines()[0]
  assert header == (
    "| point | learning_rate | reward | smooth/rollout/reward | last/rollout/reward | status |"
  )
  png = root / "curves.png"
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
  lane = {line.split()[1] for line in out.splitlines() if line.endswith(" ...")}
  assert lane == {r["point"] for r in rows}


def test_sweep_lanes_run_points_at_once_in_order_per_lane():
  """`run_lanes`: job i on lane i % lanes, lanes concurrent, each lane in order; a job that
  raises is its own failed row."""
  import threading
  import time

  started: list[tuple[int, float]] = []
  lock = threading.Lock()
  barrier = threading.Barrier(2, timeout=10)

  def job(i):
    def go():
      with lock:
        started.append((i, time.monotonic()))
      if i < 2:
        barrier.wait()  # jobs 0 and 1 can only pass together: two lanes at once
      if i == 3:
        raise RuntimeError("boom")
      return {"i": i}, "ran"

    return go

  results = sweeping.run_lanes([job(i) for i in range(5)], 2)
  assert [r[0] for r in results[:3]] == [{"i": 0}, {"i": 1}, {"i": 2}]
  assert results[3] == (None, "failed: RuntimeError: boom") and results[4][1] == "ran"
  order = [i for i, _ in sorted(started, key=lambda x: x[1])]
  assert order.index(0) < order.index(2) < order.index(4)  # lane 0 in order
  assert order.index(1) < order.index(3)  # lane 1 in order


@pytest.mark.slow  # > 10 s: the fast tier stays under 5 minutes
def test_plan_of_the_8_gpu_host_knows_h100_and_h200():
  """gin/overlays/gpu_8x.gin on the 7B recipe: the learner on 4 GPUs and 2 replicas of 2 fit an
  H100's 80 GB and an H200's 141 GB; the H200's bandwidth (4.8 against 3.35 TB/s) shortens the
  decode step in that ratio (both at the same 989 bf16 TFLOP/s: the same train step)."""
  recipe = "gin/experiments/asearcher_local_qwen2_5_7b.gin"
  plans = {}
  for chip in ("h100", "H200"):  # the chip as written either way
    rc, out = run_main(["plan", recipe, "--gin_file=gin/overlays/gpu_8x.gin",
                        f"--gin_param=planning.plan.chip='{chip}'"])  # fmt: skip
    plans[chip.lower()] = p = json.loads(out.strip().splitlines()[-1])
    assert rc == 0 and p["chip"] == chip.lower()
    assert p["trainer_fits"][chip.lower()] and p["serving_fits"][chip.lower()]
  h100, h200 = plans["h100"], plans["h200"]
  assert 30 < h100["trainer_gb_per_chip"]["total"] < 0.9 * 80  # 4-way FSDP of a 7B learner
  assert h100["trainer_gb_per_chip"]["total"] > 0.9 * 16  # a v5e chip could not hold it
  assert not h100["trainer_fits"]["v5e"]
  assert h200["weights_only"]["decode_token_ms"] / h100["weights_only"]["decode_token_ms"] == (
    pytest.approx(3350 / 4800, rel=0.02)
  )
  assert h200["train_step_s"] == h100["train_step_s"]
  assert h200["async_step_s"] < h100["async_step_s"]
