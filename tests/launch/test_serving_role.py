"""A serving role started the way the launcher starts it (launch/local.py's supervisor: the
argv launch/roles.py writes for every backend): its replica is tensor parallel over every device
it is given, with one KV head a device, as a v5p-8 replica of Qwen2.5-7B is over its 4 chips."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from launch import local

EXPERIMENT = "gin/experiments/asearcher_local_qwen2_5_7b.gin"


@pytest.mark.slow
def test_a_serving_role_started_as_launched_holds_one_kv_head_per_device(tmp_path, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "")  # the server's own device count, not the suite's 8
  spec = local.LocalSpec(
    name="t", experiment=EXPERIMENT, overlays=("gin/overlays/recipe_tiny.gin",),
    run_dir=str(tmp_path), serving=1, serving_devices=2,
  )  # fmt: skip
  sup = local.Supervisor(spec, tmp_path, ())
  for d in ("logs", "pids", "addresses", "weights"):
    (tmp_path / d).mkdir()
  sup.start_serving()
  try:
    address = tmp_path / "addresses" / "serve-0.json"
    deadline = time.monotonic() + 240
    while not address.exists():
      assert sup.procs["serve-0"].poll() is None, (tmp_path / "logs" / "serve-0.log").read_text()
      assert time.monotonic() < deadline, "serve-0 did not announce itself in 240 s"
      time.sleep(0.5)
    http = json.loads(address.read_text())["http"]
    with urllib.request.urlopen(f"http://{http}/health", timeout=30) as r:
      health = json.loads(r.read())
  finally:
    sup.teardown()
  # qwen2-tiny: 4 query heads, 2 KV heads; the recipe's tiny overlay alone would serve on 1.
  assert health["mesh"]["tensor"] == 2 and len(health["mesh"]["devices"]) == 2
  assert health["mesh"]["kv_heads_per_chip"] == 1
