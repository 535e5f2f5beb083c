"""The cluster spec: which slices a run gets, where, and with which TPU software.

A spec is a small TOML file (stdlib `tomllib`, no new dependency):

    name = "as-7b"                       # prefix of every resource name
    project = "my-project"
    zone = "us-east5-a"
    bucket = "gs://my-bucket/asearcher"  # code tarballs, run dirs, the weights store
    experiment = "gin/experiments/asearcher_local_qwen2_5_7b.gin"
    runtime_version = "v2-alpha-tpuv5"   # optional: the chip's default
    provisioning = "spot"                # "on-demand" (default), "spot" or "reserved"
    [trainer]
    accelerator_type = "v5p-32"
    [serving]
    accelerator_type = "v5p-8"
    count = 2
    [eval]                               # optional: an evaluation role on a slice of its own
    accelerator_type = "v5p-8"           # one host; the engine is tensor parallel over its chips
    experiment = "gin/experiments/eval_asearcher_local_qwen2_5_7b.gin"
    every = 10                           # evaluate every 10th published version
    [retrieval]                          # optional: a retrieval tier of its own (CPU VMs)
    machine_type = "n2-highmem-16"
    count = 2                            # hosts
    replicas = 2                         # servers per host, on retrieval_port, +1, ...
    workers = 8                          # scoring threads per server
    index = "gs://my-bucket/index/wiki18-tantivy"  # copied to each host at setup, or
    # index_disk = "wiki18-tantivy"      # a persistent disk holding the index (read-only)
    [gke]                                # optional: the GKE backend's cluster and image (launch/gke.py)

Chips, accelerator-type names and runtime versions follow the Cloud TPU documentation
(checked 2026-11-25):
  runtime versions  https://cloud.google.com/tpu/docs/runtimes ("PyTorch and JAX": v6e
                    v2-alpha-tpuv6e, v5p v2-alpha-tpuv5, v5e v2-alpha-tpuv5-lite, v4 and older
                    tpu-ubuntu2204-base; the gcloud reference's own v4 example uses
                    v2-alpha-tpuv4, accepted too)
  v5p               https://cloud.google.com/tpu/docs/v5p ("v5p-32 = 32 TensorCores, 16 chips",
                    4 chips per host, 95 GB HBM2e per chip)
  v5e               https://cloud.google.com/tpu/docs/v5e (v5litepod-N = N chips, 16 GB HBM2,
                    up to 8 chips on one host, 4 per host in multi-host slices)
  v6e               https://cloud.google.com/tpu/docs/v6e (v6e-N = N chips, 32 GB HBM)
  v4                https://cloud.google.com/tpu/docs/v4 (v4-N = N TensorCores, 2 per chip,
                    4 chips per host, 32 GiB HBM)
A mistake is one `SpecError` naming the file and key, raised before any command runs.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The checkout launch/ runs from: gin files are looked up and commands run here.
REPO = Path(__file__).resolve().parents[1]

# Keys only a local-backend spec has (launch/local.py's LocalSpec).
LOCAL_ONLY_KEYS = {
  "overlays",
  "run_dir",
  "trainers",
  "trainer_devices",
  "serving_devices",
  "gin_params",
}


class SpecError(ValueError):
  """A cluster spec that cannot be launched; the message names the file and key."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
  """One TPU generation as gcloud names and sizes it."""

  # Short name used by the planner and in messages ("v5e").
  name: str
  # Prefix of its accelerator types ("v5litepod" in "v5litepod-16").
  type_prefix: str
  # What the number in the accelerator type counts: "cores" (TensorCores, 2 per chip) or "chips".
  counts: str
  # HBM per chip, GB as the documentation states it.
  hbm_gb: float
  # Runtime versions that match the chip; the first is the default.
  runtimes: tuple[str, ...]
  # Chips on one host of a single-host slice, and per host of a multi-host slice.
  single_host_chips: int
  chips_per_host: int
  # Valid slice sizes (the accelerator type's number).
  sizes: tuple[int, ...]


_POW2 = tuple(2**i for i in range(0, 14))
CHIPS: dict[str, Chip] = {
  c.name: c
  for c in (
    Chip(name="v4", type_prefix="v4", counts="cores", hbm_gb=32.0,
         runtimes=("tpu-ubuntu2204-base", "v2-alpha-tpuv4"), single_host_chips=4,
         chips_per_host=4, sizes=tuple(s for s in _POW2 if s >= 8)),
    Chip(name="v5e", type_prefix="v5litepod", counts="chips", hbm_gb=16.0,
         runtimes=("v2-alpha-tpuv5-lite",), single_host_chips=8, chips_per_host=4,
         sizes=(1, 4, 8, 16, 32, 64, 128, 256)),
    Chip(name="v5p", type_prefix="v5p", counts="cores", hbm_gb=95.0,
         runtimes=("v2-alpha-tpuv5",), single_host_chips=4, chips_per_host=4,
         sizes=tuple(s for s in _POW2 if s >= 8)),
    Chip(name="v6e", type_prefix="v6e", counts="chips", hbm_gb=32.0,
         runtimes=("v2-alpha-tpuv6e",), single_host_chips=8, chips_per_host=4,
         sizes=(1, 4, 8, 16, 32, 64, 128, 256)),
  )
}  # fmt: skip
# Both spellings of a slice: gcloud's accelerator type ("v5litepod-16") and the planner's and
# compiler's name ("v5e-16", rl/aot.py SLICES), so a spec and `asearcher compile` take the same.
_BY_PREFIX = {**{c.name: c for c in CHIPS.values()}, **{c.type_prefix: c for c in CHIPS.values()}}
PROVISIONING = ("on-demand", "spot", "reserved")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Slice:
  """One queued resource: a TPU slice of `hosts` VMs."""

  # Resource name (queued resource id = node id).
  name: str
  # gcloud accelerator type, e.g. "v5p-32".
  accelerator_type: str
  chip: Chip
  # Chips in the slice and VMs (workers) it has.
  chips: int
  hosts: int


def gcloud_type(accelerator_type: str) -> str:
  """gcloud's spelling of a slice named either way: 'v5e-16' -> 'v5litepod-16' (others as
  given); the type parse_accelerator accepts."""
  m = re.fullmatch(r"([a-z0-9]+)-(\d+)", accelerator_type)
  chip = _BY_PREFIX.get(m.group(1)) if m else None
  return f"{chip.type_prefix}-{m.group(2)}" if chip is not None else accelerator_type


def parse_accelerator(accelerator_type: str, where: str) -> tuple[Chip, int, int]:
  """'v5p-32' -> (v5p, 16 chips, 4 hosts), 'v5litepod-16' or 'v5e-16' -> (v5e, 16 chips, 4
  hosts); SpecError naming `where` otherwise."""
  m = re.fullmatch(r"([a-z0-9]+)-(\d+)", accelerator_type)
  chip = _BY_PREFIX.get(m.group(1)) if m else None
  if chip is None:
    known = ", ".join(
      f"{c.type_prefix}-N" + (f" or {c.name}-N" if c.name != c.type_prefix else "")
      for c in CHIPS.values()
    )
    raise SpecError(f"{where}: unknown accelerator type {accelerator_type!r} (known: {known})")
  n = int(m.group(2))
  if n not in chip.sizes:
    raise SpecError(
      f"{where}: {accelerator_type!r} is not a {chip.name} slice size (sizes: "
      f"{', '.join(map(str, chip.sizes))})"
    )
  chips = n // 2 if chip.counts == "cores" else n
  hosts = 1 if chips <= chip.single_host_chips else chips // chip.chips_per_host
  return chip, chips, hosts


@dataclasses.dataclass(frozen=True, kw_only=True)
class RetrievalTier:
  """The retrieval service on CPU VMs of its own: `count` hosts, `replicas` servers each."""

  # Resource name prefix of its VMs (<name>-retrieval-<i>).
  name: str
  # Compute Engine machine type (https://cloud.google.com/compute/docs/machine-resource).
  machine_type: str = "n2-highmem-16"
  # Hosts, and servers per host (ports retrieval_port, retrieval_port + 1, ...).
  count: int = 1
  replicas: int = 2
  # Scoring threads per server (server.RetrievalServerConfig.workers).
  workers: int = 4
  # The index: a gs:// URL (copied to each host's disk at setup: tantivy memory-maps it, which a
  # bucket mount serves slowly), or None with `index_disk`.
  index: str | None = None
  # A persistent disk holding the index at its root, attached read-only to every host (one disk,
  # many readers) and mounted at INDEX_MOUNT.
  index_disk: str | None = None

  @property
  def hosts(self) -> tuple[str, ...]:
    return tuple(f"{self.name}-{i}" for i in range(self.count))


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalRole:
  """The evaluation role on a slice of its own: `asearcher eval` watching the weights store,
  each published version (every `every`-th) evaluated in its own engine (launch/roles.py)."""

  # Its slice: one host, the evaluation engine tensor parallel over the host's chips.
  slice: Slice
  # The evaluation recipe (gin/experiments/eval_*.gin), repository-relative.
  experiment: str
  # Evaluate every N-th published version.
  every: int = 1


# Where a retrieval host keeps its index (copied from the bucket, or the disk mounted there).
INDEX_MOUNT = "/mnt/asearcher-index"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterSpec:
  """A validated spec: one trainer slice and N serving slices of one TPU generation."""

  # Where it came from (messages name it).
  source: str
  # Prefix of every resource name; lowercase letters, digits and '-'.
  name: str
  project: str
  zone: str
  # gs:// URL under which code tarballs, the run and the weights store live.
  bucket: str
  # The gin experiment every role runs (repository-relative).
  experiment: str
  # One runtime version for every slice, matching their chip.
  runtime_version: str
  # "on-demand", "spot" or "reserved".
  provisioning: str
  # "local": a retrieval server on trainer worker 0; "web": Serper/Jina keys from the launching
  # environment ($SERPER_API_KEY, $JINA_API_KEY) are passed to the trainer.
  tools: str = "local"
  trainer: Slice
  serving: tuple[Slice, ...]
  # Port of each serve-model host's HTTP API and of the retrieval server, and the
  # jax.distributed coordinator port on trainer worker 0.
  serve_port: int = 8010
  retrieval_port: int = 8000
  coordinator_port: int = 8476
  # Where the bucket is mounted on every worker (gcsfuse): the shared directory for the run dir,
  # address files and the weights store.
  mount: str = "/mnt/asearcher"
  # The run's directory under the bucket (None: runs/<name>); `--run_dir` sets it, so that runs
  # one after another on the same slices (a sweep's points) keep their own run dirs.
  run_dir: str | None = None
  # A retrieval tier of its own; None: one retrieval server on trainer worker 0.
  retrieval: RetrievalTier | None = None
  # The evaluation role ([eval]); None: no evaluation while training.
  evaluation: EvalRole | None = None

  @property
  def chip(self) -> Chip:
    return self.trainer.chip

  @property
  def slices(self) -> tuple[Slice, ...]:
    extra = (self.evaluation.slice,) if self.evaluation is not None else ()
    return (self.trainer, *self.serving, *extra)


_TOP_KEYS = {"name", "project", "zone", "bucket", "experiment", "runtime_version", "provisioning",
             "trainer", "serving", "tools", "serve_port", "retrieval_port", "coordinator_port", "mount",
             "retrieval", "eval", "gke"}  # fmt: skip


def _str(d: dict, key: str, where: str, default: str | None = None) -> str:
  v = d.get(key, default)
  if not isinstance(v, str) or not v:
    raise SpecError(f"{where}: {key} must be a non-empty string, got {v!r}")
  return v


def from_dict(
  d: dict[str, Any], source: str = "<spec>", experiment: str | None = None
) -> ClusterSpec:
  """Validates a parsed spec; `experiment` (the command line's) wins over the file's."""
  unknown = sorted(set(d) - _TOP_KEYS)
  if unknown:
    hint = "; a local spec? add --backend local" if set(unknown) & LOCAL_ONLY_KEYS else ""
    raise SpecError(
      f"{source}: unknown key(s) {', '.join(unknown)} (known: {sorted(_TOP_KEYS)}){hint}"
    )
  name = _str(d, "name", source)
  if not re.fullmatch(r"[a-z][a-z0-9-]{0,40}", name):
    raise SpecError(f"{source}: name {name!r} must be lowercase letters, digits and '-'")
  bucket = _str(d, "bucket", source)
  if not bucket.startswith("gs://"):
    raise SpecError(f"{source}: bucket must be a gs:// URL, got {bucket!r}")
  provisioning = d.get("provisioning", "on-demand")
  if provisioning not in PROVISIONING:
    raise SpecError(f"{source}: provisioning must be one of {PROVISIONING}, got {provisioning!r}")
  t = d.get("trainer")
  if not isinstance(t, dict):
    raise SpecError(f"{source}: a [trainer] table with accelerator_type is required")
  chip, chips, hosts = parse_accelerator(
    _str(t, "accelerator_type", f"{source} [trainer]"), f"{source} [trainer] accelerator_type"
  )
  trainer = Slice(name=f"{name}-trainer", accelerator_type=gcloud_type(t["accelerator_type"]), chip=chip,
                  chips=chips, hosts=hosts)  # fmt: skip
  s = d.get("serving", {})
  if not isinstance(s, dict):
    raise SpecError(f"{source}: serving must be a [serving] table with accelerator_type, got {s!r}")
  count = s.get("count", 1)
  if not isinstance(count, int) or count < 1:
    raise SpecError(f"{source} [serving]: count must be an integer >= 1, got {count!r}")
  s_type = _str(s, "accelerator_type", f"{source} [serving]")
  s_chip, s_chips, s_hosts = parse_accelerator(s_type, f"{source} [serving] accelerator_type")
  if s_chip is not chip:
    raise SpecError(
      f"{source}: [serving] is {s_chip.name} but [trainer] is {chip.name}; one runtime version "
      "serves one TPU generation, so both must be the same chip"
    )
  serving = tuple(
    Slice(name=f"{name}-serve-{i}", accelerator_type=gcloud_type(s_type), chip=s_chip, chips=s_chips,
          hosts=s_hosts)
    for i in range(count)
  )  # fmt: skip
  runtime = d.get("runtime_version", chip.runtimes[0])
  if runtime not in chip.runtimes:
    raise SpecError(
      f"{source}: runtime_version {runtime!r} does not match {chip.name} "
      f"(use {' or '.join(chip.runtimes)}; https://cloud.google.com/tpu/docs/runtimes)"
    )
  tools = d.get("tools", "local")
  if tools not in ("local", "web"):
    raise SpecError(f'{source}: tools must be "local" or "web", got {tools!r}')
  exp = experiment or d.get("experiment")
  if not exp:
    raise SpecError(f'{source}: no experiment (set experiment = "gin/experiments/...")')
  if not isinstance(exp, str):
    raise SpecError(f"{source}: experiment must be one gin file path (a string), got {exp!r}")
  ports = {k: d.get(k, v) for k, v in (("serve_port", 8010), ("retrieval_port", 8000),
                                        ("coordinator_port", 8476))}  # fmt: skip
  for k, v in ports.items():
    if not isinstance(v, int) or not 0 < v < 65536:
      raise SpecError(f"{source}: {k} must be a TCP port, got {v!r}")
  retrieval = _retrieval(d.get("retrieval"), source, name, tools)
  evaluation = _evaluation(d.get("eval"), source, name, chip)
  return ClusterSpec(
    source=source, name=name, project=_str(d, "project", source), zone=_str(d, "zone", source),
    bucket=bucket.rstrip("/"), experiment=exp, runtime_version=runtime,
    provisioning=provisioning, tools=tools, trainer=trainer, serving=serving,
    mount=_str(d, "mount", source, "/mnt/asearcher"), retrieval=retrieval,
    evaluation=evaluation, **ports,
  )  # fmt: skip


def _evaluation(t: Any, source: str, name: str, chip: Chip) -> EvalRole | None:
  """The [eval] table; SpecError naming the key for any mistake."""
  if t is None:
    return None
  where = f"{source} [eval]"
  if not isinstance(t, dict):
    raise SpecError(f"{source}: eval must be an [eval] table, got {t!r}")
  if unknown := sorted(set(t) - {"accelerator_type", "experiment", "every"}):
    raise SpecError(f"{where}: unknown key(s) {', '.join(unknown)} "
                    "(known: accelerator_type, experiment, every)")  # fmt: skip
  kind = _str(t, "accelerator_type", where)
  e_chip, chips, hosts = parse_accelerator(kind, f"{where} accelerator_type")
  if e_chip is not chip:
    raise SpecError(f"{where}: {e_chip.name} but [trainer] is {chip.name}; one runtime version "
                    "serves one TPU generation")  # fmt: skip
  if hosts != 1:
    raise SpecError(f"{where}: {kind} has {hosts} hosts; the evaluation engine runs on one host")
  every = t.get("every", 1)
  if isinstance(every, bool) or not isinstance(every, int) or every < 1:
    raise SpecError(f"{where}: every must be an integer >= 1, got {every!r}")
  piece = Slice(name=f"{name}-eval", accelerator_type=kind, chip=e_chip, chips=chips, hosts=1)
  return EvalRole(slice=piece, experiment=_str(t, "experiment", where), every=every)


def _retrieval(t: Any, source: str, name: str, tools: str) -> RetrievalTier | None:
  """The [retrieval] table; SpecError naming the key for any mistake."""
  if t is None:
    return None
  where = f"{source} [retrieval]"
  if not isinstance(t, dict):
    raise SpecError(f"{source}: retrieval must be a [retrieval] table, got {t!r}")
  if tools != "local":
    raise SpecError(f'{where}: a retrieval tier serves local tools, but tools = "{tools}"')
  known = {f.name for f in dataclasses.fields(RetrievalTier)} - {"name"}
  if unknown := sorted(set(t) - known):
    raise SpecError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {sorted(known)})")
  for k in ("count", "replicas", "workers"):
    v = t.get(k, 1)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise SpecError(f"{where}: {k} must be an integer >= 1, got {v!r}")
  index, disk = t.get("index"), t.get("index_disk")
  if (index is None) == (disk is None):
    raise SpecError(f"{where}: give exactly one of index (a gs:// URL) and index_disk")
  if index is not None and (not isinstance(index, str) or not index.startswith("gs://")):
    raise SpecError(f"{where}: index must be a gs:// URL of the index directory, got {index!r}")
  if disk is not None and (not isinstance(disk, str) or not re.fullmatch(r"[a-z][a-z0-9-]*", disk)):
    raise SpecError(f"{where}: index_disk must be a disk name, got {disk!r}")
  return RetrievalTier(name=f"{name}-retrieval", machine_type=_str(t, "machine_type", where,
                       "n2-highmem-16"), **{k: t[k] for k in ("count", "replicas", "workers")
                       if k in t}, index=index.rstrip("/") if index else None, index_disk=disk)  # fmt: skip


def with_run_dir(spec: ClusterSpec, run_dir: str | None) -> ClusterSpec:
  """`spec` with the run directory `run_dir` (relative to the bucket; None: unchanged)."""
  if run_dir is None:
    return spec
  if not run_dir or run_dir.startswith("/") or ".." in Path(run_dir).parts:
    raise SpecError(f"--run_dir: {run_dir!r} must be a relative path under {spec.bucket}")
  return dataclasses.replace(spec, run_dir=run_dir.strip("/"))


def read_toml(path: str | Path) -> dict:
  """A spec file's table; a missing, unreadable or malformed file is one SpecError."""
  p = Path(path)
  try:
    return tomllib.loads(p.read_text())
  except FileNotFoundError:
    raise SpecError(f"{p}: no such spec file") from None
  except OSError as e:  # a directory, no permission
    raise SpecError(f"{p}: cannot read the spec ({(e.strerror or str(e)).lower()})") from None
  except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
    raise SpecError(f"{p}: not valid TOML: {e}") from None


def check_gin_files(files: Sequence[str], source: str) -> None:
  """Each gin file a spec names exists here (relative paths: from the working directory or the
  repository root, as `asearcher` finds them); the workers run this checkout's files."""
  for f in files:
    if not any((base / f).is_file() for base in (Path.cwd(), REPO)):
      raise SpecError(f"{source}: gin file {f!r} does not exist (relative to the repository root)")


def load(path: str | Path, experiment: str | None = None) -> ClusterSpec:
  """Reads and validates a TOML spec."""
  spec = from_dict(read_toml(path), str(path), experiment)
  evaluation = [spec.evaluation.experiment] if spec.evaluation is not None else []
  check_gin_files([spec.experiment, *evaluation], str(path))
  return spec
