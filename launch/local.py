"""The local backend: a run's roles as processes on this machine (the simulated pod tests use).

`start` spawns a supervisor (`python -m launch.local supervise RUN_DIR`, its own session) that
starts the retrieval server, N `serve-model` processes and the trainer process(es) with the same
argv as on a pod (launch/roles.py; loopback, free ports, the weights store a directory), writes a
pid file per process, restarts a server that dies while the trainer runs, and when the trainer
exits (or on `stop`) terminates everything it started. `status` reads the pid files, `logs` tails
the logs, `stop` signals the supervisor and waits until no process of the run is left.

Several trainer processes are one `jax.distributed` program (coordinator on 127.0.0.1, each
process with `trainer_devices` fake CPU devices): process 0 runs the rollout controller, the
replay queue and the metrics, every process trains its shard of the mesh and writes its shards
of each checkpoint and published version. A program that loses one process is dead: the others
would block in their next collective until jax's heartbeat timeout takes them down
(`DistributedConfig.heartbeat_timeout_s`, 100 s by default), so the supervisor ends the run as
soon as any trainer process exits with an error, and gives the others `trainer_grace_s` to
follow one that finished cleanly.

A local spec (TOML):
    name = "tiny"
    experiment = "gin/experiments/asearcher_local_qwen2_5_7b.gin"
    overlays = ["gin/overlays/recipe_tiny.gin"]
    run_dir = "runs/launch_tiny"
    serving = 2          # serve-model processes
    retrieval = 1        # retrieval server replicas (tools = "local"), one address dir
    trainers = 2         # trainer processes (jax.distributed: one coordinator, N processes)
    trainer_devices = 2  # fake CPU devices per trainer process (unset: XLA's default, 1)
    tools = "local"      # or "web"
    gin_params = []      # extra bindings, every training role
    restarts = 0         # restarts of each role's process (launch/supervise.py), as on a pod
    evaluation = "gin/experiments/eval_asearcher_local_qwen2_5_7b.gin"  # optional: the eval role
    evaluation_overlays = ["gin/overlays/eval_recipe_tiny.gin"]
    evaluation_every = 1
    evaluation_gin_params = []

The evaluation role (`asearcher eval` watching the weights store, launch/roles.py) is restarted
only if it fails; when the trainer finishes, the supervisor gives it `eval_grace_s` to evaluate
the last versions before tearing everything down.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from asearcher_jax.apps.sweep_launch import pid_alive as _alive
from launch import roles
from launch.spec import REPO, SpecError, check_gin_files, read_toml
from launch.supervise import SuperviseConfig
from launch.supervise import command as supervise_command

ASEARCHER = (sys.executable, "-m", "asearcher_jax.main")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalSpec:
  """One local run."""

  name: str
  experiment: str
  overlays: tuple[str, ...] = ()
  run_dir: str
  serving: int = 1
  # Retrieval server replicas; they announce themselves in one directory, which the trainer's
  # retrieval client reads and spreads its requests over.
  retrieval: int = 1
  trainers: int = 1
  # Fake CPU devices per trainer process (ASEARCHER_LOCAL_DEVICE_COUNT: XLA's host platform
  # device count), so N processes simulate a pod of N hosts; None: XLA's default (one device).
  trainer_devices: int | None = None
  # Fake CPU devices per serve-model process, each replica tensor parallel over all of them (as
  # a serving slice's chips on a pod); None: one device, the recipe's own serving mesh.
  serving_devices: int | None = None
  # A bucket ("gs://name/prefix") for the weights store and the checkpoints, as on a pod (the
  # trainer's replay logs are then appended under the run dir's journal/ and shipped); None:
  # everything in the run dir.
  bucket: str | None = None
  tools: str = "local"
  gin_params: tuple[str, ...] = ()
  # Restarts of each role's process after a failed exit, by launch/supervise.py as on TPU VMs
  # (the trainer resumes from its last checkpoint); 0: a dead trainer process ends the run and
  # this supervisor restarts a dead server at once.
  restarts: int = 0
  # Seconds before a role's first restart (doubled after each).
  restart_backoff_s: float = 1.0
  # The evaluation role's recipe (gin/experiments/eval_*.gin) and overlays; None: no such role.
  evaluation: str | None = None
  evaluation_overlays: tuple[str, ...] = ()
  # Evaluate every N-th published version.
  evaluation_every: int = 1
  # Bindings for the evaluation role only.
  evaluation_gin_params: tuple[str, ...] = ()


_TUPLES = ("overlays", "gin_params", "evaluation_overlays", "evaluation_gin_params")


def load(path: str | Path, experiment: str | None = None) -> LocalSpec:
  p = Path(path)
  d = read_toml(p)
  known = {f.name for f in dataclasses.fields(LocalSpec)}
  if unknown := sorted(set(d) - known):
    hint = "; a gcloud spec? drop --backend local" if {"project", "zone"} & set(unknown) else ""
    raise SpecError(f"{p}: unknown key(s) {', '.join(unknown)} (known: {sorted(known)}){hint}")
  for k in ("serving", "retrieval", "trainers", "trainer_devices", "serving_devices",
            "evaluation_every"):  # fmt: skip
    if not isinstance(d.get(k, 1), int) or d.get(k, 1) < 1:
      raise SpecError(f"{p}: {k} must be an integer >= 1, got {d.get(k)!r}")
  r = d.get("restarts", 0)
  if isinstance(r, bool) or not isinstance(r, int) or r < 0:
    raise SpecError(f"{p}: restarts must be an integer >= 0, got {r!r}")
  b = d.get("restart_backoff_s", 1.0)
  if isinstance(b, bool) or not isinstance(b, int | float) or b < 0:
    raise SpecError(f"{p}: restart_backoff_s must be a number >= 0, got {b!r}")
  if d.get("tools", "local") not in ("local", "web"):
    raise SpecError(f'{p}: tools must be "local" or "web"')
  for k in ("name", "run_dir"):
    if not d.get(k):
      raise SpecError(f"{p}: {k} is required")
    if not isinstance(d[k], str):
      raise SpecError(f"{p}: {k} must be a string, got {d[k]!r}")
  bucket = d.get("bucket")
  if bucket is not None and not (isinstance(bucket, str) and bucket.startswith("gs://")):
    raise SpecError(f'{p}: bucket must be a gs:// URL (e.g. bucket = "gs://name/prefix")')
  exp = experiment or d.get("experiment")
  if not exp:
    raise SpecError(f"{p}: no experiment")
  if not isinstance(exp, str):
    raise SpecError(f"{p}: experiment must be one gin file path (a string), got {exp!r}")
  for k in _TUPLES:
    v = d.get(k, [])
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
      raise SpecError(f'{p}: {k} must be a list of strings (e.g. {k} = ["..."]), got {v!r}')
  evaluation = d.get("evaluation")
  if evaluation is not None and not (isinstance(evaluation, str) and evaluation):
    raise SpecError(f"{p}: evaluation must be one gin file path (a string), got {evaluation!r}")
  if evaluation is None and (d.get("evaluation_overlays") or d.get("evaluation_gin_params")):
    raise SpecError(f"{p}: evaluation_overlays / evaluation_gin_params need evaluation (a recipe)")
  evaluation_files = [evaluation, *d.get("evaluation_overlays", ())] if evaluation else []
  check_gin_files([exp, *d.get("overlays", ()), *evaluation_files], str(p))
  return LocalSpec(**{**d, "experiment": exp, **{k: tuple(d.get(k, ())) for k in _TUPLES}})


def layout(spec: LocalSpec, run: Path, extra: tuple[str, ...] = ()) -> roles.Layout:
  remote = None if spec.bucket is None else f"{spec.bucket.rstrip('/')}/{spec.name}"
  return roles.Layout(
    gin_files=(spec.experiment, *spec.overlays), gin_params=(*spec.gin_params, *extra),
    run_dir=str(run / "train"),
    weights_dir=str(run / "weights") if remote is None else f"{remote}/weights",
    checkpoint_dir=None if remote is None else f"{remote}/checkpoints",
    journal_dir=None if remote is None else str(run / "journal"),
    address_files=tuple(str(run / "addresses" / f"serve-{i}.json") for i in range(spec.serving)),
    retrieval_addr_dir=str(run / "retrieval") if spec.tools == "local" else None,
    host="127.0.0.1", serve_port=0, retrieval_port=0, asearcher=ASEARCHER,
    serving_tensor=spec.serving_devices,
    eval_gin_files=(spec.evaluation, *spec.evaluation_overlays) if spec.evaluation else (),
    eval_gin_params=spec.evaluation_gin_params, eval_every=spec.evaluation_every,
    eval_dir=str(run / "eval"),
  )  # fmt: skip


def run_path(spec: LocalSpec) -> Path:
  """The run's directory (a relative run_dir is under the repository)."""
  return (REPO / spec.run_dir) if not Path(spec.run_dir).is_absolute() else Path(spec.run_dir)


def point_layout(spec: LocalSpec, run_dir: str | None, extra: tuple[str, ...] = ()) -> roles.Layout:
  """The layout of `spec` run in `run_dir` (a sweep point's own; None: the spec's)."""
  if run_dir:
    spec = dataclasses.replace(spec, run_dir=run_dir)
  return layout(spec, run_path(spec), extra)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Supervisor:
  """Starts the roles, restarts dead servers, tears everything down at the end."""

  def __init__(self, spec: LocalSpec, run: Path, extra: tuple[str, ...]) -> None:
    self.spec, self.run = spec, run
    self.lay = layout(spec, run, extra)
    self.procs: dict[str, subprocess.Popen] = {}
    self.argv: dict[str, tuple[list[str], dict[str, str]]] = {}
    self.restarts: dict[str, int] = {}
    self.stopping = False

  def spawn(self, role: str, argv: list[str], env: dict[str, str] | None = None) -> None:
    self.argv[role] = (argv, env or {})
    log = open(self.run / "logs" / f"{role}.log", "a")  # noqa: SIM115 (the child owns it)
    if self.spec.restarts:  # under launch/supervise.py, as on a TPU VM; its child's pid beside
      cfg = SuperviseConfig(max_restarts=self.spec.restarts,
                            backoff_s=float(self.spec.restart_backoff_s),
                            child_pid_file=str(self.run / "pids" / f"{role}.child"))  # fmt: skip
      argv = [*supervise_command(cfg, sys.executable), "--", *argv]
    p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                         env={**os.environ, **(env or {})})  # fmt: skip
    log.close()
    self.procs[role] = p
    (self.run / "pids" / f"{role}.json").write_text(
      json.dumps({"role": role, "pid": p.pid, "argv": argv, "restarts": self.restarts.get(role, 0)})
    )

  def start(self) -> None:
    self.start_retrieval()
    self.start_serving()
    if self.lay.eval_gin_files:
      self.spawn("eval", roles.eval_argv(self.lay))
    coordinator = f"127.0.0.1:{_free_port()}"
    for i in range(self.spec.trainers):
      env = roles.trainer_env(coordinator, self.spec.trainers, i, self.spec.trainer_devices)
      self.spawn(f"trainer-{i}", roles.trainer_argv(self.lay), env)

  def start_serving(self) -> None:
    """The serve-model processes ("serve-0", ...), each over `serving_devices` fake devices."""
    devices = self.spec.serving_devices
    for i in range(self.spec.serving):
      env = None if devices is None else {"ASEARCHER_LOCAL_DEVICE_COUNT": str(devices)}
      self.spawn(f"serve-{i}", roles.serve_argv(self.lay, i), env)

  def start_retrieval(self) -> None:
    """The retrieval replicas ("retrieval", or "retrieval-0", "retrieval-1", ... for several)."""
    for d in ("logs", "pids", "addresses", "weights", "retrieval"):
      (self.run / d).mkdir(parents=True, exist_ok=True)
    if self.spec.tools != "local":
      return
    for i in range(self.spec.retrieval):
      role = "retrieval" if self.spec.retrieval == 1 else f"retrieval-{i}"
      self.spawn(role, roles.retrieval_argv(self.lay))

  def loop(
    self, poll_s: float = 0.5, trainer_grace_s: float = 120.0, eval_grace_s: float = 900.0
  ) -> int:
    """Until every trainer process exited, one failed, or a stop: restarts servers that died
    (and the evaluation role if it failed), gives the evaluation role `eval_grace_s` to finish
    after a clean end of training, then tears everything down; returns 0 when every trainer
    process (and the evaluation role, if any) exited 0, else 1."""
    first_exit = None  # when the first trainer process exited cleanly
    while not self.stopping:
      trainers = {r: p for r, p in self.procs.items() if r.startswith("trainer-")}
      codes = {r: p.poll() for r, p in trainers.items()}
      if all(c is not None for c in codes.values()):
        break
      if failed := sorted(r for r, c in codes.items() if c not in (None, 0)):
        print(f"supervisor: {', '.join(f'{r} exited {codes[r]}' for r in failed)}; the trainer "
              "program lost a process: stopping the run", flush=True)  # fmt: skip
        break
      if first_exit is None and any(c is not None for c in codes.values()):
        first_exit = time.monotonic()
      if first_exit is not None and time.monotonic() - first_exit > trainer_grace_s:
        late = sorted(r for r, c in codes.items() if c is None)
        print(f"supervisor: {', '.join(late)} still running {trainer_grace_s:g} s after "
              "another trainer process finished: stopping the run", flush=True)  # fmt: skip
        break
      for role, p in list(self.procs.items()):
        if role == "eval" and p.poll() == 0:
          continue  # it finished its work: nothing to restart
        if not role.startswith("trainer-") and p.poll() is not None:
          self.restarts[role] = self.restarts.get(role, 0) + 1
          print(f"supervisor: {role} (pid {p.pid}) exited {p.returncode}; restarting", flush=True)
          self.spawn(role, *self.argv[role])
      time.sleep(poll_s)
    codes = [p.poll() for r, p in self.procs.items() if r.startswith("trainer-")]
    evaluator = self.procs.get("eval")
    if evaluator is not None and not self.stopping and codes and all(c == 0 for c in codes):
      deadline = time.monotonic() + eval_grace_s
      while evaluator.poll() is None and not self.stopping and time.monotonic() < deadline:
        time.sleep(poll_s)
      if evaluator.poll() is None:
        print(f"supervisor: eval still running {eval_grace_s:g} s after training ended: "
              "stopping it", flush=True)  # fmt: skip
      codes.append(evaluator.poll())
    self.teardown()
    return 0 if codes and all(c == 0 for c in codes) else 1

  def teardown(self, grace_s: float = 30.0) -> None:
    for p in self.procs.values():
      if p.poll() is None:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in self.procs.values():
      try:
        p.wait(max(deadline - time.monotonic(), 0.1))
      except subprocess.TimeoutExpired:
        role = next(r for r, q in self.procs.items() if q is p)
        print(f"supervisor: {role} (pid {p.pid}) ignored SIGTERM for {grace_s:g} s; killing",
              flush=True)  # fmt: skip
        p.kill()
        p.wait(10)


def supervise(run_dir: str) -> int:
  run = Path(run_dir)
  cfg = json.loads((run / "launch.json").read_text())
  spec = cfg["spec"]
  sup = Supervisor(LocalSpec(**{**spec, **{k: tuple(spec.get(k, ())) for k in _TUPLES}}),
                   run, tuple(cfg["extra"]))  # fmt: skip

  def on_term(*_):
    sup.stopping = True

  signal.signal(signal.SIGTERM, on_term)
  signal.signal(signal.SIGINT, on_term)
  sup.start()
  code = sup.loop()
  (run / "supervisor.done").write_text(f"{code}\n")
  return code


def pids(run: Path) -> dict[str, int]:
  """Every process of the run by role (the supervisor included)."""
  out = {}
  for f in sorted((run / "pids").glob("*.json")) if (run / "pids").exists() else ():
    try:
      out[f.stem] = int(json.loads(f.read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):  # torn or edited: say so, use the rest
      print(f"launch: {f} is not a pid file this launcher wrote; skipped", file=sys.stderr)
  sup = run / "supervisor.pid"
  if sup.exists():
    try:
      out["supervisor"] = int(sup.read_text())
    except (OSError, ValueError):
      print(f"launch: {sup} holds no pid; skipped", file=sys.stderr)
  return out


def main(a) -> int:
  spec = load(a.spec, a.experiment)
  if a.run_dir:  # a sweep point's own directory
    spec = dataclasses.replace(spec, run_dir=a.run_dir)
  run = run_path(spec)
  if a.action == "fetch":
    print(f"launch fetch: the run dir {run} is on this machine already")
    return 0
  if a.action in ("up", "setup", "down"):
    print(f"launch {a.action}: the local backend has nothing to provision")
    return 0
  if a.action == "start":
    if any(_alive(p) for p in pids(run).values()):
      print(f"launch start: {run} already has live processes (stop first)", file=sys.stderr)
      return 1
    roles.check_roles(layout(spec, run, tuple(a.gin_param)))
    argv = [sys.executable, "-m", "launch.local", "supervise", str(run)]
    print(" ".join(argv), flush=True)
    if a.dry_run:  # prints what would run and leaves an earlier run's directory as it was
      return 0
    run.mkdir(parents=True, exist_ok=True)
    for f in (run / "pids").glob("*.json") if (run / "pids").exists() else ():
      f.unlink()
    (run / "supervisor.done").unlink(missing_ok=True)
    (run / "launch.json").write_text(json.dumps(
      {"spec": dataclasses.asdict(spec), "extra": list(a.gin_param)}, indent=1))  # fmt: skip
    log = open(run / "supervisor.log", "a")  # noqa: SIM115
    p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                         start_new_session=True)  # fmt: skip
    (run / "supervisor.pid").write_text(str(p.pid))
    return 0
  if not run.is_dir():
    print(f"launch {a.action}: no run at {run} (start it first, or give its --run_dir)",
          file=sys.stderr)  # fmt: skip
    return 1
  if a.action == "status":
    for role, pid in pids(run).items():
      print(f"{role} {pid} {'alive' if _alive(pid) else 'dead'}")
    return 0
  if a.action == "logs":
    for f in sorted((run / "logs").glob("*.log")):
      print(f"==> {f.name} <==\n" + "\n".join(f.read_text().splitlines()[-a.lines :]))
    return 0
  # stop: the supervisor tears its children down; then make sure nothing is left.
  live = pids(run)
  if "supervisor" in live and _alive(live["supervisor"]):
    os.kill(live["supervisor"], signal.SIGTERM)
  deadline = time.monotonic() + 60
  while any(_alive(p) for p in live.values()) and time.monotonic() < deadline:
    time.sleep(0.2)
  for role, pid in live.items():
    if _alive(pid):
      print(f"launch stop: {role} ({pid}) ignored SIGTERM; killing", file=sys.stderr)
      os.kill(pid, signal.SIGKILL)
  return 0


if __name__ == "__main__":
  if len(sys.argv) == 3 and sys.argv[1] == "supervise":
    sys.exit(supervise(sys.argv[2]))
  sys.exit("usage: python -m launch.local supervise RUN_DIR")
