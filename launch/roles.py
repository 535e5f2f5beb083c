"""What each process of a run executes: the same argv on a TPU worker and on this machine.

A run has three roles, all configured by one gin experiment (the recipe binds train, serve-model
and serve-retrieval; see gin/experiments/*.gin):
  retrieval  `asearcher serve-retrieval` (local tools; web recipes use API keys instead): one
             server on trainer worker 0, or a tier of its own (CPU hosts, N replicas each,
             the index on a disk or copied from the bucket) whose every address the trainer's
             retrieval client is given and spreads its requests over (round robin),
  serving    `asearcher serve-model` per serving host: announces itself in an address file and
             loads every version the trainer publishes to the weights store,
  trainer    `asearcher train` per trainer worker with remote engines (gin's operative config of
             the run lands in its run dir at the end): the rollout controller
             learns the servers from the address files; jax.distributed gets its coordinator,
             process count and id from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
             JAX_PROCESS_ID.
An optional fourth, configured by an evaluation recipe of its own (gin/experiments/eval_*.gin):
  eval       `asearcher eval` watching the weights store: each version the trainer publishes
             (every N-th) is loaded into the role's own engine and evaluated pinned to it (no
             token of another version is scored), results per version under <run_dir>/eval;
             it ends once the trainer has written its operative config and the last version
             is evaluated.
Only the paths, hosts and ports differ between the gcloud and local backends (`Layout`).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

from asearcher_jax.apps import gin_config
from asearcher_jax.errors import AsearcherError
from launch.spec import REPO, SpecError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
  """Where a run's shared state lives and how its processes find each other."""

  # The gin experiment, then overlays layered after it (e.g. gin/overlays/recipe_tiny.gin).
  gin_files: tuple[str, ...]
  # Extra bindings for every role (a sweep point, a step count).
  gin_params: tuple[str, ...] = ()
  # The trainer's run directory (checkpoints, replay, metrics, summary) on the shared filesystem.
  run_dir: str
  # The weights store: the trainer publishes each version here, every server polls it (a
  # gs:// URL on a pod: tensorstore's GCS driver, not the mount).
  weights_dir: str
  # Where the trainer's checkpoints go (a gs:// URL on a pod); None: <run_dir>/checkpoints.
  checkpoint_dir: str | None = None
  # One address file per serving process (the trainer waits for all of them).
  address_files: tuple[str, ...]
  # Where the retrieval servers announce themselves (local backend), or their fixed "host:port"s
  # (a pod: trainer worker 0's server, or every replica of the retrieval tier); both empty: the
  # recipe uses web tools.
  retrieval_addr_dir: str | None = None
  retrieval_addresses: tuple[str, ...] = ()
  # The retrieval servers' index directory and scoring threads; None: the recipe's own.
  retrieval_index_dir: str | None = None
  retrieval_workers: int | None = None
  # Interface the servers bind ("0.0.0.0" on a pod's private network, loopback locally).
  host: str = "127.0.0.1"
  # HTTP port of each serve-model (0: a free one, announced in its address file).
  serve_port: int = 0
  retrieval_port: int = 0
  # The command that runs `asearcher` (a venv's script on a worker, `python -m` locally).
  asearcher: tuple[str, ...] = ("asearcher",)
  # Where the trainer appends its replay logs, shipped to the run dir in sealed segments
  # (`TrainConfig.journal_dir`: a disk of the trainer's own; the run dir on a bucket is never
  # appended to); None: appended in the run dir itself (a local run).
  journal_dir: str | None = None
  # Chips each serve-model splits its replica over (tensor parallel: its serving slice's chips,
  # or a local server's fake devices), and the readers the trainer lays the weight store out for
  # (`WeightSyncConfig.reader_tensor`); None: the recipe's own bindings.
  serving_tensor: int | None = None
  # The evaluation role: an evaluation recipe, then overlays; empty: no evaluation role. Its
  # recipe must import `apps.evaluate as commands`, `evaluation.runner as runner` and
  # `serving.mesh as mesh` (the names the role's bindings use, as gin/experiments/eval_*.gin do).
  eval_gin_files: tuple[str, ...] = ()
  # Bindings for the evaluation role only (`gin_params` configure the training roles).
  eval_gin_params: tuple[str, ...] = ()
  # Evaluate every N-th published version (version 0, the initial weights, never).
  eval_every: int = 1
  # Where the per-version results go; None: <run_dir>/eval.
  eval_dir: str | None = None
  # Chips the evaluation engine splits over (its slice's); None: the recipe's own binding.
  eval_tensor: int | None = None


def _gin(layout: Layout) -> list[str]:
  args = [f"--gin_file={f}" for f in layout.gin_files]
  return args + [f"--gin_param={p}" for p in layout.gin_params]


def _q(s: str) -> str:
  """A gin string literal."""
  return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def retrieval_argv(layout: Layout, port: int | None = None) -> list[str]:
  """A retrieval server on `port` (None: the layout's retrieval_port)."""
  cfg = "server.RetrievalServerConfig"
  args = [
    *layout.asearcher, "serve-retrieval", *_gin(layout),
    # The server's config is built through gin whatever the layout's files bind.
    f"--gin_param=serve_retrieval.serve.server=@{cfg}()",
    f"--gin_param={cfg}.host={_q(layout.host)}",
    f"--gin_param={cfg}.port={layout.retrieval_port if port is None else port}",
  ]  # fmt: skip
  if layout.retrieval_index_dir is not None:
    args.append(f"--gin_param=serve_retrieval.serve.index_dir={_q(layout.retrieval_index_dir)}")
  if layout.retrieval_workers is not None:
    args.append(f"--gin_param={cfg}.workers={layout.retrieval_workers}")
  if layout.retrieval_addr_dir is not None:
    args.append(f"--gin_param={cfg}.addr_dir={_q(layout.retrieval_addr_dir)}")
  return args


def serve_argv(layout: Layout, index: int) -> list[str]:
  """serve-model number `index` (its address file is `layout.address_files[index]`)."""
  return [
    *layout.asearcher, "serve-model", *_gin(layout),
    f"--gin_param=openai_api.OpenAIServerConfig.host={_q(layout.host)}",
    f"--gin_param=openai_api.OpenAIServerConfig.port={layout.serve_port}",
    f"--gin_param=serve_model.serve.address_file={_q(layout.address_files[index])}",
    f"--gin_param=serve_model.serve.weights_dir={_q(layout.weights_dir)}",
    *([] if layout.serving_tensor is None
      else [f"--gin_param=mesh.ServingMeshConfig.tensor={layout.serving_tensor}"]),
  ]  # fmt: skip


def trainer_argv(layout: Layout) -> list[str]:
  files = ", ".join(_q(f) for f in layout.address_files)
  args = [
    *layout.asearcher, "train", *_gin(layout),
    f"--gin_param=commands.train.run_dir={_q(layout.run_dir)}",
    f"--operative_config={layout.run_dir}/operative_config.gin",
    f"--gin_param=train_config.RemoteEnginesConfig.address_files=({files},)",
    f"--gin_param=train_config.RemoteEnginesConfig.weights_dir={_q(layout.weights_dir)}",
  ]  # fmt: skip
  if layout.serving_tensor is not None:  # the store laid out for the servers' slices
    args += [
      "--gin_param=train_config.RemoteEnginesConfig.sync=@weight_sync.WeightSyncConfig()",
      f"--gin_param=weight_sync.WeightSyncConfig.reader_tensor={layout.serving_tensor}",
    ]
  if layout.checkpoint_dir is not None:
    args.append(f"--gin_param=train_config.TrainConfig.checkpoint_dir={_q(layout.checkpoint_dir)}")
  if layout.journal_dir is not None:
    args.append(f"--gin_param=train_config.TrainConfig.journal_dir={_q(layout.journal_dir)}")
  if layout.retrieval_addresses:
    addresses = ", ".join(_q(a) for a in layout.retrieval_addresses)
    where = f"search.LocalRetrievalConfig.addresses=({addresses},)"
  elif layout.retrieval_addr_dir is not None:
    where = f"search.LocalRetrievalConfig.addr_dir={_q(layout.retrieval_addr_dir)}"
  else:
    return args
  return [*args, "--gin_param=wiring.ToolsConfig.local=@search.LocalRetrievalConfig()",
          f"--gin_param={where}"]  # fmt: skip


def eval_argv(layout: Layout) -> list[str]:
  """The evaluation role (module docstring): the trainer's weights store watched, the end of
  training read from the operative config the trainer writes when it finishes."""
  watch = "commands.VersionWatch"
  args = [
    *layout.asearcher, "eval", *(f"--gin_file={f}" for f in layout.eval_gin_files),
    *(f"--gin_param={p}" for p in layout.eval_gin_params),
    f"--gin_param=commands.evaluate.watch=@{watch}()",
    f"--gin_param={watch}.weights_dir={_q(layout.weights_dir)}",
    f"--gin_param={watch}.every={layout.eval_every}",
    f"--gin_param={watch}.done_file={_q(layout.run_dir + '/operative_config.gin')}",
    f"--gin_param=runner.RunnerConfig.output_dir={_q(layout.eval_dir or layout.run_dir + '/eval')}",
  ]  # fmt: skip
  if layout.eval_tensor is not None:
    args.append(f"--gin_param=mesh.ServingMeshConfig.tensor={layout.eval_tensor}")
  if layout.retrieval_addresses:
    addresses = ", ".join(_q(a) for a in layout.retrieval_addresses)
    args.append(f"--gin_param=commands.EvalTools.retrieval_addresses=({addresses},)")
  elif layout.retrieval_addr_dir is not None:
    args += ["--gin_param=commands.EvalTools.retrieval_addresses=()",
             f"--gin_param=commands.EvalTools.retrieval_addr_dir={_q(layout.retrieval_addr_dir)}"]  # fmt: skip
  return args


def trainer_env(
  coordinator: str, processes: int, process_id: int, local_devices: int | None = None
) -> dict[str, str]:
  """jax.distributed's environment for trainer process `process_id` of `processes`;
  `local_devices`: fake CPU devices for it (a pod simulated on one machine; None on a pod)."""
  env = {
    "JAX_COORDINATOR_ADDRESS": coordinator,
    "JAX_NUM_PROCESSES": str(processes),
    "JAX_PROCESS_ID": str(process_id),
  }
  if local_devices is not None:
    env["ASEARCHER_LOCAL_DEVICE_COUNT"] = str(local_devices)
  return env


def role_argvs(layout: Layout, *, evaluation: bool = True) -> dict[str, list[str]]:
  """Each role's `asearcher` argv (without the program) as it will run: the retrieval server
  when the recipe uses local tools, the first serve-model (the others differ only in their
  address file), the trainer, and the evaluation role when the layout has one (`evaluation`)."""
  n = len(layout.asearcher)
  out = {}
  if layout.retrieval_addr_dir is not None or layout.retrieval_addresses:
    out["retrieval"] = retrieval_argv(layout)[n:]
  if layout.address_files:
    out["serving"] = serve_argv(layout, 0)[n:]
  out["trainer"] = trainer_argv(layout)[n:]
  if evaluation and layout.eval_gin_files:
    out["eval"] = eval_argv(layout)[n:]
  return out


def check_layouts(layouts: list[Layout]) -> list[str | None]:
  """Every role of every layout checked in one `asearcher --check-each` process (the imports
  paid once: a sweep's launched points cost ~20 ms each, not a process each): for each layout,
  None or "the ROLE role's configuration: MESSAGE" for its first role that fails."""
  argvs = [role_argvs(lay) for lay in layouts]
  flat = [argv for roles_ in argvs for argv in roles_.values()]
  try:
    results = iter(gin_config.check_elsewhere(flat, cwd=REPO) if flat else ())
  except AsearcherError as e:
    raise SpecError(str(e)) from None
  out = []
  for roles_ in argvs:
    messages = [(role, next(results)) for role in roles_]
    bad = next(((role, m) for role, m in messages if m), None)
    out.append(None if bad is None else f"the {bad[0]} role's configuration: {bad[1]}")
  return out


def check_roles(layout: Layout) -> None:
  """Every role's configuration checked here, in one `asearcher --check-each` process, before
  anything starts anywhere: a typo in the experiment, an overlay or a --gin_param, or a flag this
  module writes that no longer binds, is one SpecError naming the role, not a dead run on a pod."""
  message = check_layouts([layout])[0]
  if message:
    raise SpecError(message)


def rehearse_roles(
  layout: Layout, topologies: dict[str, str], programs: str, timeout_s: float = 7200.0
) -> dict[str, dict]:
  """Every role of `layout` rehearsed (`asearcher rehearse --each`, apps/rehearsal.py) in one
  child process: each role's own command line configured as it will run, its programs
  compiled for its slice (`topologies`: role -> slice name, "cpu" for a host with none) as
  `programs` says (all, largest, arguments). Returns role -> its report (or {"error": ...})."""
  # The evaluation role's engine is the serving engine's binding in its recipe; the rehearsal
  # builds serve-model, train and serve-retrieval only (apps/rehearsal.py), so it is not in it.
  argvs = role_argvs(layout, evaluation=False)
  jobs = [{"topology": topologies[r], "programs": programs, "argv": a} for r, a in argvs.items()]
  # Without compiles one process checks every role in seconds; a compile of a 32B model's
  # programs holds ~10-20 GB of host memory, released only with its process: one a role.
  batches = [jobs] if programs == "arguments" else [[j] for j in jobs]
  reports = []
  deadline = time.monotonic() + timeout_s
  for batch in batches:
    try:
      out = subprocess.run(
        [sys.executable, "-m", "asearcher_jax.main", "rehearse", "--each"], cwd=REPO,
        input="".join(json.dumps(j) + "\n" for j in batch), capture_output=True, text=True,
        timeout=max(deadline - time.monotonic(), 1.0),
      )  # fmt: skip
    except subprocess.TimeoutExpired:
      raise SpecError(f"rehearsing the roles took over {timeout_s:.0f} s") from None
    got = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode < 0 and len(batch) == 1 and not got:  # killed: most likely the kernel's OOM
      got = [{
        "topology": batch[0]["topology"], "fits": False,
        "error": f"the rehearsal was killed by signal {-out.returncode} while compiling (out of "
        "this host's memory? a TPU VM host has far more)",
      }]  # fmt: skip
    if len(got) != len(batch):
      last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
      raise SpecError(f"rehearsing the roles failed: {last}")
    reports += got
  return dict(zip(argvs, reports, strict=True))


def refusal(reports: dict[str, dict]) -> str | None:
  """The line `launch start` ends with for the first role that cannot run (a configuration
  the rehearsal refused, or a program too big for its chip), or None when every role fits."""
  for role, r in reports.items():
    if "error" in r:
      return f"the {role} role: {r['error']}"
    if not r["fits"]:
      what = r.get("largest_program") or "a program"
      need = r.get("hbm_gib_per_chip_max")
      need = "?" if need is None else f"{need:.1f}"
      return (
        f"the {role} role does not fit its slice: it needs {need} GiB a chip on "
        f"{r['topology']} (mesh {r.get('mesh')}; {what}), the chip has "
        f"{r.get('hbm_gib_per_chip')} GiB"
      )
  return None
