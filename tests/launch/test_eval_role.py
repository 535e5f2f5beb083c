"""The evaluation role: `asearcher eval` watching a training run's weights store, each version it
publishes evaluated in the role's own engine pinned to that version. Its command line comes from
launch/roles.py for both backends; the local backend runs it beside a tiny training run (a
retrieval server, one serve-model, one trainer process) and both versions the trainer publishes
are evaluated, each result recording its version and carrying only its tokens."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import threading
from pathlib import Path

import pytest

from asearcher_jax.testing.standin_server import StandinServer
from launch import cli, local, roles
from tests.launch.test_local import assert_nothing_left, wait_for

SPEC = """name = "tiny-eval"
experiment = "gin/experiments/asearcher_local_qwen2_5_7b.gin"
overlays = ["gin/overlays/recipe_tiny.gin"]
run_dir = "{run}"
serving = 1
trainers = 1
gin_params = ["train_config.TrainConfig.train_steps = 2"]
evaluation = "gin/experiments/eval_asearcher_local_qwen2_5_7b.gin"
evaluation_overlays = ["gin/overlays/eval_recipe_tiny.gin"]
evaluation_gin_params = [{judge}]
"""


def _launch(action: str, spec: Path, *extra: str) -> tuple[int, str, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = cli.main([action, "--backend", "local", "--spec", str(spec), *extra])
  return rc, out.getvalue(), err.getvalue()


def test_eval_role_argv_watches_the_store_and_names_the_retrieval_servers(tmp_path):
  spec = local.LocalSpec(
    name="t", experiment="e.gin", run_dir=str(tmp_path), evaluation="gin/experiments/x.gin",
    evaluation_overlays=("o.gin",), evaluation_every=5, evaluation_gin_params=("K = 2",),
  )  # fmt: skip
  lay = local.layout(spec, tmp_path)
  argv = roles.eval_argv(lay)
  assert argv[3:7] == ["eval", "--gin_file=gin/experiments/x.gin", "--gin_file=o.gin",
                       "--gin_param=K = 2"]  # fmt: skip
  joined = " ".join(argv)
  assert f'commands.VersionWatch.weights_dir="{tmp_path}/weights"' in joined
  assert "commands.VersionWatch.every=5" in joined
  assert f'commands.VersionWatch.done_file="{tmp_path}/train/operative_config.gin"' in joined
  assert f'runner.RunnerConfig.output_dir="{tmp_path}/eval"' in joined
  assert f'commands.EvalTools.retrieval_addr_dir="{tmp_path}/retrieval"' in joined
  assert "commands.EvalTools.retrieval_addresses=()" in joined
  # The training roles' bindings do not reach it, and it is one of the roles `check` checks.
  assert "eval" in roles.role_argvs(lay) and "eval" not in roles.role_argvs(lay, evaluation=False)
  # A fixed address list (a pod's retrieval tier) instead of an address directory.
  pod = roles.Layout(gin_files=("e.gin",), run_dir="/r", weights_dir="gs://b/w",
                     address_files=(), retrieval_addresses=("10.0.0.1:8000",),
                     eval_gin_files=("x.gin",), eval_tensor=4)  # fmt: skip
  joined = " ".join(roles.eval_argv(pod))
  assert 'retrieval_addresses=("10.0.0.1:8000",)' in joined and "tensor=4" in joined


def test_eval_role_configuration_is_checked_before_anything_starts(tmp_path):
  spec = tmp_path / "spec.toml"
  spec.write_text(SPEC.format(run=tmp_path / "r", judge='"judge.JudgeConfig.model = \\"x\\""'))
  rc, out, err = _launch("start", spec, "--dry-run")
  assert rc == 0 and "launch.local supervise" in out, err
  spec.write_text(SPEC.format(run=tmp_path / "r", judge='"commands.VersionWatch.evry = 2"'))
  rc, _, err = _launch("start", spec, "--dry-run")
  assert rc == 2 and "the eval role's configuration" in err and "evry" in err, err
  assert not (tmp_path / "r").exists()
  spec.write_text(SPEC.format(run=tmp_path / "r", judge="").replace(
    'evaluation = "gin/experiments/eval_asearcher_local_qwen2_5_7b.gin"\n', ""))  # fmt: skip
  rc, _, err = _launch("start", spec, "--dry-run")
  assert rc == 2 and "evaluation_overlays / evaluation_gin_params need evaluation" in err


@contextlib.contextmanager
def _judge_in_a_thread():
  """The stand-in judge on a loop of its own, for the processes the launcher starts."""
  loop = asyncio.new_event_loop()
  thread = threading.Thread(target=loop.run_forever, daemon=True)
  thread.start()
  server = StandinServer([])
  port = asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
  try:
    yield server, port
  finally:
    asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)


@pytest.mark.slow
def test_local_backend_evaluates_each_published_version_pinned_to_it(tmp_path):
  run = tmp_path / "r"
  spec = tmp_path / "spec.toml"
  seen: set[int] = set()
  with _judge_in_a_thread() as (judge, port):
    url = f"http://127.0.0.1:{port}/v1"
    spec.write_text(SPEC.format(run=run, judge=f'"judge.JudgeConfig.base_url = \\"{url}\\""'))
    rc, _, err = _launch("start", spec)
    assert rc == 0, err
    try:
      done = run / "supervisor.done"
      code = wait_for("the run's end", lambda: done.exists() and done.read_text().strip(), 1500)
      seen |= set(local.pids(run).values())
    finally:
      seen |= set(local.pids(run).values())
      assert _launch("stop", spec)[0] == 0
  eval_log = (run / "logs" / "eval.log").read_text()
  assert code == "0", (run / "supervisor.log").read_text()[-2000:] + eval_log[-3000:]
  lines = [json.loads(x) for x in (run / "eval" / "versions.jsonl").read_text().splitlines()]
  assert [x["version"] for x in lines] == [1, 2], eval_log[-3000:]
  asked, predictions = 0, 0  # distinct and all non-empty predictions: what the judge was asked
  for line in lines:
    v, run_dir = line["version"], Path(line["run_dir"])
    assert run_dir.parent == run / "eval" / f"v{v:08d}"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["weights_version"] == v and config["weights_dir"] == str(run / "weights")
    assert line["datasets"]["hotpotqa_train100"]["k"] == 2 and line["checked_tokens"] > 0
    snaps = [json.loads(p.read_text()) for p in run_dir.glob("hotpotqa_train100/run*/*.json")]
    assert len(snaps) == 4
    assert {int(t) for s in snaps for c in s["trajectory"]["calls"] for t in c["versions"]} == {v}
    assert all(next(iter(s["judge"].values()))["status"] == "success" for s in snaps)
    asked += len({(s["qid"], s["pred"]) for s in snaps if (s["pred"] or "").strip()})
    predictions += sum(1 for s in snaps if (s["pred"] or "").strip())
  # An empty prediction is incorrect without asking; verdicts are cached per version.
  assert asked <= judge.requests["chat"] <= predictions
  assert_nothing_left(run, seen)


GCLOUD = """name = "as"\nproject = "p"\nzone = "z"\nbucket = "gs://b/pre"
experiment = "gin/experiments/asearcher_local_qwen2_5_7b.gin"
[trainer]\naccelerator_type = "v5p-32"\n[serving]\naccelerator_type = "v5p-8"
"""


def test_gcloud_eval_slice_is_provisioned_started_and_torn_down_with_the_run(tmp_path):
  from launch import gcloud
  from launch import spec as spec_lib

  path = tmp_path / "s.toml"
  path.write_text(GCLOUD + '[eval]\naccelerator_type = "v5p-8"\nevery = 10\n'
                  'experiment = "gin/experiments/eval_asearcher_local_qwen2_5_7b.gin"\n')  # fmt: skip
  spec = spec_lib.load(path)
  assert spec.evaluation is not None and spec.evaluation.slice.name == "as-eval"
  up = [str(c) for c in gcloud.plan(spec, "up")]
  assert any("queued-resources create as-eval" in c and "v5p-8" in c for c in up)
  (start,) = [c for c in gcloud.plan(spec, "start") if "as-eval" in str(c)]
  script = start.argv[-1]
  assert "--worker=0" in start.argv and "OPENAI_API_KEY=$OPENAI_API_KEY" in script
  assert "asearcher eval --gin_file=gin/experiments/eval_asearcher_local_qwen2_5_7b.gin" in script
  assert "commands.VersionWatch.weights_dir=" in script and "gs://b/pre/runs/as/weights" in script
  assert "commands.VersionWatch.every=10" in script and "mesh.ServingMeshConfig.tensor=4" in script
  assert "/mnt/asearcher/pre/runs/as/train/eval" in script  # results on the bucket mount
  assert "TRAINER0_IP:8000" in script  # the trainer worker's retrieval server
  for action in ("status", "stop", "down"):
    assert any("as-eval" in str(c) for c in gcloud.plan(spec, action)), action
  # Without [eval], no eval slice and no eval role.
  path.write_text(GCLOUD)
  plain = spec_lib.load(path)
  assert not any("as-eval" in str(c) for c in gcloud.plan(plain, "start"))
  assert "eval" not in roles.role_argvs(gcloud.layout(plain))


@pytest.mark.parametrize(
  ("table", "message"),
  [
    ('accelerator_type = "v5p-16"\nexperiment = "e.gin"\n', "has 2 hosts; the evaluation engine"),
    ('accelerator_type = "v5litepod-8"\nexperiment = "e.gin"\n', "v5e but [trainer] is v5p"),
    ('accelerator_type = "v5p-8"\nexperiment = "e.gin"\nevery = 0\n', "every must be an integer"),
    ('accelerator_type = "v5p-8"\nexperiment = "e.gin"\nevry = 2\n', "unknown key(s) evry"),
    ('accelerator_type = "v5p-8"\n', "experiment must be a non-empty string"),
  ],
)
def test_gcloud_eval_table_mistakes_name_the_key(tmp_path, table, message):
  from launch import spec as spec_lib

  path = tmp_path / "s.toml"
  path.write_text(GCLOUD + "[eval]\n" + table)
  with pytest.raises(spec_lib.SpecError, match=re.escape(message)):
    spec_lib.load(path)
