"""`python -m launch ACTION --backend gke --dry-run`: the manifests of a GKE run (golden files,
regenerated with UPDATE_GOLDEN=1 after checking the diff) parsed as YAML and checked for what a
run needs: one JobSet per slice with its TPU topology and hosts, the role command lines equal to
launch/roles.py's, jax.distributed's coordinator at the trainer JobSet's pod 0, restarts on
failure, the bucket mounted and logs shipped there, the retrieval tier behind a headless Service."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import os
from pathlib import Path

import pytest
import yaml

from launch import cli, gcloud, gke, roles
from launch.spec import parse_accelerator

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
SPEC = REPO / "launch/specs/gke_v5p_local_7b.toml"
GKE_TABLE = '\n[gke]\ncluster = "c"\nimage = "img:1"\n'


def _cli(*argv: str) -> tuple[int, str, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = cli.main([*argv, "--backend", "gke", "--dry-run", "--commit", "0123abc"])
  return rc, out.getvalue(), err.getvalue()


def _golden(name: str, text: str) -> str:
  path = GOLDEN / name
  if os.environ.get("UPDATE_GOLDEN"):
    path.write_text(text)
  return path.read_text()


def test_manifests_match_the_golden_file():
  spec, cfg = gke.load_gke(str(SPEC))
  assert gke.to_yaml(gke.manifests(spec, cfg)) == _golden(
    "gke_v5p_local_7b.yaml", gke.to_yaml(gke.manifests(spec, cfg))
  )


@pytest.mark.slow
def test_start_dry_run_prints_the_golden_manifests():
  """The command line's path: every role's configuration checked and its fit rehearsed first."""
  rc, out, err = _cli("start", "--spec", str(SPEC))
  assert rc == 0 and not err, err
  assert out == (GOLDEN / "gke_v5p_local_7b.yaml").read_text()


def test_other_actions_match_the_golden_file():
  text = ""
  for action in ("up", "setup", "status", "logs", "stop", "down"):
    rc, out, err = _cli(action, "--spec", str(SPEC))
    assert rc == 0 and not err, err
    text += f"# {action}\n{out}"
  assert text == _golden("gke_v5p_local_7b.txt", text)
  assert "--machine-type=ct5p-hightpu-4t --tpu-topology=2x2x4 --num-nodes=4 --spot" in text
  assert "as-local-7b-gke-serve-0 " in text and "--tpu-topology=2x2x1" not in text  # one host


def _argv(container: dict) -> list[str]:
  """The role's own argv: what follows the supervisor's `--`."""
  cmd = container["command"]
  i = len(cmd) - 1 - cmd[::-1].index("--")
  assert cmd[cmd.index("launch.supervise") + 1 : i].count("--max-restarts=0") == 1
  return cmd[i + 1 :]


def _env(container: dict) -> dict[str, dict | str]:
  return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _pod(jobset: dict) -> tuple[dict, dict]:
  (rj,) = jobset["spec"]["replicatedJobs"]
  job = rj["template"]["spec"]
  return job, job["template"]


def test_the_golden_manifests_are_the_run_the_spec_describes():
  spec, cfg = gke.load_gke(str(SPEC))
  lay = gke.layout(spec, cfg)
  docs = list(yaml.safe_load_all((GOLDEN / "gke_v5p_local_7b.yaml").read_text()))
  kinds = collections.Counter(d["kind"] for d in docs)
  assert kinds == {"JobSet": 1 + len(spec.serving), "StatefulSet": 1, "Service": 1}
  assert all(d["metadata"]["labels"]["asearcher/run"] == spec.name for d in docs)
  by_name = {d["metadata"]["name"]: d for d in docs if d["kind"] == "JobSet"}

  # The trainer: one Indexed Job of one pod per host, restarted whole, pod 0 the coordinator.
  trainer = by_name[spec.trainer.name]
  assert trainer["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
  assert trainer["spec"]["failurePolicy"]["maxRestarts"] == cfg.max_restarts == 20
  job, template = _pod(trainer)
  _, chips, hosts = parse_accelerator("v5p-32", "test")
  assert job["parallelism"] == job["completions"] == hosts == 4
  assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
  pod = template["spec"]
  assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                 "cloud.google.com/gke-tpu-topology": "2x2x4",
                                 "cloud.google.com/gke-spot": "true"}  # fmt: skip
  (c,) = pod["containers"]
  assert c["resources"]["limits"]["google.com/tpu"] == chips // hosts == 4
  assert _argv(c) == roles.trainer_argv(lay)
  env = _env(c)
  rj_name = trainer["spec"]["replicatedJobs"][0]["name"]
  name = trainer["metadata"]["name"]  # JobSet DNS: JOBSET-JOB-INDEX-POD.JOBSET (headless service)
  assert env["JAX_COORDINATOR_ADDRESS"] == f"{name}-{rj_name}-0-0.{name}:{spec.coordinator_port}"
  assert trainer["spec"]["network"]["enableDNSHostnames"] is True
  assert env["JAX_NUM_PROCESSES"] == str(hosts)
  assert "job-completion-index" in env["JAX_PROCESS_ID"]["fieldRef"]["fieldPath"]
  assert {"name": "journal", "mountPath": gcloud.JOURNAL} in c["volumeMounts"]
  # The bucket through the FUSE CSI driver at the spec's mount; the log shipped under the run dir.
  assert template["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"
  (bucket,) = [v for v in pod["volumes"] if v["name"] == "bucket"]
  assert bucket["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
  assert bucket["csi"]["volumeAttributes"]["bucketName"] == "my-bucket"
  assert {"name": "bucket", "mountPath": spec.mount} in c["volumeMounts"]
  assert f"--ship-to={gcloud.shared(spec)}/logs/$(POD_NAME)" in c["command"]

  # Serving: a JobSet per slice; each writes one of the address files the trainer waits for.
  announced = set()
  for s in spec.serving:
    js = by_name[s.name]
    job, template = _pod(js)
    assert job["parallelism"] == s.hosts == 1
    assert template["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x2x1"
    (c,) = template["spec"]["containers"]
    assert c["resources"]["limits"]["google.com/tpu"] == 4
    own = dataclasses.replace(lay, address_files=("/tmp/asearcher_serve.json",))
    assert _argv(c) == roles.serve_argv(own, 0)
    script = c["command"][2]
    announced |= {script.split("> ")[1].split(" &&")[0].replace('"$WORKER"', str(w))
                  for w in range(s.hosts)}  # fmt: skip
  assert announced == set(lay.address_files)

  # Retrieval: count x replicas servers behind a headless Service, each one of the trainer's
  # addresses by its stable DNS name.
  (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
  (svc,) = [d for d in docs if d["kind"] == "Service"]
  assert (
    svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == svc["metadata"]["name"]
  )
  assert svc["spec"]["selector"] == sts["spec"]["template"]["metadata"]["labels"]
  n = sts["spec"]["replicas"]
  assert n == spec.retrieval.count * spec.retrieval.replicas == 4
  base = sts["metadata"]["name"]
  assert lay.retrieval_addresses == tuple(
    f"{base}-{i}.{svc['metadata']['name']}:{spec.retrieval_port}" for i in range(n)
  )
  pod = sts["spec"]["template"]["spec"]
  assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "n2-highmem-16"}
  (c,) = pod["containers"]
  assert _argv(c) == roles.retrieval_argv(lay, spec.retrieval_port)
  assert "google.com/tpu" not in str(c["resources"])
  (init,) = pod["initContainers"]
  assert init["command"][-2:] == [spec.retrieval.index, "/mnt/asearcher-index"]


def test_a_web_spec_has_no_retrieval_and_passes_key_names_not_values(tmp_path):
  path = tmp_path / "v5p.toml"
  path.write_text((REPO / "launch/specs/v5p.toml").read_text() + GKE_TABLE)
  spec, cfg = gke.load_gke(str(path))
  docs = yaml.safe_load_all(gke.to_yaml(gke.manifests(spec, cfg)))
  kinds = collections.Counter(d["kind"] for d in docs)
  assert kinds == {"JobSet": 25}  # 24 serving slices, the trainer
  trainer = gke.trainer_manifest(spec, cfg, gke.layout(spec, cfg))
  job, template = _pod(trainer)
  assert job["parallelism"] == 8  # v5p-64: 32 chips, 8 hosts
  assert template["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x4x4"
  assert "tolerations" not in template["spec"]  # reserved, not spot
  env = _env(template["spec"]["containers"][0])
  assert env["SERPER_API_KEY"] == {
    "secretKeyRef": {"name": "as-32b-v5p-keys", "key": "SERPER_API_KEY", "optional": True}
  }


@pytest.mark.parametrize(("accelerator", "topology"), [
  ("v5p-8", "2x2x1"), ("v5p-16", "2x2x2"), ("v5p-32", "2x2x4"), ("v5p-64", "2x4x4"),
  ("v5p-128", "4x4x4"), ("v4-512", "4x8x8"), ("v5litepod-1", "1x1"), ("v5litepod-4", "2x2"),
  ("v5litepod-8", "2x4"), ("v5litepod-16", "4x4"), ("v5litepod-32", "4x8"),
  ("v5litepod-64", "8x8"), ("v5litepod-128", "8x16"), ("v6e-256", "16x16"),
])  # fmt: skip
def test_topologies_as_the_gke_tpu_table_lists_them(accelerator, topology):
  chip, chips, hosts = parse_accelerator(accelerator, "test")
  s = gke.Slice(name="x", accelerator_type=accelerator, chip=chip, chips=chips, hosts=hosts)
  assert gke.topology(s) == topology


@pytest.mark.parametrize(("table", "message"), [
  ("", "needs a [gke] table with cluster and image"),
  ('[gke]\ncluster = "c"\n', "[gke]: image must be a non-empty string"),
  ('[gke]\ncluster = "c"\nimage = "i"\nmax_restart = 3\n', "unknown key(s) max_restart"),
  ('[gke]\ncluster = "c"\nimage = "i"\nmax_restarts = -1\n', "max_restarts must be an integer"),
  ('[gke]\ncluster = "c"\nimage = "i"\nnamespace = "A_b"\n', "is not a Kubernetes name"),
])  # fmt: skip
def test_bad_gke_tables_fail_with_one_line(tmp_path, table, message):
  path = tmp_path / "s.toml"
  path.write_text((REPO / "launch/specs/v5p.toml").read_text() + "\n" + table)
  rc, out, err = _cli("start", "--spec", str(path))
  assert rc == 2 and out == "" and err.count("\n") == 1 and message in err, err
  assert str(path) in err
