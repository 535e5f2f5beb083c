"""Test-session setup shared by every test.

XLA_FLAGS must be set before jax is imported anywhere: 8 fake CPU devices let mesh tests run the
same sharded code a TPU slice would. Tests never touch the network.
"""

import os
from pathlib import Path

import pytest

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
  """<root>/quickstart (a CI-size quickstart: world, evaluations before/after RL, the RL run
  with its episode export and metrics, the report) and <root>/synth (a toy synthesis run).
  ASEARCHER_TINY_RUN=<dir> reuses one built by `python -m tests.notebooks.tiny_run <dir>`."""
  prebuilt = os.environ.get("ASEARCHER_TINY_RUN")  # local iteration: a dir made by tiny_run.py
  if prebuilt:
    return Path(prebuilt)
  root = tmp_path_factory.mktemp("tiny_run")
  from tests.notebooks.tiny_run import make_tiny_run  # imports jax: after the env above

  timings = make_tiny_run(root)
  print(f"tiny run built: {timings}")
  return root
