"""`python -m launch rehearse` and the fit check of `launch start`: every role of a shipped
spec built from the command line the launcher gives it (launch/roles.py) and compiled, or
measured, for its own slice by libtpu on this host (apps/rehearsal.py)."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest

from asearcher_jax import tpu_env
from launch import cli
from launch.spec import REPO

pytestmark = pytest.mark.skipif(not tpu_env.libtpu_installed(), reason="libtpu not installed")
SPECS = REPO / "launch" / "specs"


def launch(*argv: str) -> tuple[int, str, str]:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = cli.main(list(argv))
  return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
  ("spec", "serving_chips", "kv_heads_per_chip", "trainer_chips"),
  # Qwen2.5-7B has 4 KV heads, Qwen2.5-14B and QwQ-32B (v5p.toml) 8.
  [
    ("v5p_local_7b.toml", 4, 1, 16),
    pytest.param("v5p_local_14b.toml", 4, 2, 32, marks=pytest.mark.slow),  # ~8 s each
    pytest.param("v5p.toml", 4, 2, 32, marks=pytest.mark.slow),
  ],
)
def test_every_role_of_a_shipped_spec_fits_its_slice_as_launched(
  spec, serving_chips, kv_heads_per_chip, trainer_chips
):
  """Arguments only (no compile, seconds): the serving replica is tensor parallel over its
  slice's every chip, its KV heads split (its pools would need ~4x a chip on one), the
  trainer's state is sharded over the whole trainer slice, retrieval needs no accelerator."""
  rc, out, err = launch("rehearse", "--spec", str(SPECS / spec), "--programs", "arguments")
  report = json.loads(out.strip().splitlines()[-1])
  assert rc == 0 and report["all_fit"], err
  serving, trainer = report["roles"]["serving"], report["roles"]["trainer"]
  assert serving["mesh"] == {"tensor": serving_chips} and serving["mesh_is_slice"]
  assert serving["kv_heads_per_chip"] == kv_heads_per_chip and serving["fits"]
  assert serving["arguments_gib_per_chip"] < serving["hbm_gib_per_chip"] == 95.0
  assert trainer["mesh"]["fsdp"] == trainer_chips and trainer["remat_policy"] == "full"
  if "retrieval" in report["roles"]:
    assert report["roles"]["retrieval"]["topology"] == "cpu"


def test_start_refuses_a_spec_whose_role_cannot_fit_before_any_cloud_command():
  """The 7B recipe on v5e-8 serving slices: Qwen2.5-7B's 28 heads do not split over 8 chips,
  so every chip would keep the whole page pool; one line naming the role, its HBM and the
  chip's, exit 2, and no gcloud command printed."""
  rc, out, err = launch("start", "--spec", str(SPECS / "v5e.toml"), "--dry-run")
  assert rc == 2 and out == "" and err.count("\n") == 1, (out, err)
  assert err.startswith("launch start: spec error: the serving role does not fit its slice: ")
  assert "GiB a chip on v5e-8" in err and "the chip has 16.0 GiB" in err


def test_a_replica_bound_to_one_chip_is_refused():
  """What every recipe and the launcher did before binding the serving mesh to the slice: one
  chip of the v5p-8 holds the whole page pool (the launcher now binds the slice's chips)."""
  cmd = [
    sys.executable, "-m", "asearcher_jax.main", "rehearse", "--topology", "v5p-8",
    "--programs", "arguments", "serve-model", "--gin_file=gin/experiments/asearcher_local_qwen2_5_7b.gin",
    "--gin_param=mesh.ServingMeshConfig.tensor=1",
  ]  # fmt: skip
  r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  report = json.loads(r.stdout.strip().splitlines()[-1])
  assert r.returncode == 1 and not report["fits"] and report["mesh"] == {"tensor": 1}
  assert report["hbm_gib_per_chip_max"] > 2 * 95.0  # ~200 GiB of pages and weights on one chip
