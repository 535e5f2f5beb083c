"""`asearcher audit RUN_DIR`: a readable report and one JSON object on its last line; exit 0 for
a consistent run, 1 when the audit finds a problem, 2 (one line) for a path that is no run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asearcher_jax import main
from asearcher_jax.rl.replay import CONSUMED_LOG
from tests.rl.test_trainer_e2e import run_stub_trainer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def stub_run(tmp_path):
  run_stub_trainer(tmp_path / "run", steps=4, groups=6)
  return tmp_path / "run"


def _last_json(out: str) -> dict:
  return json.loads(out.strip().splitlines()[-1])


def test_a_consistent_run_exits_0_with_a_report_and_json(stub_run, capsys):
  assert main.main(["audit", str(stub_run), "--eta", "3"]) == 0
  out = capsys.readouterr().out
  assert "groups pushed" in out and "consistent" in out
  summary = _last_json(out)
  assert summary["consistent"] is True and summary["problems"] == []
  assert (summary["pushed"], summary["committed"], summary["pending"]) == (6, 4, 2)
  assert summary["run_dir"] == str(stub_run) and summary["eta"] == 3


def test_the_agreement_metrics_of_the_run_are_summarised_per_tag(stub_run, capsys):
  tag = "agreement/paged-gather.bfloat16"
  steps = [
    {"step": 1, f"{tag}/tokens": 10.0, f"{tag}/abs_mean": 0.01, f"{tag}/abs_max": 0.05,
     f"{tag}/kl_k3": 1e-4, f"{tag}/out_frac": 0.0},
    {"step": 2, f"{tag}/tokens": 0.0},  # no token of the trained version: not averaged in
    {"step": 3, f"{tag}/tokens": 30.0, f"{tag}/abs_mean": 0.03, f"{tag}/abs_max": 0.9,
     f"{tag}/kl_k3": 3e-4, f"{tag}/out_frac": 0.1},
  ]  # fmt: skip
  (stub_run / "metrics").mkdir(exist_ok=True)
  lines = [json.dumps(s) for s in steps] + ['{"step": 4, "agreem']  # a torn last line
  (stub_run / "metrics" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
  assert main.main(["audit", str(stub_run)]) == 0
  out = capsys.readouterr().out
  assert "agreement paged-gather.bfloat16" in out
  a = _last_json(out)["agreement"]["paged-gather.bfloat16"]
  assert (a["steps"], a["tokens"], a["worst_step"]) == (2, 40.0, 3)
  assert a["abs_mean"] == pytest.approx((0.01 * 10 + 0.03 * 30) / 40)
  assert a["out_frac"] == pytest.approx(3 / 40) and a["abs_max"] == 0.9
  assert a["kl_k3"] == pytest.approx((1e-3 + 9e-3) / 40)


def test_the_gin_bound_form_and_an_rl_stage_directory(stub_run, capsys):
  """A quickstart-shaped directory (the run under rl/), named through gin."""
  quick = stub_run.parent / "quick"
  quick.mkdir()
  stub_run.rename(quick / "rl")
  assert main.main(["audit", f"--gin_param=audit.audit.run_dir='{quick}'"]) == 0
  assert _last_json(capsys.readouterr().out)["run_dir"] == str(quick / "rl")


def test_a_damaged_run_exits_1_naming_the_problem(stub_run, capsys):
  with (stub_run / "replay" / CONSUMED_LOG).open("a") as f:
    f.write(json.dumps({"ids": ["g0"]}) + "\n")  # g0 trained twice
  assert main.main(["audit", str(stub_run)]) == 1
  out = capsys.readouterr().out
  assert "PROBLEMS" in out
  summary = _last_json(out)
  assert summary["consistent"] is False and summary["duplicated"] == 1
  assert summary["problems"] == ["1 group(s) pushed or trained more than once"]
  # Staleness is checked only against a given eta: 3 versions old breaks eta = 2.
  assert main.main(["audit", str(stub_run), "--eta", "2"]) == 1
  assert len(_last_json(capsys.readouterr().out)["problems"]) == 2


@pytest.mark.parametrize("what", ["missing", "file", "no_replay"])
def test_a_path_that_is_no_run_is_a_one_line_config_error(tmp_path, capsys, what):
  path = tmp_path / what
  if what == "file":
    path.write_text("x")
  elif what == "no_replay":
    path.mkdir()
  assert main.main(["audit", str(path)]) == 2
  captured = capsys.readouterr()
  (line,) = captured.err.strip().splitlines()
  assert line.startswith("asearcher audit: config error: ") and str(path) in line
  assert captured.out == ""
  # The gin-bound form says the same.
  assert main.main(["audit", f"--gin_param=audit.audit.run_dir='{path}'"]) == 2
  assert "config error" in capsys.readouterr().err


def test_bad_numbers_are_config_errors(stub_run, capsys):
  assert main.main(["audit", str(stub_run), "--batch_groups", "0"]) == 2
  assert "batch_groups (--batch_groups) must be >= 1" in capsys.readouterr().err


def test_as_a_process(stub_run, tmp_path):
  """The installed command line, from outside the repository."""
  env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"}
  cmd = [sys.executable, "-m", "asearcher_jax.main", "audit"]
  ok = subprocess.run([*cmd, str(stub_run)], cwd=tmp_path, env=env, capture_output=True,
                      text=True, timeout=120)  # fmt: skip
  assert ok.returncode == 0, ok.stderr
  assert _last_json(ok.stdout)["consistent"] is True
  bad = subprocess.run([*cmd, str(tmp_path / "nope")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
  assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
  helped = subprocess.run([*cmd, "--help"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
  assert helped.returncode == 0 and "audit.audit.eta" in helped.stdout, helped.stderr
