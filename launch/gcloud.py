"""The Cloud TPU backend: every action of a run as gcloud / ssh commands.

Flags as the gcloud reference documents them (checked 2026-11-25):
  https://cloud.google.com/sdk/gcloud/reference/compute/tpus/queued-resources/create
    QUEUED_RESOURCE --zone --runtime-version --accelerator-type --node-id [--spot|--reserved]
  https://cloud.google.com/sdk/gcloud/reference/compute/tpus/queued-resources/delete
    QUEUED_RESOURCE --zone [--async] [--force] (force: delete the nodes first)
  https://cloud.google.com/sdk/gcloud/reference/compute/tpus/tpu-vm/ssh
    TPU --zone --worker=WORKER|all --command=COMMAND
  https://cloud.google.com/sdk/gcloud/reference/compute/instances/create
    NAME --zone --machine-type --image-family --image-project --scopes
    [--disk=name=DISK,mode=ro,device-name=NAME] (a disk attached read-only to many VMs)
  https://cloud.google.com/sdk/gcloud/reference/compute/ssh  NAME --zone --command=COMMAND
Each slice is one queued resource whose node id is the slice name; a retrieval tier (spec
[retrieval]) is plain CPU VMs. `plan(...)` returns the
commands; `run(...)` executes them from the repository root (or only prints them with dry_run),
so the golden tests and a real launch share every string.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable

from launch import roles
from launch.spec import INDEX_MOUNT, REPO, ClusterSpec, RetrievalTier, Slice

# On a trainer worker's own disk: the replay logs, appended there and shipped to the run dir on
# the bucket mount in sealed segments (a replaced VM rebuilds them from there).
JOURNAL = "/var/tmp/asearcher_journal"
# On every worker (home-relative): the code, the virtualenv, logs and pid files.
CODE, VENV, RUN = "~/asearcher_jax", "~/asearcher_venv", "~/asearcher_run"
# Stands for trainer worker 0's internal IP in printed plans (resolved with `describe` in a run),
# and for retrieval host i's (retrieval_ip(i)).
TRAINER_IP = "TRAINER0_IP"
# The retrieval hosts' OS image (Python 3.11 is Debian 12's python3).
VM_IMAGE = ("--image-family=debian-12", "--image-project=debian-cloud")


def retrieval_ip(i: int) -> str:
  return f"RETRIEVAL{i}_IP"


ACTIONS = ("up", "setup", "start", "status", "logs", "stop", "down")
# Web-tool keys: printed as $NAME, filled in from the launching environment when a plan runs.
SECRETS = ("SERPER_API_KEY", "JINA_API_KEY")
# Filled in the same way for the evaluation role's judge.
JUDGE_SECRETS = ("OPENAI_API_KEY",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Command:
  """One command; `capture` names a value its stdout provides to later commands."""

  argv: tuple[str, ...]
  capture: str | None = None

  def __str__(self) -> str:
    return shlex.join(self.argv)


def _where(spec: ClusterSpec) -> list[str]:
  return [f"--project={spec.project}", f"--zone={spec.zone}"]


def _ssh(spec: ClusterSpec, s: Slice, worker: int | str, script: str) -> Command:
  return Command(argv=("gcloud", "compute", "tpus", "tpu-vm", "ssh", s.name, *_where(spec),
                       f"--worker={worker}", f"--command={script}"))  # fmt: skip


def _vm_ssh(spec: ClusterSpec, host: str, script: str) -> Command:
  return Command(argv=("gcloud", "compute", "ssh", host, *_where(spec), f"--command={script}"))


def _retrieval_hosts(spec: ClusterSpec) -> tuple[str, ...]:
  return spec.retrieval.hosts if spec.retrieval else ()


def _bucket(spec: ClusterSpec) -> tuple[str, str]:
  """gs://name/some/prefix -> ("name", "some/prefix/")."""
  name, _, prefix = spec.bucket.removeprefix("gs://").partition("/")
  return name, f"{prefix}/" if prefix else ""


def shared(spec: ClusterSpec) -> str:
  """The run's directory on the bucket mount (run dir, replay journal, address files); the same
  objects as `storage(spec)`, so a checkpoint written to the URL reads through the mount."""
  return f"{spec.mount}/{_bucket(spec)[1]}{spec.run_dir or 'runs/' + spec.name}"


def storage(spec: ClusterSpec) -> str:
  """The run's directory as a gs:// URL: the weights store and the checkpoints, written by
  Orbax / tensorstore straight to the bucket (the mount keeps the small shared files)."""
  name, prefix = _bucket(spec)
  return f"gs://{name}/{prefix}{spec.run_dir or 'runs/' + spec.name}"


def topologies(spec: ClusterSpec) -> dict[str, str]:
  """Each role's slice as the ahead-of-time compiler names it (rl/aot.py SLICES: "v5p-8",
  "v5e-8"), "cpu" for the retrieval server (a CPU role wherever it runs)."""

  def aot_name(s: Slice) -> str:
    return f"{s.chip.name}-{s.accelerator_type.rsplit('-', 1)[1]}"

  return {
    "retrieval": "cpu",
    "serving": aot_name(spec.serving[0]),
    "trainer": aot_name(spec.trainer),
  }


def layout(spec: ClusterSpec, gin_params: tuple[str, ...] = ()) -> roles.Layout:
  root = shared(spec)
  files = tuple(
    f"{root}/addresses/{s.name}-w{w}.json" for s in spec.serving for w in range(s.hosts)
  )
  tier = spec.retrieval
  if tier is not None:  # every replica of the tier, host by host
    addresses = tuple(f"{retrieval_ip(i)}:{spec.retrieval_port + r}"
                      for i in range(tier.count) for r in range(tier.replicas))  # fmt: skip
  else:
    addresses = (f"{TRAINER_IP}:{spec.retrieval_port}",) if spec.tools == "local" else ()
  return roles.Layout(
    gin_files=(spec.experiment,), gin_params=gin_params, run_dir=f"{root}/train",
    weights_dir=f"{storage(spec)}/weights", checkpoint_dir=f"{storage(spec)}/train/checkpoints",
    address_files=files, host="0.0.0.0",
    serve_port=spec.serve_port, retrieval_port=spec.retrieval_port,
    retrieval_addresses=addresses,
    retrieval_index_dir=INDEX_MOUNT if tier else None,
    retrieval_workers=tier.workers if tier else None,
    asearcher=(f"{VENV}/bin/asearcher",),
    serving_tensor=spec.serving[0].chips,
    journal_dir=JOURNAL,
    **_eval_layout(spec),
  )  # fmt: skip


def _eval_layout(spec: ClusterSpec) -> dict:
  """The evaluation role's part of the layout: its recipe, every N-th version, its slice's chips
  (results under the run dir on the bucket mount, <run_dir>/eval)."""
  e = spec.evaluation
  if e is None:
    return {}
  return {"eval_gin_files": (e.experiment,), "eval_every": e.every, "eval_tensor": e.slice.chips}


def _background(
  name: str, argv: list[str], env: dict[str, str] | None = None, ship_to: str | None = None
) -> str:
  """Shell that starts `argv` detached under launch/supervise.py (restarted after a failed exit
  within SuperviseConfig's budget), its log under ~/asearcher_run shipped to `ship_to`/HOSTNAME
  (the run dir on the bucket mount: a VM's disk goes at `down`), the supervisor's pid file."""
  envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
  cmd = shlex.join(argv).replace(shlex.quote(f"{VENV}/bin/asearcher"), f"{VENV}/bin/asearcher")
  log = f"$HOME/asearcher_run/logs/{name}.log"
  ship = f' --ship-to="{ship_to}/$(hostname)"' if ship_to else ""
  return (
    f"mkdir -p {RUN}/logs {RUN}/pids && cd {CODE} && "
    f"{envs + ' ' if envs else ''}nohup {VENV}/bin/python -m launch.supervise --log={log}{ship} "
    f"-- {cmd} >> {log} 2>&1 & echo $! > {RUN}/pids/{name}.pid"
  )


def up(spec: ClusterSpec) -> list[Command]:
  extra = {"spot": ["--spot"], "reserved": ["--reserved"]}.get(spec.provisioning, [])
  create = [
    Command(argv=("gcloud", "compute", "tpus", "queued-resources", "create", s.name,
                  f"--node-id={s.name}", *_where(spec), f"--accelerator-type={s.accelerator_type}",
                  f"--runtime-version={spec.runtime_version}", *extra))
    for s in spec.slices
  ]  # fmt: skip
  return create + [_state(spec, s) for s in spec.slices] + _create_vms(spec)


def _create_vms(spec: ClusterSpec) -> list[Command]:
  tier = spec.retrieval
  if tier is None:
    return []
  disk = (
    (f"--disk=name={tier.index_disk},mode=ro,device-name=asearcher-index",)
    if tier.index_disk
    else ()
  )
  return [
    Command(argv=("gcloud", "compute", "instances", "create", host, *_where(spec),
                  f"--machine-type={tier.machine_type}", *VM_IMAGE, "--scopes=cloud-platform",
                  *disk))
    for host in tier.hosts
  ]  # fmt: skip


def _index_script(tier: RetrievalTier) -> str:
  """The index at INDEX_MOUNT on a retrieval host: the read-only disk mounted, or the bucket's
  copy brought to the local disk (tantivy memory-maps its files)."""
  prep = f"sudo mkdir -p {INDEX_MOUNT} && "
  if tier.index_disk:
    return prep + (f"(mountpoint -q {INDEX_MOUNT} || sudo mount -o ro,noload "
                   f"/dev/disk/by-id/google-asearcher-index {INDEX_MOUNT})")  # fmt: skip
  return prep + (f"sudo chown \"$USER\" {INDEX_MOUNT} && "
                 f"gcloud storage rsync --recursive {tier.index} {INDEX_MOUNT}")  # fmt: skip


def _state(spec: ClusterSpec, s: Slice) -> Command:
  return Command(argv=("gcloud", "compute", "tpus", "queued-resources", "describe", s.name,
                       *_where(spec), "--format=value(state.state)"), capture=f"state:{s.name}")  # fmt: skip


def dirty_files(repo: str | os.PathLike) -> list[str]:
  """Paths with uncommitted changes and untracked files git does not ignore: the work `setup`'s
  `git archive` of a commit would silently leave behind."""
  out = subprocess.run(
    ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=all"],
    check=True, capture_output=True, text=True, timeout=60,
  ).stdout  # fmt: skip
  return [line[3:] for line in out.splitlines() if line.strip()]


def setup(spec: ClusterSpec, commit: str) -> list[Command]:
  """The same bootstrap on every worker: the code at `commit` (a tarball through the bucket),
  Python 3.11, requirements-runtime.txt (+ jax[tpu] at the pinned jax version on TPU VMs, not on
  the retrieval hosts), the bucket mounted."""
  tarball = f"{spec.bucket}/code/asearcher_jax-{commit}.tar.gz"
  script = f"{spec.bucket}/code/bootstrap-{commit}.sh"
  local = f"/tmp/asearcher_jax-{commit}.tar.gz"
  cmds = [
    Command(argv=("git", "archive", "--format=tar.gz", f"--output={local}", commit)),
    Command(argv=("gcloud", "storage", "cp", local, tarball)),
    Command(argv=("gcloud", "storage", "cp", "launch/bootstrap.sh", script)),
  ]  # fmt: skip
  boot = f"gcloud storage cat {script} | bash -s -- {tarball} {_bucket(spec)[0]} {spec.mount}"
  cmds += [_ssh(spec, s, "all", boot) for s in spec.slices]
  if spec.retrieval is not None:
    index = _index_script(spec.retrieval)
    cmds += [_vm_ssh(spec, host, f"{boot} cpu && {index}") for host in spec.retrieval.hosts]
  return cmds


def logs_dir(spec: ClusterSpec) -> str:
  """Where every process's log is shipped, one directory a host (the bucket mount)."""
  return f"{shared(spec)}/logs"


def compile_cache(spec: ClusterSpec) -> str:
  """The compile cache every TPU role reads and writes (JAX's persistent cache, keyed by the
  program, its devices and the jax version): on the bucket, so a restarted or replaced VM reads
  the programs another compiled instead of paying the cold start again (`python -m launch
  rehearse` reports its seconds per role)."""
  return f"{spec.bucket}/compile_cache"


def start(spec: ClusterSpec, gin_params: tuple[str, ...] = ()) -> list[Command]:
  """Retrieval server on trainer worker 0, serve-model on every serving host (each announces
  itself in an address file on the shared mount), then the trainer on every trainer worker, and
  the evaluation role on its slice when the spec has one."""
  lay = layout(spec, gin_params)
  cache = {"ASEARCHER_COMPILE_CACHE": compile_cache(spec)}
  cmds = [
    Command(argv=("gcloud", "compute", "tpus", "tpu-vm", "describe", spec.trainer.name,
                  *_where(spec), "--format=value(networkEndpoints[0].ipAddress)"),
            capture=TRAINER_IP),
  ]  # fmt: skip
  tier = spec.retrieval
  if tier is not None:  # the tier's replicas, each on its own port
    for i, host in enumerate(tier.hosts):
      cmds.append(Command(argv=("gcloud", "compute", "instances", "describe", host, *_where(spec),
                                "--format=value(networkInterfaces[0].networkIP)"),
                          capture=retrieval_ip(i)))  # fmt: skip
    for host in tier.hosts:
      script = "; ".join(  # each replica detached with its own log and pid file
        _background(
          f"retrieval-{r}", roles.retrieval_argv(lay, spec.retrieval_port + r), None, logs_dir(spec)
        )
        for r in range(tier.replicas)
      )
      cmds.append(_vm_ssh(spec, host, script))
  elif spec.tools == "local":
    cmds.append(_ssh(spec, spec.trainer, 0, _background("retrieval", roles.retrieval_argv(lay),
                                                        None, logs_dir(spec))))  # fmt: skip
  index = 0
  for s in spec.serving:
    for w in range(s.hosts):
      announce = (
        f'mkdir -p {shared(spec)}/addresses && echo "{{\\"http\\": \\"$(hostname -I | '
        f"cut -d' ' -f1):{spec.serve_port}\\\"}}\" > {lay.address_files[index]}"
      )
      # serve-model's own address file names 0.0.0.0; the shared one names this host's IP.
      own = dataclasses.replace(lay, address_files=("/tmp/asearcher_serve.json",))
      serve = _background("serve", roles.serve_argv(own, 0), cache, logs_dir(spec))
      script = f"{announce} && {serve}"
      cmds.append(_ssh(spec, s, w, script))
      index += 1
  coordinator = f"{TRAINER_IP}:{spec.coordinator_port}"
  keys = {k: f"${k}" for k in SECRETS}
  for w in range(spec.trainer.hosts):
    env = roles.trainer_env(coordinator, spec.trainer.hosts, w)
    script = _background("trainer", roles.trainer_argv(lay), {**cache, **env}, logs_dir(spec))
    if spec.tools == "web":  # filled in from the launching environment by run(), never printed
      script = " ".join(f"{k}={v}" for k, v in keys.items()) + f" bash -c {shlex.quote(script)}"
    cmds.append(_ssh(spec, spec.trainer, w, script))
  if spec.evaluation is not None:  # the judge's key (and the web tools') from the environment
    env = {k: f"${k}" for k in (*(SECRETS if spec.tools == "web" else ()), *JUDGE_SECRETS)}
    script = _background("eval", roles.eval_argv(lay), cache)
    script = " ".join(f"{k}={v}" for k, v in env.items()) + f" bash -c {shlex.quote(script)}"
    cmds.append(_ssh(spec, spec.evaluation.slice, 0, script))
  return cmds


_ALIVE = (f"for f in {RUN}/pids/*.pid; do [ -e \"$f\" ] || continue; "
          f"p=$(cat \"$f\"); if kill -0 \"$p\" 2>/dev/null; then s=alive; else s=dead; fi; "
          f"echo \"$(hostname) $(basename \"$f\" .pid) $p $s\"; done")  # fmt: skip


def status(spec: ClusterSpec) -> list[Command]:
  return (
    [_state(spec, s) for s in spec.slices]
    + [_ssh(spec, s, "all", _ALIVE) for s in spec.slices]
    + [_vm_ssh(spec, h, _ALIVE) for h in _retrieval_hosts(spec)]
  )


def logs(spec: ClusterSpec, lines: int = 50) -> list[Command]:
  script = f"tail -n {lines} {RUN}/logs/*.log"
  return [_ssh(spec, s, "all", script) for s in spec.slices] + [
    _vm_ssh(spec, h, script) for h in _retrieval_hosts(spec)
  ]


def stop(spec: ClusterSpec, grace_s: int = 60) -> list[Command]:
  """SIGTERM to every process the launcher started (its pid files; then the files go), a wait
  of at most `grace_s` for them to exit, SIGKILL to any left: when `stop` returns the ports are
  free for the next `start` (a sweep's next point on the same slices)."""
  script = (f"ps=; for f in {RUN}/pids/*.pid; do [ -e \"$f\" ] || continue; p=$(cat \"$f\"); "
            f"kill \"$p\" 2>/dev/null; ps=\"$ps $p\"; rm -f \"$f\"; done; "
            f"for i in $(seq {grace_s}); do a=; for p in $ps; do kill -0 \"$p\" 2>/dev/null "
            f"&& a=1; done; [ -z \"$a\" ] && break; sleep 1; done; "
            f"for p in $ps; do pkill -9 -P \"$p\" 2>/dev/null; kill -9 \"$p\" 2>/dev/null; done; "
            f"true")  # fmt: skip
  return [_ssh(spec, s, "all", script) for s in spec.slices] + [
    _vm_ssh(spec, h, script) for h in _retrieval_hosts(spec)
  ]


def fetch(spec: ClusterSpec, to: str) -> list[Command]:
  """The run's metrics (metrics.jsonl and TensorBoard's event files), episode export and operative
  config from the bucket into the local directory `to` (a sweep's point directory: its table
  reads `to`/metrics/metrics.jsonl, `asearcher inspect` the episodes). The episode export is the
  trainer's shipped segments (`storage.ShippedLogs`), which readers read as one file."""
  train = f"{spec.bucket}/{spec.run_dir or 'runs/' + spec.name}/train"
  return [
    Command(argv=("gcloud", "storage", "cp", "--recursive", f"{train}/metrics", to)),
    Command(argv=("gcloud", "storage", "cp", "--recursive",
                  f"{train}/episodes.jsonl.gz.segments", to)),
    Command(argv=("gcloud", "storage", "cp", f"{train}/operative_config.gin",
                  f"{to}/operative_config.gin")),
  ]  # fmt: skip


def down(spec: ClusterSpec) -> list[Command]:
  cmds = [
    Command(argv=("gcloud", "compute", "tpus", "queued-resources", "delete", s.name,
                  *_where(spec), "--force", "--async", "--quiet"))
    for s in spec.slices
  ]  # fmt: skip
  if hosts := _retrieval_hosts(spec):  # the VMs only: an index disk outlives the run
    cmds.append(Command(argv=("gcloud", "compute", "instances", "delete", *hosts, *_where(spec),
                              "--quiet")))  # fmt: skip
  return cmds


def plan(spec: ClusterSpec, action: str, *, commit: str = "HEAD",
         gin_params: tuple[str, ...] = ()) -> list[Command]:  # fmt: skip
  """Every command of `action`, in order."""
  if action == "setup":
    return setup(spec, commit)
  if action == "start":
    return start(spec, gin_params)
  return {"up": up, "status": status, "logs": logs, "stop": stop, "down": down}[action](spec)


Runner = Callable[[list[str]], str]


def _subprocess(argv: list[str]) -> str:
  return subprocess.run(
    argv, check=True, capture_output=True, text=True, timeout=1800, cwd=REPO
  ).stdout


def run(commands: list[Command], *, dry_run: bool, out=None, runner: Runner = _subprocess,
        wait_active_s: float = 7200.0, poll_s: float = 30.0) -> int:  # fmt: skip
  """Prints each command (substituting captured values) and, unless dry_run, runs it; `state:`
  captures poll until the queued resource is ACTIVE (FAILED/SUSPENDED: error)."""
  out = out or sys.stdout
  values: dict[str, str] = {}
  secrets = {f"${k}": shlex.quote(os.environ.get(k, "")) for k in (*SECRETS, *JUDGE_SECRETS)}
  for c in commands:
    argv = [_fill(a, values) for a in c.argv]
    print(shlex.join(argv), file=out, flush=True)
    if dry_run:
      continue
    argv = [_fill(a, secrets) for a in argv]
    if c.capture and c.capture.startswith("state:"):
      deadline = time.monotonic() + wait_active_s
      while (state := runner(argv).strip()) != "ACTIVE":
        if state in ("FAILED", "SUSPENDED") or time.monotonic() > deadline:
          print(f"launch: {c.capture[6:]} is {state or 'unknown'}", file=sys.stderr)
          return 1
        time.sleep(poll_s)
      continue
    text = runner(argv)
    if c.capture:
      values[c.capture] = text.strip()
    elif text:
      print(text, file=out, end="" if text.endswith("\n") else "\n", flush=True)
  return 0


def _fill(arg: str, values: dict[str, str]) -> str:
  for k, v in values.items():
    arg = arg.replace(k, v)
  return arg
