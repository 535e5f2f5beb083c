"""The process environment libtpu reads, set before jax is imported.

With libtpu installed (requirements.txt installs it on Linux x86-64, so `asearcher compile` can
compile for TPU slices on any such host) `import jax` also loads the TPU plugin. On a host with
no TPU the plugin's start-up asks the Cloud TPU metadata server for the accelerator type and the
worker hostnames, fails, and prints "could not determine TPU worker hostnames" and an
`INVALID_ARGUMENT` trace to stderr before falling back to the CPU; it then works. Giving the
plugin the two values it asked for (`quiet_libtpu`) silences it. On a host with a TPU attached
nothing here sets any TPU_* variable: there the plugin reads the real topology.

`for_ahead_of_time` adds JAX_PLATFORMS=cpu for `asearcher compile`: the compile for a slice
that is not there runs in libtpu's compiler (`jax.experimental.topologies`), so no TPU backend
needs to start, and the host's own arrays (none but scalars) live on the CPU.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from collections.abc import MutableMapping

# The libtpu that jax[tpu]==0.10.2 resolves (requirements.txt pins the same).
LIBTPU_REQUIREMENT = "libtpu==0.0.42.1"
INSTALL_HINT = f'pip install "{LIBTPU_REQUIREMENT}" (Linux x86-64; requirements.txt installs it)'

# What the plugin would otherwise look up in the metadata server of a Cloud TPU VM; and no
# /tmp/libtpu_lockfile: it guards a TPU's chips against a second process, and with none attached
# it only made a second compile (another test worker, another command) fail with ABORTED.
_QUIET = {
  "TPU_ACCELERATOR_TYPE": "v5p-8",
  "TPU_WORKER_HOSTNAMES": "localhost",
  "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}


def tpu_attached() -> bool:
  """A TPU is attached to this host: its chips appear as /dev/accel* (v4, v5e, v5p) or under
  /dev/vfio (v6e and later)."""
  return bool(glob.glob("/dev/accel*")) or os.path.exists("/dev/vfio")


def libtpu_installed() -> bool:
  return importlib.util.find_spec("libtpu") is not None


def quiet_libtpu(env: MutableMapping[str, str] = os.environ) -> bool:
  """Without a TPU attached, gives libtpu the accelerator type and worker hostnames it would ask
  the metadata server for, so `import jax` prints nothing; values already set are kept, and
  nothing is set when a TPU is attached, libtpu is missing or JAX_PLATFORMS leaves the TPU out.
  Returns whether it set anything. Call it before jax is imported."""
  platforms = env.get("JAX_PLATFORMS")
  if platforms is not None and platforms.strip() and "tpu" not in platforms:
    return False  # the plugin is never started
  if tpu_attached() or not libtpu_installed():
    return False
  missing = {k: v for k, v in _QUIET.items() if k not in env}
  env.update(missing)
  return bool(missing)


def for_ahead_of_time(env: MutableMapping[str, str] = os.environ) -> None:
  """The environment of a compile for a TPU slice that is not attached: libtpu quiet (see the
  module docstring) and, when jax is not imported yet, JAX on the CPU (the host's own arrays
  are scalars; libtpu's compiler needs no TPU backend). With a TPU attached nothing changes.
  libtpu reads its variables when it starts (the first backend or topology), so this still
  quiets it after `import jax`."""
  if tpu_attached():
    return
  if "jax" not in sys.modules:
    env.setdefault("JAX_PLATFORMS", "cpu")
  if libtpu_installed():
    for k, v in _QUIET.items():
      env.setdefault(k, v)
