"""`python -m launch ACTION --dry-run`: the exact gcloud / ssh commands of a v5e and a v5p plan
(golden files; regenerate with UPDATE_GOLDEN=1 after checking the diff), and specs that must
fail with one clear line before anything runs."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import cli, gcloud, roles
from launch.spec import CHIPS, SpecError, load, parse_accelerator

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
SPECS = {
  "v5e": REPO / "launch/specs/v5e.toml",
  "v5p": REPO / "launch/specs/v5p.toml",
  "v5p_tier": REPO / "launch/specs/v5p_local_7b_tier.toml",
}


def dry_run(spec: Path, action: str) -> tuple[int, str, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = cli.main([action, "--spec", str(spec), "--dry-run", "--commit", "0123abc"])
  return rc, out.getvalue(), err.getvalue()


# The 7B recipe's serving replica does not fit a v5e-8 (Qwen2.5-7B's 28 heads do not split over
# 8 chips, so each would hold the whole page pool): start refuses it (tests/launch/test_rehearse.py).
REFUSED = {("v5e", "start")}


@pytest.mark.parametrize("chip", ["v5e", "v5p", "v5p_tier"])
def test_dry_run_matches_golden(chip):
  text = ""
  for action in gcloud.ACTIONS:
    rc, out, err = dry_run(SPECS[chip], action)
    if (chip, action) in REFUSED:
      assert rc == 2 and out == "" and err.count("\n") == 1, err
      text += f"# {action}\n{err}"
      continue
    assert rc == 0 and not err, err
    text += f"# {action}\n{out}"
  golden = GOLDEN / f"{chip}.txt"
  if os.environ.get("UPDATE_GOLDEN"):
    golden.write_text(text)
  assert text == golden.read_text()


def test_plans_have_the_shape_of_the_spec():
  spec = load(SPECS["v5p"])
  # v5p-64: 64 TensorCores = 32 chips = 8 hosts; v5p-8: 4 chips on one host.
  assert (spec.trainer.chips, spec.trainer.hosts) == (32, 8)
  assert [(s.chips, s.hosts) for s in spec.serving] == [(4, 1)] * 24
  start = [str(c) for c in gcloud.start(spec)]
  trainers = [c for c in start if "asearcher train" in c]
  assert len(trainers) == 8
  for i, c in enumerate(trainers):
    assert f"--worker={i} " in c and f"JAX_PROCESS_ID={i} " in c and "JAX_NUM_PROCESSES=8 " in c
    assert "JAX_COORDINATOR_ADDRESS=TRAINER0_IP:8476" in c
    assert c.count("addresses/as-32b-v5p-serve-") == 24  # every server's address file
  assert not any("serve-retrieval" in c for c in start)  # web tools: no retrieval server
  assert all("$SERPER_API_KEY" in c for c in trainers)  # a name, never a value


def test_the_retrieval_server_beside_the_trainer_stays_off_its_chips():
  """Local tools without a retrieval tier: the server runs on trainer worker 0, a TPU VM whose
  chips and jax.distributed program are the trainer's. It is started without the trainer's
  distributed environment, as a subcommand `asearcher` runs on the CPU without joining
  (main.CPU_ONLY; tests/tools/test_commands.py starts one with that environment set)."""
  from asearcher_jax import main

  spec = load(REPO / "launch/specs/v5p_local_7b.toml")
  (retrieval,) = [str(c) for c in gcloud.start(spec) if "serve-retrieval" in str(c)]
  assert f"{spec.trainer.name} " in retrieval and "--worker=0 " in retrieval
  assert "JAX_" not in retrieval and "TPU_" not in retrieval
  lay = gcloud.layout(spec)
  assert roles.retrieval_argv(lay)[len(lay.asearcher)] in main.CPU_ONLY


def test_run_fills_captured_values_and_waits_for_active():
  spec = load(SPECS["v5e"])
  calls: list[list[str]] = []
  states = iter(["WAITING_FOR_RESOURCES", "ACTIVE", "ACTIVE", "ACTIVE"])

  def runner(argv):
    calls.append(argv)
    if "describe" in argv and "queued-resources" in argv:
      return next(states) + "\n"
    return "10.0.0.7\n" if "describe" in argv else ""

  out = io.StringIO()
  gcloud.run(gcloud.up(spec), dry_run=False, out=out, runner=runner, poll_s=0)
  assert sum("describe" in c for c in calls) == 4  # polled the trainer twice
  calls.clear()
  assert gcloud.run(gcloud.start(spec), dry_run=False, out=out, runner=runner) == 0
  assert any("10.0.0.7:8476" in " ".join(c) for c in calls)
  assert not any("TRAINER0_IP" in " ".join(c) for c in calls)


def test_a_failed_queued_resource_stops_the_run():
  spec = load(SPECS["v5e"])
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    rc = gcloud.run(gcloud.up(spec), dry_run=False, out=io.StringIO(),
                    runner=lambda argv: "FAILED" if "describe" in argv else "", poll_s=0)  # fmt: skip
  assert rc == 1 and "as-7b-v5e-trainer is FAILED" in err.getvalue()


BASE = """name = "x"\nproject = "p"\nzone = "z"\nbucket = "gs://b"\nexperiment = "e.gin"\n"""


@pytest.mark.parametrize(
  "body, message",
  [
    ('[trainer]\naccelerator_type = "v7x-16"\n[serving]\naccelerator_type = "v7x-8"\n',
     "[trainer] accelerator_type: unknown accelerator type 'v7x-16'"),
    ('runtime_version = "v2-alpha-tpuv5-lite"\n[trainer]\naccelerator_type = "v5p-16"\n'
     '[serving]\naccelerator_type = "v5p-8"\n',
     "runtime_version 'v2-alpha-tpuv5-lite' does not match v5p (use v2-alpha-tpuv5"),
    ('runtime_version = "tpu-ubuntu2204-base"\n[trainer]\naccelerator_type = "v6e-16"\n'
     '[serving]\naccelerator_type = "v6e-4"\n',
     "runtime_version 'tpu-ubuntu2204-base' does not match v6e (use v2-alpha-tpuv6e"),
    ('[trainer]\naccelerator_type = "v5litepod-12"\n[serving]\naccelerator_type = "v5litepod-4"\n',
     "'v5litepod-12' is not a v5e slice size"),
    ('[trainer]\naccelerator_type = "v5p-16"\n[serving]\naccelerator_type = "v5litepod-4"\n',
     "[serving] is v5e but [trainer] is v5p"),
    ('zonee = "x"\n[trainer]\naccelerator_type = "v5p-16"\n', "unknown key(s) zonee"),
  ],
)  # fmt: skip
def test_bad_specs_fail_with_one_line_and_run_nothing(tmp_path, body, message):
  path = tmp_path / "spec.toml"
  path.write_text(BASE + body)
  for action in ("up", "start", "down"):
    rc, out, err = dry_run(path, action)
    assert rc == 2 and out == ""  # nothing printed, so nothing would have run
    assert message in err and err.count("\n") == 1, err
    assert str(path) in err


def test_chip_table():
  assert {c: CHIPS[c].hbm_gb for c in CHIPS} == {"v4": 32.0, "v5e": 16.0, "v5p": 95.0, "v6e": 32.0}
  assert parse_accelerator("v4-32", "x")[1:] == (16, 4)
  assert parse_accelerator("v5litepod-8", "x")[1:] == (8, 1)
  assert parse_accelerator("v6e-64", "x")[1:] == (64, 16)
  with pytest.raises(SpecError, match="unknown accelerator"):
    parse_accelerator("tpu-8", "x")


def test_module_entry_point_and_missing_spec(tmp_path):
  r = subprocess.run([sys.executable, "-m", "launch", "up", "--spec", str(tmp_path / "no.toml"),
                      "--dry-run"], capture_output=True, text=True, cwd=REPO, timeout=60)  # fmt: skip
  assert r.returncode == 2 and "no such spec file" in r.stderr and r.stdout == ""


@pytest.mark.slow
@pytest.mark.parametrize(
  "path",
  sorted(p for p in (REPO / "launch/specs").glob("*.toml") if not p.stem.startswith("local")),
  ids=lambda p: p.stem,
)
def test_every_shipped_spec_plans_and_names_an_existing_recipe(path):
  spec = load(path)
  assert (REPO / spec.experiment).exists(), spec.experiment
  for action in gcloud.ACTIONS:
    rc, out, err = dry_run(path, action)
    if (path.stem, action) in REFUSED:  # one clear line, nothing planned
      assert rc == 2 and not out and err.count("\n") == 1, err
      continue
    assert rc == 0 and out and not err


def test_stop_script_waits_for_its_processes_and_kills_what_ignores_sigterm(tmp_path):
  """The worker-side script of `stop`, run by bash with the run directory in tmp_path: a process
  that exits on SIGTERM and one that ignores it are both gone when it returns (so a sweep's next
  `start` finds its ports free), and their pid files too."""
  import psutil

  spec = load(SPECS["v5e"])
  script = gcloud.stop(spec, grace_s=2)[0].argv[-1].removeprefix("--command=")
  script = script.replace(gcloud.RUN, str(tmp_path))
  (tmp_path / "pids").mkdir()
  ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
  start = (f"sleep 300 & echo $! > {tmp_path}/pids/a.pid; "
           f"{sys.executable} -c '{ignore}' & echo $! > {tmp_path}/pids/b.pid")  # fmt: skip
  subprocess.run(["bash", "-c", start], check=True, timeout=30)  # both orphaned: not our zombies
  pids = [int(f.read_text()) for f in sorted((tmp_path / "pids").glob("*.pid"))]
  assert all(psutil.pid_exists(p) for p in pids)
  subprocess.run(["bash", "-c", script], check=True, timeout=60)

  def gone(pid: int) -> bool:  # a zombie has exited (its ports are closed); init reaps it
    try:
      return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
      return True

  # SIGKILL lands asynchronously: allow the kernel a moment (a CI run of 2026-11-26 saw one alive
  # right after the script returned), far less than the 300 s the processes would otherwise live.
  deadline = time.monotonic() + 10
  while not all(gone(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert all(gone(p) for p in pids)
  assert not list((tmp_path / "pids").glob("*.pid"))


@pytest.mark.slow
def test_start_checks_every_roles_configuration_in_one_process(monkeypatch):
  """`start` checks the retrieval, serving and trainer roles' own command lines before anything
  runs: a flag launch writes for one role that no longer binds there (or a value only that role
  gets) is one spec error naming the role, and nothing is printed, so nothing would have run."""
  spec = load(SPECS["v5e"])
  lay = gcloud.layout(spec)
  assert list(roles.role_argvs(lay)) == ["retrieval", "serving", "trainer"]
  roles.check_roles(lay)  # the shipped recipe: every role is fine
  with pytest.raises(SpecError, match=r"^the serving role's configuration: asearcher serve-model: "
                     r"config error: .*OpenAIServerConfig.port.*70000"):  # fmt: skip
    roles.check_roles(dataclasses.replace(lay, serve_port=70000))
  serve_argv = roles.serve_argv
  monkeypatch.setattr(roles, "serve_argv", lambda layout, index: [
    *serve_argv(layout, index), "--gin_param=serve_model.serve.adress_file='x.json'"])  # fmt: skip
  rc, out, err = dry_run(SPECS["v5e"], "start")
  assert rc == 2 and out == "" and err.count("\n") == 1
  assert "launch start: spec error: the serving role's configuration: " in err
  assert "serve_model.serve.adress_file" in err


@pytest.mark.slow
def test_check_answers_for_many_points_as_start_dry_run_would_in_one_process(tmp_path):
  """`launch check` (what a sweep runs before its launched points): each JSON line on stdin is one
  point, each answer the line `start --dry-run` ends with for it (null when it would start), all
  points' roles checked by one `asearcher --check-each`; a malformed line is one error, exit 2."""
  typo = "staleness.StalenessConfig.max_stalenes=2"
  points = [
    {"run_dir": "sweeps/s/p00", "gin_params": ["staleness.StalenessConfig.max_staleness=2"]},
    {"run_dir": "sweeps/s/p01", "gin_params": [typo]},
    {"run_dir": "/abs", "gin_params": []},  # gcloud run dirs live under the bucket
    {"gin_params": []},  # the spec's own run dir
  ]
  cmd = [sys.executable, "-m", "launch", "check", "--spec", str(SPECS["v5e"])]
  stdin = "".join(json.dumps(p) + "\n" for p in points)
  r = subprocess.run(cmd, input=stdin, capture_output=True, text=True, cwd=REPO, timeout=300)
  assert r.returncode == 0, r.stderr
  answers = [json.loads(x) for x in r.stdout.splitlines()]
  assert answers[0] is None and answers[3] is None
  assert answers[1].startswith("launch start: spec error: the ") and "max_stalenes" in answers[1]
  assert answers[2].startswith("launch start: spec error: ") and "/abs" in answers[2]
  for point, answer in zip(points[1:3], answers[1:3], strict=True):  # as start --dry-run says
    argv = ["start", "--spec", str(SPECS["v5e"]), "--dry-run", "--run_dir", point["run_dir"]]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
      rc = cli.main([*argv, *(f"--gin_param={b}" for b in point["gin_params"])])
    assert rc == 2 and err.getvalue().strip() == answer
  # The local backend: the same answers for its spec.
  local_lines = [{"run_dir": str(tmp_path), "gin_params": []}, {"gin_params": [typo]}]
  local_spec = str(REPO / "launch/specs/local_tiny.toml")
  r = subprocess.run(
    [*cmd[:4], "--backend", "local", "--spec", local_spec], cwd=REPO, timeout=300,
    input="".join(json.dumps(p) + "\n" for p in local_lines), capture_output=True, text=True,
  )  # fmt: skip
  got = [json.loads(x) for x in r.stdout.splitlines()]
  assert r.returncode == 0 and got[0] is None and "max_stalenes" in got[1], r.stderr
  assert not any(tmp_path.iterdir())  # a check writes nothing
  # --gin_param binds every point, as it binds every role of a start.
  r = subprocess.run([*cmd, f"--gin_param={typo}"], input='{"gin_params": []}\n', cwd=REPO,
                     capture_output=True, text=True, timeout=300)  # fmt: skip
  assert r.returncode == 0 and "max_stalenes" in json.loads(r.stdout), r.stderr
  for bad in ('{"run_dir": 3}\n', "not json\n", '{"gin_params": "a=1"}\n'):
    r = subprocess.run(cmd, input=bad, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("launch check: stdin line 1: want {")


def test_a_retrieval_tier_of_its_own():
  """[retrieval]: CPU VMs with N replicas each; the trainer is given every replica's address
  (its client spreads requests over them) and trainer worker 0 runs no retrieval server."""
  spec = load(SPECS["v5p_tier"])
  assert spec.retrieval.hosts == ("as-local-7b-tier-retrieval-0", "as-local-7b-tier-retrieval-1")
  start = [str(c) for c in gcloud.start(spec)]
  servers = [c for c in start if "serve-retrieval" in c]
  assert len(servers) == 2 and all("compute ssh as-local-7b-tier-retrieval-" in c for c in servers)
  for c in servers:  # two replicas a host, on consecutive ports, the index on the host's disk
    assert "RetrievalServerConfig.port=8000" in c and "RetrievalServerConfig.port=8001" in c
    assert "RetrievalServerConfig.workers=8" in c
    assert c.count("/mnt/asearcher-index") == 2
  trainers = [c for c in start if "asearcher train" in c]
  assert len(trainers) == 4
  want = '("RETRIEVAL0_IP:8000", "RETRIEVAL0_IP:8001", "RETRIEVAL1_IP:8000", "RETRIEVAL1_IP:8001",)'
  assert all(f"LocalRetrievalConfig.addresses={want}" in c for c in trainers)
  # Captured IPs are filled in before the commands run.
  calls: list[list[str]] = []

  def runner(argv):
    calls.append(argv)
    if "instances" in argv and "describe" in argv:
      return f"10.1.0.{argv[4][-1]}\n"
    return "10.0.0.7\n" if "describe" in argv else ""

  assert gcloud.run(gcloud.start(spec), dry_run=False, out=io.StringIO(), runner=runner) == 0
  trainer_calls = [" ".join(c) for c in calls if "asearcher train" in " ".join(c)]
  assert all("10.1.0.0:8001" in c and "10.1.0.1:8000" in c for c in trainer_calls)
  assert "compute instances delete" in str(gcloud.down(spec)[-1])


@pytest.mark.parametrize(
  "table, message",
  [
    ('count = 0\nindex = "gs://b/i"\n', "[retrieval]: count must be an integer >= 1, got 0"),
    ("replicas = 2\n", "exactly one of index"),
    ('index = "/local/path"\n', "index must be a gs:// URL"),
    ('index = "gs://b/i"\nhost = "x"\n', "unknown key(s) host"),
  ],
)
def test_bad_retrieval_tables_fail_with_one_line(tmp_path, table, message):
  path = tmp_path / "spec.toml"
  path.write_text(BASE + '[trainer]\naccelerator_type = "v5p-16"\n[serving]\n'
                  f'accelerator_type = "v5p-8"\n[retrieval]\n{table}')  # fmt: skip
  rc, out, err = dry_run(path, "up")
  assert rc == 2 and out == "" and message in err and err.count("\n") == 1, err
