"""The GKE backend: the spec's slices as JobSets on a GKE cluster, the roles as gcloud runs them.

The same spec as the TPU-VM backend (launch/spec.py) plus a [gke] table:

    [gke]
    cluster = "my-cluster"                # an existing GKE Standard cluster in the spec's zone
    image = "us-docker.pkg.dev/my-project/asearcher/asearcher:TAG"   # launch/Dockerfile, built by `setup`
    service_account = "asearcher"         # Kubernetes SA bound to a Google SA that may use the bucket
    namespace = "default"
    max_restarts = 20                     # JobSet restarts after a failure or a preemption

What runs (`start` applies the manifests; `--dry-run` prints them):
  trainer    one JobSet (jobset.x-k8s.io/v1alpha2) `NAME-trainer`, replicated job "slice": one pod
             per host of the trainer slice (Indexed: the completion index is JAX_PROCESS_ID),
             nodeSelector cloud.google.com/gke-tpu-accelerator + gke-tpu-topology, google.com/tpu
             limits, hostNetwork as xpk and MaxText run it. JobSet's headless service gives pod 0
             the name NAME-trainer-slice-0-0.NAME-trainer: jax.distributed's coordinator.
             failurePolicy.maxRestarts recreates every trainer pod after a failed or preempted
             one; the trainer resumes from its last checkpoint in the bucket and replays its
             in-flight episodes from the journal shipped to the run dir.
  serving    one JobSet per serving slice (`NAME-serve-I`), so a preempted server restarts alone;
             each pod announces POD_IP:serve_port in the address file the trainer waits for (the
             same files as on TPU VMs), then execs serve-model.
  retrieval  a StatefulSet on the CPU node pool (spec [retrieval]: count x replicas servers,
             machine_type as nodeSelector; none: one server) and its headless Service: the
             trainer's retrieval client is given every pod's stable DNS name, and spreads its
             requests over them as over the tier's VMs. The index is copied from the bucket by
             an init container, or is the read-only persistent disk `index_disk`.
Every pod mounts the bucket with the Cloud Storage FUSE CSI driver at the spec's `mount` (the run
dir, address files, shipped journals), and runs its role under launch/supervise.py with no
restarts of its own (Kubernetes restarts pods): its log lands in the run dir's logs/POD/ on the
bucket, besides `kubectl logs`. The role command lines are launch/roles.py's, from the layout
`gcloud.layout` gives a TPU-VM run; only the program (the image's `asearcher`) and the retrieval
addresses (DNS names, not VM IPs) differ.

Fields as xpk (github.com/AI-Hypercomputer/xpk) and the GKE TPU documentation write them (checked
2026-12-04): https://cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus (accelerator
labels tpu-v4-podslice, tpu-v5-lite-podslice, tpu-v5p-slice, tpu-v6e-slice; topologies AxB for
v5e/v6e, AxBxC for v4/v5p; machine types ct4p-hightpu-4t, ct5lp-hightpu-{1,4,8}t,
ct5p-hightpu-4t, ct6e-standard-{1,4,8}t), https://cloud.google.com/kubernetes-engine/docs/how-to/
persistent-volumes/cloud-storage-fuse-csi-driver (annotation gke-gcsfuse/volumes, driver
gcsfuse.csi.storage.gke.io).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
from typing import Any

import yaml

from launch import gcloud, roles
from launch.spec import INDEX_MOUNT, ClusterSpec, Slice, SpecError, read_toml
from launch.supervise import SuperviseConfig
from launch.supervise import command as supervise_command

ACTIONS = ("up", "setup", "start", "status", "logs", "stop", "down")
API_JOBSET = "jobset.x-k8s.io/v1alpha2"
# Where the image holds the checkout (launch/Dockerfile) and each pod keeps its role's log.
WORKDIR = "/app"
POD_LOGS = "/var/log/asearcher"
# The image that copies the retrieval index from the bucket (gcloud storage).
CLOUD_SDK = "gcr.io/google.com/cloudsdktool/google-cloud-cli:slim"
# Kubernetes expands $(NAME) in command arguments from the container's environment.
POD_NAME = "$(POD_NAME)"
# The annotation an Indexed Job's pod carries its index in (the worker number in its slice).
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"

# GKE's names for each chip (node label value, machine type stem).
ACCELERATOR = {"v4": "tpu-v4-podslice", "v5e": "tpu-v5-lite-podslice", "v5p": "tpu-v5p-slice",
               "v6e": "tpu-v6e-slice"}  # fmt: skip
MACHINE = {"v4": "ct4p-hightpu-{n}t", "v5e": "ct5lp-hightpu-{n}t", "v5p": "ct5p-hightpu-{n}t",
           "v6e": "ct6e-standard-{n}t"}  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class GkeConfig:
  """The spec's [gke] table: where on GKE the run goes."""

  # The GKE Standard cluster (in the spec's project and zone) whose node pools `up` creates.
  cluster: str
  # The container image every role runs (launch/Dockerfile at the launched commit).
  image: str
  # Kubernetes namespace of every object.
  namespace: str = "default"
  # Kubernetes service account of every pod, bound (Workload Identity) to a Google service
  # account that may read and write the bucket: the FUSE mount and gs:// writes use it.
  service_account: str = "default"
  # JobSet restarts of the trainer (and of each serving slice) after a failed or preempted pod.
  max_restarts: int = 20


def load_gke(path: str, experiment: str | None = None) -> tuple[ClusterSpec, GkeConfig]:
  """The spec and its [gke] table; SpecError naming the key for any mistake."""
  from launch import spec as spec_lib

  spec = spec_lib.load(path, experiment)
  t = read_toml(path).get("gke")
  where = f"{path} [gke]"
  if not isinstance(t, dict):
    raise SpecError(f"{path}: the gke backend needs a [gke] table with cluster and image")
  known = {f.name for f in dataclasses.fields(GkeConfig)}
  if unknown := sorted(set(t) - known):
    raise SpecError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {sorted(known)})")
  for k in ("cluster", "image", "namespace", "service_account"):
    if k in t or k in ("cluster", "image"):
      v = t.get(k)
      if not isinstance(v, str) or not v:
        raise SpecError(f"{where}: {k} must be a non-empty string, got {v!r}")
  if not re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", t.get("namespace", "default")):
    raise SpecError(f"{where}: namespace {t['namespace']!r} is not a Kubernetes name")
  r = t.get("max_restarts", 20)
  if isinstance(r, bool) or not isinstance(r, int) or r < 0:
    raise SpecError(f"{where}: max_restarts must be an integer >= 0, got {r!r}")
  return spec, GkeConfig(**t)


def topology(s: Slice) -> str:
  """GKE's topology label of a slice: 'AxB' (v5e, v6e) or 'AxBxC' (v4, v5p), the dimensions
  doubled smallest-last from 2x2(x1), as the GKE TPU table lists them (v5p-64: 2x4x4)."""
  if s.chips == 1:
    return "1x1"
  dims = [2, 2, 1] if s.chip.name in ("v4", "v5p") else [2, 2]
  n = 4
  while n < s.chips:
    i = max(j for j, d in enumerate(dims) if d == min(dims))
    dims[i] *= 2
    n *= 2
  if n != s.chips:
    raise SpecError(f"{s.name}: {s.chips} chips have no GKE topology")
  return "x".join(map(str, dims))


def chips_per_host(s: Slice) -> int:
  return s.chips // s.hosts


def layout(spec: ClusterSpec, gke: GkeConfig, gin_params: tuple[str, ...] = ()) -> roles.Layout:
  """gcloud's layout (the bucket mount, the gs:// weights store and checkpoints, the journal on
  the pod's own disk) with the image's `asearcher` and the retrieval pods' DNS names."""
  lay = gcloud.layout(spec, gin_params)
  service = f"{spec.name}-retrieval"
  addresses = ()
  if spec.tools == "local":
    addresses = tuple(f"{service}-{i}.{service}:{spec.retrieval_port}" for i in
                      range(retrieval_pods(spec)))  # fmt: skip
  return dataclasses.replace(lay, asearcher=("asearcher",), retrieval_addresses=addresses)


def retrieval_pods(spec: ClusterSpec) -> int:
  tier = spec.retrieval
  return tier.count * tier.replicas if tier else 1


def coordinator(spec: ClusterSpec) -> str:
  """Trainer pod 0's DNS name (JobSet's headless service: JOBSET-JOB-INDEX-POD.JOBSET)."""
  js = spec.trainer.name
  return f"{js}-slice-0-0.{js}:{spec.coordinator_port}"


def _labels(spec: ClusterSpec, role: str) -> dict[str, str]:
  return {"app.kubernetes.io/part-of": "asearcher", "asearcher/run": spec.name,
          "asearcher/role": role}  # fmt: skip


def _wrapped(spec: ClusterSpec, role: str, argv: list[str]) -> list[str]:
  """`argv` under launch/supervise.py: no restarts (Kubernetes restarts the pod), the log on the
  pod's disk shipped to the run dir's logs/POD/ on the bucket mount."""
  cfg = SuperviseConfig(max_restarts=0, log=f"{POD_LOGS}/{role}.log",
                        ship_to=f"{gcloud.logs_dir(spec)}/{POD_NAME}", ship_every_s=30.0)  # fmt: skip
  return [*supervise_command(cfg, "python"), "--", *argv]


def _env(name: str, value: str | None = None, field: str | None = None) -> dict[str, Any]:
  if field is not None:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field}}}
  return {"name": name, "value": value}


def _bucket_volume(spec: ClusterSpec) -> dict[str, Any]:
  return {"name": "bucket", "csi": {"driver": "gcsfuse.csi.storage.gke.io", "volumeAttributes": {
    "bucketName": gcloud._bucket(spec)[0], "mountOptions": "implicit-dirs"}}}  # fmt: skip


def _pod_spec(spec: ClusterSpec, gke: GkeConfig, *, role: str, command: list[str],
              env: list[dict], node_selector: dict[str, str], resources: dict[str, Any],
              tpu: bool, extra_volumes: tuple[dict, ...] = (), extra_mounts: tuple[dict, ...] = (),
              init: tuple[dict, ...] = ()) -> dict[str, Any]:  # fmt: skip
  volumes = [_bucket_volume(spec), {"name": "logs", "emptyDir": {}}, *extra_volumes]
  mounts = [{"name": "bucket", "mountPath": spec.mount}, {"name": "logs", "mountPath": POD_LOGS},
            *extra_mounts]  # fmt: skip
  container = {
    "name": role, "image": gke.image, "workingDir": WORKDIR, "command": command,
    "env": [_env("POD_NAME", field="metadata.name"), _env("POD_IP", field="status.podIP"), *env],
    "resources": resources, "volumeMounts": mounts,
  }  # fmt: skip
  pod: dict[str, Any] = {
    "serviceAccountName": gke.service_account, "nodeSelector": node_selector,
    "containers": [container], "volumes": volumes,
  }  # fmt: skip
  if tpu:  # as xpk: the host's network for the chips' DCN traffic, cluster DNS kept
    container["securityContext"] = {"privileged": True}
    pod.update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet", restartPolicy="Never")
    if spec.provisioning == "spot":
      node_selector["cloud.google.com/gke-spot"] = "true"
      pod["tolerations"] = [{"key": "cloud.google.com/gke-spot", "operator": "Equal",
                             "value": "true", "effect": "NoSchedule"}]  # fmt: skip
  if init:
    pod["initContainers"] = list(init)
  return pod


def _jobset(spec: ClusterSpec, gke: GkeConfig, s: Slice, role: str, pod: dict) -> dict[str, Any]:
  """One slice as a JobSet: one Indexed Job of `hosts` pods on one node pool of its topology."""
  return {
    "apiVersion": API_JOBSET, "kind": "JobSet",
    "metadata": {
      "name": s.name, "namespace": gke.namespace, "labels": _labels(spec, role),
      # One Job per node pool: a slice's pods never share a pool with another slice's.
      "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"},
    },
    "spec": {
      "failurePolicy": {"maxRestarts": gke.max_restarts},
      "network": {"enableDNSHostnames": True},
      "replicatedJobs": [{"name": "slice", "replicas": 1, "template": {"spec": {
        "parallelism": s.hosts, "completions": s.hosts, "completionMode": "Indexed",
        # A lost host is a lost slice: the JobSet restarts it whole (failurePolicy).
        "backoffLimit": 0,
        "template": {
          "metadata": {"labels": _labels(spec, role),
                       "annotations": {"gke-gcsfuse/volumes": "true"}},
          "spec": pod,
        },
      }}}],
    },
  }  # fmt: skip


def _tpu(s: Slice) -> tuple[dict[str, str], dict[str, Any]]:
  n = chips_per_host(s)
  return (
    {"cloud.google.com/gke-tpu-accelerator": ACCELERATOR[s.chip.name],
     "cloud.google.com/gke-tpu-topology": topology(s)},
    {"requests": {"google.com/tpu": n}, "limits": {"google.com/tpu": n}},
  )  # fmt: skip


def trainer_manifest(spec: ClusterSpec, gke: GkeConfig, lay: roles.Layout) -> dict[str, Any]:
  s = spec.trainer
  env = roles.trainer_env(coordinator(spec), s.hosts, 0)
  env_list = [_env(k, v) for k, v in env.items() if k != "JAX_PROCESS_ID"]
  env_list += [_env("JAX_PROCESS_ID", field=COMPLETION_INDEX),
               _env("ASEARCHER_COMPILE_CACHE", gcloud.compile_cache(spec))]  # fmt: skip
  if spec.tools == "web":  # the keys from a Secret the operator creates (docs/pod.md)
    env_list += [{"name": k, "valueFrom": {"secretKeyRef": {
      "name": f"{spec.name}-keys", "key": k, "optional": True}}} for k in gcloud.SECRETS]  # fmt: skip
  selector, resources = _tpu(s)
  pod = _pod_spec(
    spec, gke, role="trainer", command=_wrapped(spec, "trainer", roles.trainer_argv(lay)),
    env=env_list, node_selector=selector, resources=resources, tpu=True,
    # The replay journal on the pod's own disk, shipped to the run dir in sealed segments.
    extra_volumes=({"name": "journal", "emptyDir": {}},),
    extra_mounts=({"name": "journal", "mountPath": gcloud.JOURNAL},),
  )  # fmt: skip
  return _jobset(spec, gke, s, "trainer", pod)


def serving_manifests(spec: ClusterSpec, gke: GkeConfig, lay: roles.Layout) -> list[dict]:
  """One JobSet per serving slice; each pod writes the address file gcloud's layout names
  (addresses/SLICE-wWORKER.json) with its own IP, then runs serve-model."""
  own = dataclasses.replace(lay, address_files=("/tmp/asearcher_serve.json",))
  argv = _wrapped(spec, "serve", roles.serve_argv(own, 0))
  root = gcloud.shared(spec)
  out = []
  for s in spec.serving:
    announce = (
      f'mkdir -p {root}/addresses && printf \'{{"http": "%s:{spec.serve_port}"}}\' "$POD_IP" '
      f'> {root}/addresses/{s.name}-w"$WORKER".json && exec "$@"'
    )
    selector, resources = _tpu(s)
    pod = _pod_spec(
      spec, gke, role="serve", command=["bash", "-c", announce, "serve", *argv],
      env=[_env("WORKER", field=COMPLETION_INDEX),
           _env("ASEARCHER_COMPILE_CACHE", gcloud.compile_cache(spec))],
      node_selector=selector, resources=resources, tpu=True,
    )  # fmt: skip
    out.append(_jobset(spec, gke, s, "serving", pod))
  return out


def retrieval_manifests(spec: ClusterSpec, gke: GkeConfig, lay: roles.Layout) -> list[dict]:
  """The headless Service and the StatefulSet of retrieval servers (local tools only)."""
  if spec.tools != "local":
    return []
  name, tier = f"{spec.name}-retrieval", spec.retrieval
  labels = _labels(spec, "retrieval")
  selector, volumes, mounts, init = {}, (), (), ()
  resources: dict[str, Any] = {}
  if tier is not None:
    selector = {"node.kubernetes.io/instance-type": tier.machine_type}
    resources = {"requests": {"cpu": str(tier.workers)}}
    if tier.index_disk:
      volumes = ({"name": "index", "gcePersistentDisk": {"pdName": tier.index_disk,
                  "fsType": "ext4", "readOnly": True}},)  # fmt: skip
      mounts = ({"name": "index", "mountPath": INDEX_MOUNT, "readOnly": True},)
    else:  # copied to the pod's disk: tantivy memory-maps it, which a FUSE mount serves slowly
      volumes = ({"name": "index", "emptyDir": {}},)
      mounts = ({"name": "index", "mountPath": INDEX_MOUNT},)
      init = ({"name": "index", "image": CLOUD_SDK, "command": [
        "gcloud", "storage", "rsync", "--recursive", tier.index, INDEX_MOUNT],
        "volumeMounts": list(mounts)},)  # fmt: skip
  pod = _pod_spec(
    spec, gke, role="retrieval",
    command=_wrapped(spec, "retrieval", roles.retrieval_argv(lay, spec.retrieval_port)),
    env=[], node_selector=selector, resources=resources, tpu=False, extra_volumes=volumes,
    extra_mounts=mounts, init=init,
  )  # fmt: skip
  meta = {"name": name, "namespace": gke.namespace, "labels": labels}
  service = {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": {
    "clusterIP": "None", "selector": labels,
    "ports": [{"name": "http", "port": spec.retrieval_port}]}}  # fmt: skip
  stateful = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta, "spec": {
    "serviceName": name, "replicas": retrieval_pods(spec), "podManagementPolicy": "Parallel",
    "selector": {"matchLabels": labels},
    "template": {"metadata": {"labels": labels, "annotations": {"gke-gcsfuse/volumes": "true"}},
                 "spec": pod}}}  # fmt: skip
  return [service, stateful]


def manifests(spec: ClusterSpec, gke: GkeConfig, gin_params: tuple[str, ...] = ()) -> list[dict]:
  """Every object of a run: retrieval, serving slices, then the trainer (applied in order)."""
  lay = layout(spec, gke, gin_params)
  return [*retrieval_manifests(spec, gke, lay), *serving_manifests(spec, gke, lay),
          trainer_manifest(spec, gke, lay)]  # fmt: skip


class _Dumper(yaml.SafeDumper):
  """Writes a shared dict (the labels) out at each use: no &anchors a reader must resolve."""

  def ignore_aliases(self, data: Any) -> bool:
    return True


def to_yaml(objs: list[dict]) -> str:
  return yaml.dump_all(objs, Dumper=_Dumper, sort_keys=False, width=1000)


def _where(spec: ClusterSpec, gke: GkeConfig) -> list[str]:
  return [f"--cluster={gke.cluster}", f"--project={spec.project}", f"--location={spec.zone}"]


def node_pools(spec: ClusterSpec, gke: GkeConfig) -> list[gcloud.Command]:
  """A node pool per slice (its machine type, topology and hosts) and the retrieval pool."""
  extra = {"spot": ["--spot"], "reserved": ["--reservation-affinity=any"]}.get(
    spec.provisioning, [])  # fmt: skip
  cmds = []
  for s in spec.slices:
    topo = [f"--tpu-topology={topology(s)}"] if s.hosts > 1 else []  # multi-host pools only
    cmds.append(gcloud.Command(argv=(
      "gcloud", "container", "node-pools", "create", s.name, *_where(spec, gke),
      f"--node-locations={spec.zone}",
      f"--machine-type={MACHINE[s.chip.name].format(n=chips_per_host(s))}", *topo,
      f"--num-nodes={s.hosts}", *extra)))  # fmt: skip
  if spec.retrieval is not None:
    t = spec.retrieval
    cmds.append(gcloud.Command(argv=(
      "gcloud", "container", "node-pools", "create", t.name, *_where(spec, gke),
      f"--node-locations={spec.zone}", f"--machine-type={t.machine_type}",
      f"--num-nodes={t.count}")))  # fmt: skip
  return cmds


def _kubectl(gke: GkeConfig, *args: str) -> gcloud.Command:
  return gcloud.Command(argv=("kubectl", f"--namespace={gke.namespace}", *args))


def plan(spec: ClusterSpec, gke: GkeConfig, action: str, *, commit: str = "HEAD",
         lines: int = 50) -> list[gcloud.Command]:  # fmt: skip
  """The commands of every action but `start` (whose manifests `apply` sends)."""
  creds = gcloud.Command(argv=("gcloud", "container", "clusters", "get-credentials",
                               gke.cluster, f"--project={spec.project}",
                               f"--location={spec.zone}"))  # fmt: skip
  selector = f"--selector=asearcher/run={spec.name}"
  if action == "up":
    return [creds, *node_pools(spec, gke)]
  if action == "setup":  # the image of `commit`, built from its own tree
    tree = f"/tmp/asearcher_jax-{commit}"
    return [
      gcloud.Command(argv=("rm", "-rf", tree)),
      gcloud.Command(argv=("mkdir", "-p", tree)),
      gcloud.Command(argv=("bash", "-c", f"git archive {shlex.quote(commit)} | tar -x -C {tree}")),
      gcloud.Command(argv=("docker", "build", "-f", f"{tree}/launch/Dockerfile", "-t", gke.image,
                           tree)),
      gcloud.Command(argv=("docker", "push", gke.image)),
    ]  # fmt: skip
  if action == "status":
    return [_kubectl(gke, "get", "jobsets,statefulsets,pods", selector, "--output=wide")]
  if action == "logs":
    return [_kubectl(gke, "logs", selector, f"--tail={lines}", "--prefix", "--all-containers",
                     "--max-log-requests=64")]  # fmt: skip
  if action == "stop":
    return [_kubectl(gke, "delete", "jobsets,statefulsets,services", selector, "--wait=true")]
  if action == "down":
    return [
      _kubectl(gke, "delete", "jobsets,statefulsets,services", selector, "--wait=true"),
      *(gcloud.Command(argv=("gcloud", "container", "node-pools", "delete", name,
                             *_where(spec, gke), "--quiet", "--async"))
        for name in [*(s.name for s in spec.slices),
                     *([spec.retrieval.name] if spec.retrieval else [])]),
    ]  # fmt: skip
  raise SpecError(f"unknown action {action!r}")


def main(a) -> int:
  """`python -m launch ACTION --backend gke`: start applies (or, --dry-run, prints) the
  manifests after the same checks as gcloud's start; the others run (or print) commands."""
  from launch import spec as spec_lib

  spec, gke = load_gke(a.spec, a.experiment)
  spec = spec_lib.with_run_dir(spec, a.run_dir)
  if a.action not in ACTIONS:
    raise SpecError(f"{a.action} is not a gke action (gke: {', '.join(ACTIONS)})")
  if a.action != "start":
    return gcloud.run(plan(spec, gke, a.action, commit=a.commit or "HEAD", lines=a.lines),
                      dry_run=a.dry_run)  # fmt: skip
  lay = layout(spec, gke, tuple(a.gin_param))
  roles.check_roles(lay)
  if a.fit != "off":
    message = roles.refusal(roles.rehearse_roles(lay, gcloud.topologies(spec), a.fit))
    if message:
      raise SpecError(message)
  text = to_yaml(manifests(spec, gke, tuple(a.gin_param)))
  if a.dry_run:
    print(text, end="", flush=True)
    return 0
  for c in (plan(spec, gke, "up")[0], _kubectl(gke, "apply", "--server-side", "-f", "-")):
    print(c, flush=True)
    subprocess.run(list(c.argv), check=True, timeout=600, text=True,
                   input=text if c.argv[0] == "kubectl" else None)  # fmt: skip
  print(f"launch start: {spec.name} applied; `python -m launch status --backend gke --spec "
        f"{a.spec}` follows it", file=sys.stderr)  # fmt: skip
  return 0
