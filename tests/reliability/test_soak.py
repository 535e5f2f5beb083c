"""A CI-sized soak (`harness.soak`): asynchronous RL with 10 % of tool requests broken by the fault
proxy, a weight update every step, the retrieval server stopped and restarted once per life and
two restarts of the whole run from its directory. The full-length soak (300 steps) is
`benchmarks/reliability.py`.

Shown from the run directory: no hang, no group lost or trained twice, staleness of every trained
token <= eta, token versions never go backwards; faults were really injected and survived. And
the API keys and server token planted in the environment appear nowhere in the run directory or
the logs.
"""

from __future__ import annotations

import logging
import os

import pytest

from asearcher_jax import http_guard
from harness.soak import SoakConfig, run_soak
from tests.tools import fakes

STEPS = int(os.environ.get("ASEARCHER_SOAK_STEPS", "6"))
PLANTED = {
  "SERPER_API_KEY": fakes.SERPER_KEY,
  "JINA_API_KEY": fakes.JINA_KEY,
  http_guard.TOKEN_ENV: "planted-server-token-5b1e0c",
}


@pytest.mark.slow
@pytest.mark.timeout(3600)  # ~2 min per life on 2 busy cores
def test_soak_with_tool_faults_and_restarts(
  tmp_path, byte_tok_dir, shipped_index_dir, monkeypatch, caplog
):
  for k, v in PLANTED.items():
    monkeypatch.setenv(k, v)
  caplog.set_level(logging.DEBUG)
  run_dir = tmp_path / "soak"
  out = run_soak(
    SoakConfig(steps=STEPS, restarts=2, tool_fault_rate=0.1, server_outage_s=1.0, seed=3),
    run_dir=run_dir, tokenizer_dir=str(byte_tok_dir), index_dir=str(shipped_index_dir),
  )  # fmt: skip
  print(out)
  assert out["hangs"] == 0 and out["errors"] == [] and out["lives"] == 3
  assert out["resumed_at"][0] is None and out["resumed_at"][1:] == [STEPS // 3, 2 * STEPS // 3]
  assert out["steps"] == STEPS
  assert out["lost_groups"] == 0 and out["duplicated_groups"] == 0
  assert out["versions_backwards"] == 0 and out["max_staleness"] <= out["eta"]
  assert out["faults_injected"] > 0 and out["server_restarts"] == 3
  assert out["rss_mb_last"] > 0 and len(out["rss_mb_per_life"]) == 3
  # No secret in any file of the run directory, nor in any log record.
  for path in run_dir.rglob("*"):
    if path.is_file():
      data = path.read_bytes()
      for name, value in PLANTED.items():
        assert value.encode() not in data, f"{name} leaked into {path}"
  for name, value in PLANTED.items():
    assert value not in caplog.text, f"{name} leaked into the logs"
