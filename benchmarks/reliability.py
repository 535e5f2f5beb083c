"""The reliability suite in bounded time: what a week-long run would meet, and what it survived.

Runs with no arguments (about 15-20 minutes on 2 busy CPU cores; `--soak-minutes`, `--kills`,
... scale it, `--soak-steps 300` for the full soak). Parts, each on real processes or servers on
127.0.0.1:

  soak        `harness.soak`: asynchronous RL of a tiny byte-level policy with a weight update
              every step, 10 % of tool requests broken by `harness.faults.FaultProxy` (429, 500,
              timeouts, truncated / non-UTF-8 bodies, dropped connections), the retrieval server
              stopped and restarted once per life, two restarts of the run from its directory;
              bounded by --soak-minutes (fewer steps than --soak-steps may run: reported).
  sigkill     `harness.crash_loop`: `asearcher train` SIGKILLed at random points --kills
              times in one run directory, then run to the end; resumed episodes must replay every
              recorded call from their journals.
  abuse       both HTTP servers (retrieval; serve-model's OpenAI API over a tiny engine):
              malformed requests derived from each endpoint's body, an oversized body, a
              byte-a-second client (headers, then body), a flood past max_inflight.
  checkpoint  a save that fails with ENOSPC (one clear error) and a corrupt newest checkpoint
              (restore falls back to the previous one, loudly).

Prints one table (load held, faults injected / survived, bad inputs, hangs, work lost), then one
JSON line. A fault counts as survived when its part ended with no hang and no lost or duplicated
group (soak: tool faults, retrieval-server restarts and the two run restarts; sigkill: kills;
checkpoint: a clear ENOSPC error and a loud fallback); bad inputs must all get a 4xx / 503. Lost and duplicated groups come from the run directories' files (`rl.audit`), max
staleness from the trained tokens' versions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # harness/ at the repository root

import jax.numpy as jnp
from flax import nnx

from asearcher_jax.checkpoint import CheckpointConfig, Checkpointer
from asearcher_jax.errors import CheckpointError
from asearcher_jax.model import transformer
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.rl.audit import audit_run
from asearcher_jax.serving.driver import Driver
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.serving.openai_api import OpenAIServer, OpenAIServerConfig
from asearcher_jax.tokenizer import Tokenizer
from asearcher_jax.tools.retrieval.corpus import default_corpus_paths
from asearcher_jax.tools.retrieval.index import build_index_dir, load_index
from asearcher_jax.tools.retrieval.server import RetrievalServer, RetrievalServerConfig
from harness import abuse
from harness.agent_workload import write_byte_tokenizer
from harness.crash_loop import (
  CrashLoopConfig,
  cpu_env,
  resume_evidence,
  run_lives,
  train_command,
  write_gin,
)
from harness.faults import no_space_on_save
from harness.soak import SoakConfig, run_soak

REPO = Path(__file__).resolve().parents[1]
ROW = "{:<16} {:<36} {:>8} {:>9} {:>7} {:>6} {:>5} {:>4}"


def soak_part(args, tmp: Path, tok: Path, index: Path) -> dict[str, Any]:
  cfg = SoakConfig(
    steps=args.soak_steps, restarts=args.soak_restarts, tool_fault_rate=args.fault_rate, seed=args.seed,
    max_seconds=args.soak_minutes * 60.0,
  )  # fmt: skip
  out = run_soak(cfg, run_dir=tmp / "soak", tokenizer_dir=str(tok), index_dir=str(index))
  clean = out["hangs"] == 0 and out["lost_groups"] == 0 and out["duplicated_groups"] == 0
  out["injected"] = out["faults_injected"] + out["server_restarts"] + args.soak_restarts
  out["survived"] = out["injected"] if clean else 0
  return out


def sigkill_part(args, tmp: Path, tok: Path, index: Path) -> dict[str, Any]:
  run_dir = tmp / "killed"
  gin = write_gin(
    tmp / "train.gin", vocab=260, run_dir=run_dir, tok_dir=tok, index_dir=index, steps=10_000,
    eta=1,
  )  # fmt: skip
  cfg = CrashLoopConfig(kills=args.kills, seed=args.seed)
  lives = run_lives(train_command(gin), run_dir, cfg, env=cpu_env(tmp / "jax-cache"), cwd=REPO)
  ev = resume_evidence(run_dir, lives)
  audit = audit_run(run_dir)
  clean = not ev["mismatches"] and audit.lost == 0 and audit.duplicated == 0
  return {
    "kills": ev["kills"], "lives": ev["lives"], "steps": audit.committed,
    "resumed_episodes": ev["resumed_episodes"], "replayed_calls": ev["replayed_calls"],
    "saved_calls": ev["saved_calls"], "continued_tokens": ev["continued_tokens"],
    "mismatches": len(ev["mismatches"]), "lost_groups": audit.lost,
    "duplicated_groups": audit.duplicated, "max_staleness": audit.max_staleness,
    "survived": ev["kills"] if clean else 0, "seconds": round(sum(x.seconds for x in lives), 1),
  }  # fmt: skip


async def _abuse_server(port: int, endpoints: list[abuse.Endpoint], n: int, limit: int) -> dict:
  base = f"http://127.0.0.1:{port}"
  rep = await abuse.malformed_requests(base, endpoints, n=n, seed=0, timeout_s=120)
  status = await abuse.oversized(base, endpoints[0], limit + 1)
  slow_h, _ = await abuse.slow_client("127.0.0.1", port, endpoints[0].path, body=False)
  slow_b, got = await abuse.slow_client("127.0.0.1", port, endpoints[0].path, body=True)
  fl = await abuse.flood(base, endpoints[0], n=400, concurrency=128, timeout_s=120)
  bad = rep.tried + 3
  hangs = rep.hangs + fl.hangs + int(slow_h == float("inf")) + int(slow_b == float("inf"))
  errors = rep.server_errors + fl.server_errors + int(status != 413) + int(b" 408 " not in got[:20])
  return {
    "bad_inputs": bad, "flood": fl.tried, "flood_503": fl.statuses[503], "hangs": hangs,
    "server_errors": errors, "slowloris_header_s": round(slow_h, 1),
    "slowloris_body_s": round(slow_b, 1), "survived": bad + fl.tried if not hangs + errors else 0,
  }  # fmt: skip


def abuse_part(args, index: Path) -> dict[str, Any]:
  slow = {"header_timeout_s": 3.0, "body_timeout_s": 3.0}

  async def main() -> dict[str, Any]:
    r = RetrievalServer(load_index(index), RetrievalServerConfig(max_inflight=16, **slow))
    port = await r.start()
    try:
      ret = await _abuse_server(
        port,
        [
          abuse.Endpoint(path="/retrieve", valid={"queries": ["Lothair II"], "topk": 3}),
          abuse.Endpoint(path="/access", valid={"urls": ["https://en.wikipedia.org/wiki/Lilu"]}),
        ],
        args.bad_inputs,
        r.config.max_request_bytes,
      )
    finally:
      await r.stop()
    cfg = ModelConfig(
      vocab_size=101, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2,
      num_kv_heads=1, rope_theta=10000.0, max_position_embeddings=128,
    )  # fmt: skip
    engine = Engine.from_model(
      transformer.Transformer(cfg, rngs=nnx.Rngs(0)), Tokenizer.qwen2(),
      EngineConfig(max_slots=4, max_seq_len=64, prefill_buckets=(16, 32)),
    )  # fmt: skip
    driver = Driver(engine)
    api = OpenAIServer(driver, OpenAIServerConfig(max_body_bytes=64 << 10, max_inflight=8, **slow))
    port = await api.start()
    try:
      oai = await _abuse_server(
        port,
        [
          abuse.Endpoint(path="/v1/completions", valid={"prompt": [9, 3, 88], "max_tokens": 2}),
          abuse.Endpoint(
            path="/v1/chat/completions",
            valid={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
          ),
        ],
        args.bad_inputs // 4,
        api.config.max_body_bytes,
      )
    finally:
      await api.stop()
      driver.close()
    return {"retrieval": ret, "openai": oai}

  return asyncio.run(main())


def checkpoint_part(tmp: Path) -> dict[str, Any]:
  state = {"w": jnp.zeros(4)}
  out = {"injected": 2, "survived": 0}
  with Checkpointer(CheckpointConfig(directory=str(tmp / "ckpt"), async_save=False)) as ckpt:
    for step in (1, 2):
      ckpt.save(step, {"train_state": state, "meta": {"version": step}}, force=True)
    with no_space_on_save(ckpt):
      try:
        ckpt.save(3, {"train_state": state, "meta": {"version": 3}}, force=True)
      except CheckpointError as e:  # one clear error, the run resumes from step 2
        out["survived"] += int("no space left" in str(e) and "\n" not in str(e))
    (tmp / "ckpt" / "2" / "meta" / "metadata").write_bytes(b'{"vers')
    step, _ = ckpt.restore_latest({"meta": None})
    out["survived"] += int(step == 1 and len(ckpt.fallbacks) == 1)
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--soak-steps", type=int, default=300, help="soak steps (the full soak: 300)")
  p.add_argument("--soak-minutes", type=float, default=6.0, help="wall-clock bound of the soak")
  p.add_argument("--soak-restarts", type=int, default=2, help="restarts of the soak's run")
  p.add_argument("--fault-rate", type=float, default=0.1, help="tool requests broken by the proxy")
  p.add_argument("--kills", type=int, default=2, help="SIGKILLs of `asearcher train`")
  p.add_argument("--bad-inputs", type=int, default=200, help="malformed requests per endpoint")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args()
  t0 = time.monotonic()
  with tempfile.TemporaryDirectory() as d:
    tmp = Path(d)
    tok = write_byte_tokenizer(tmp / "tok")
    index = tmp / "index"
    build_index_dir(corpus=default_corpus_paths(), index_dir=index, show_progress=False)
    ck = checkpoint_part(tmp)
    ab = abuse_part(args, index)
    kill = sigkill_part(args, tmp, tok, index) if args.kills > 0 else None
    soak = soak_part(args, tmp, tok, index)
  rows = [
    ("soak", f"{soak['steps']} steps, {soak['lives']} lives, eta {soak['eta']}",
     soak["injected"], soak["survived"], 0, soak["hangs"],
     soak["lost_groups"], soak["duplicated_groups"]),
    ("checkpoint", "ENOSPC on save, corrupt newest", ck["injected"], ck["survived"], 0, 0, 0, 0),
  ]  # fmt: skip
  if kill is not None:
    rows.append((
      "sigkill", f"{kill['steps']} steps, {kill['replayed_calls']} calls replayed",
      kill["kills"], kill["survived"], 0, 0, kill["lost_groups"], kill["duplicated_groups"],
    ))  # fmt: skip
  for name, r in ab.items():  # bad input is not an injected fault: counted apart
    rows.append((
      f"abuse/{name}", f"flood {r['flood']} @128: {r['flood_503']} got 503", 0, 0,
      r["bad_inputs"], r["hangs"], 0, 0,
    ))  # fmt: skip
  print(ROW.format("part", "load held", "injected", "survived", "bad in", "hangs", "lost", "dup"))
  for r in rows:
    print(ROW.format(*r))
  print(f"soak: {json.dumps(soak)}")
  print(f"sigkill: {json.dumps(kill)}")
  print(f"abuse: {json.dumps(ab)}")
  summary = {
    "steps": soak["steps"], "soak_lives": soak["lives"], "kills": kill["kills"] if kill else 0,
    "faults_injected": sum(r[2] for r in rows), "faults_survived": sum(r[3] for r in rows),
    "bad_inputs": sum(r[4] for r in rows), "bad_inputs_5xx": sum(r["server_errors"] for r in ab.values()),
    "hangs": sum(r[5] for r in rows),
    "lost_groups": sum(r[6] for r in rows), "duplicated_groups": sum(r[7] for r in rows),
    "max_staleness": max(soak["max_staleness"], kill["max_staleness"] if kill else 0),
    "eta": soak["eta"], "rss_slope_mb_per_100_steps": round(soak["rss_slope_mb_per_100_steps"], 2),
    "replayed_calls": kill["replayed_calls"] if kill else 0,
    "seconds": round(time.monotonic() - t0, 1),
  }  # fmt: skip
  print(json.dumps(summary))


if __name__ == "__main__":
  main()
