"""`asearcher index` and `asearcher serve-retrieval` as a user runs them (subprocesses)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import gin

from asearcher_jax.tools.retrieval.index import read_manifest

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-m", "asearcher_jax.main", *args],
    capture_output=True,
    text=True,
    timeout=timeout,
    cwd=REPO,
    env={**os.environ, **(env or {})},
  )


def test_gin_files_parse() -> None:
  for name in ("index.gin", "serve_retrieval.gin"):
    gin.clear_config()
    gin.parse_config_file(str(REPO / "gin" / "runs" / name))
  gin.clear_config()


def test_index_command_builds_then_reuses(tmp_path: Path) -> None:
  env = {"ASEARCHER_HOME": str(tmp_path / "home")}
  first = _cli("index", "--gin_param=index.build_index.show_progress=False", env=env)
  assert first.returncode == 0, first.stderr
  assert "8113 passages" in first.stdout and "built in" in first.stdout
  assert "DEBUG" not in first.stderr  # bm25s's own logger follows the default level
  index_dir = tmp_path / "home" / "index" / "default-bm25"
  assert read_manifest(index_dir)["num_passages"] == 8113
  second = _cli("index", env=env)
  assert second.returncode == 0 and "up to date" in second.stdout
  # A missing corpus file is a one-line user error, not a traceback.
  bad = _cli("index", "--gin_param=index.build_index.corpus=['/nonexistent.jsonl']", env=env)
  assert bad.returncode == 1 and "corpus file not found: /nonexistent.jsonl" in bad.stderr
  assert "Traceback" not in bad.stderr


def _announced_address(proc: subprocess.Popen, addr_dir: Path, timeout_s: float = 60) -> str:
  """The `ip:port` a serve-retrieval process writes to its discovery file (its output if it died)."""
  deadline = time.monotonic() + timeout_s
  files: list[Path] = []
  while time.monotonic() < deadline and not files and proc.poll() is None:
    files = list(addr_dir.glob("Host*_IP*.txt"))
    time.sleep(0.1)
  assert files, (
    proc.stdout.read() if proc.poll() is not None else f"no address file in {timeout_s} s"
  )
  return files[0].read_text()


def _top_title(address: str, query: str) -> str:
  """The title of the top passage a retrieval server at `address` answers `query` with."""
  req = urllib.request.Request(
    f"http://{address}/retrieve",
    data=json.dumps({"queries": [query], "topk": 1}).encode(),
    headers={"Content-Type": "application/json"},
  )
  with urllib.request.urlopen(req, timeout=10) as resp:
    return json.loads(resp.read())["result"][0][0]["title"]


def test_serve_retrieval_command_announces_serves_and_cleans_up(tmp_path: Path) -> None:
  addr_dir = tmp_path / "addrs"
  proc = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "asearcher_jax.main",
      "serve-retrieval",
      "--gin_param=server.RetrievalServerConfig.port=0",
      f"--gin_param=server.RetrievalServerConfig.addr_dir='{addr_dir}'",
    ],
    cwd=REPO,
    env={**os.environ, "ASEARCHER_HOME": str(tmp_path / "home")},
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  try:
    address = _announced_address(proc, addr_dir)
    assert address.startswith("127.0.0.1:")
    assert _top_title(address, "Teutberga") == "Teutberga"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    assert not list(addr_dir.glob("Host*_IP*.txt"))  # deregistered on shutdown
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait(timeout=10)


def test_index_of_ones_own_corpus_alone_or_with_the_shipped_one_as_distractors(tmp_path: Path):
  """`corpus` given as one string is one path (not a list of one-letter paths); with
  add_shipped_corpus the shipped ~8k passages are indexed after it."""
  from asearcher_jax.apps.index import build_index

  mine = tmp_path / "mine.jsonl"
  rows = [{"id": f"m{i}", "title": f"Zorblat {i}", "text": f"The zorblat number {i} glows."}
          for i in range(3)]  # fmt: skip
  mine.write_text("".join(json.dumps(r) + "\n" for r in rows))
  alone = _cli("index", f"--gin_param=index.build_index.corpus='{mine}'",
               f"--gin_param=index.build_index.index_dir='{tmp_path / 'alone'}'")  # fmt: skip
  assert alone.returncode == 0, alone.stderr
  assert read_manifest(tmp_path / "alone")["num_passages"] == 3
  assert build_index(corpus=str(mine), add_shipped_corpus=True, index_dir=str(tmp_path / "both"),
                     show_progress=False) == 0  # fmt: skip
  assert read_manifest(tmp_path / "both")["num_passages"] == 3 + 8113


def test_index_and_serve_a_prebuilt_faiss_file_from_the_command_line(tmp_path: Path) -> None:
  """A user's Search-R1 files: wiki-18 jsonl + an e5_Flat.index written by faiss itself.
  `asearcher index` records it (no copy), `asearcher serve-retrieval` answers /retrieve with
  exact inner-product top-k and /access with the pages, in the BM25 wire format."""
  import numpy as np
  import pytest

  faiss = pytest.importorskip("faiss")
  from tests.tools.test_retrieval_server import SeededEncoder, _dense_corpus

  contents = _dense_corpus(tmp_path / "wiki.jsonl", 200)
  base = SeededEncoder().encode(contents, kind="passage")
  base /= np.linalg.norm(base, axis=1, keepdims=True)
  flat = faiss.IndexFlatIP(base.shape[1])
  flat.add(base)
  faiss.write_index(flat, str(tmp_path / "e5_Flat.index"))
  index_dir = tmp_path / "ix"
  built = _cli(
    "index",
    f"--gin_param=index.build_index.corpus='{tmp_path / 'wiki.jsonl'}'",
    f"--gin_param=index.build_index.index_dir='{index_dir}'",
    "--gin_param=index.build_index.backend='dense'",
    "--gin_param=index.build_index.encoder='tests.tools.test_retrieval_server:make_seeded_encoder'",
    f"--gin_param=index.DenseIndexConfig.prebuilt='{tmp_path / 'e5_Flat.index'}'",
  )
  assert built.returncode == 0, built.stderr[-2000:]
  assert read_manifest(index_dir)["dense_index"]["ntotal"] == 200
  query = "who wrote page 12"
  q = SeededEncoder().encode([query], kind="query")[0]
  want = np.argsort(-(base @ (q / np.linalg.norm(q))), kind="stable")[:4].tolist()

  addr_dir = tmp_path / "addrs"
  proc = subprocess.Popen(
    [sys.executable, "-m", "asearcher_jax.main", "serve-retrieval",
     f"--gin_param=serve_retrieval.serve.index_dir='{index_dir}'",
     "--gin_param=server.RetrievalServerConfig.port=0",
     f"--gin_param=server.RetrievalServerConfig.addr_dir='{addr_dir}'"],
    cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
  )  # fmt: skip
  try:
    address = _announced_address(proc, addr_dir)

    def post(path: str, payload: dict) -> dict:
      req = urllib.request.Request(f"http://{address}{path}", data=json.dumps(payload).encode(),
                                   headers={"Content-Type": "application/json"})  # fmt: skip
      with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())

    rows = post("/retrieve", {"queries": [query], "topk": 4})["result"][0]
    assert [int(r["id"]) for r in rows] == want
    assert rows[0]["contents"] == contents[want[0]] and rows[0]["title"] == f"Page {want[0]}"
    pages = post("/access", {"urls": [rows[0]["url"]]})["result"]
    assert contents[want[0]].split("\n", 1)[1] in pages[0]["contents"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait(timeout=10)


# A stand-in for `asearcher`: jax.distributed.initialize ends the process with a message, so a
# server that tried to join a TPU cluster dies instead of waiting for peers.
_NO_CLUSTER = (
  "import sys, jax, jax.distributed\n"
  "def joined(*a, **k):\n"
  "  print('jax.distributed.initialize was called', flush=True); sys.exit(7)\n"
  "jax.distributed.initialize = joined\n"
  "from asearcher_jax import main\n"
  "sys.exit(main.main(sys.argv[1:]))\n"
)


def test_serve_retrieval_on_a_tpu_worker_never_joins_the_cluster(tmp_path: Path) -> None:
  """As launched on trainer worker 0: the TPU worker's and jax.distributed's environment set
  (pointing at a coordinator nobody serves), the server still comes up on the CPU platform and
  answers, and never calls jax.distributed.initialize."""
  addr_dir = tmp_path / "addrs"
  env = {
    **os.environ, "ASEARCHER_HOME": str(tmp_path / "home"), "JAX_PLATFORMS": "tpu,cpu",
    "JAX_COORDINATOR_ADDRESS": "127.0.0.1:9", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "0",
    "TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3,10.0.0.4,10.0.0.5",
  }  # fmt: skip
  proc = subprocess.Popen(
    [sys.executable, "-c", _NO_CLUSTER, "serve-retrieval",
     "--gin_param=server.RetrievalServerConfig.port=0",
     f"--gin_param=server.RetrievalServerConfig.addr_dir='{addr_dir}'"],
    cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
  )  # fmt: skip
  try:
    address = _announced_address(proc, addr_dir)
    assert _top_title(address, "Teutberga") == "Teutberga"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    assert "jax.distributed.initialize was called" not in proc.stdout.read()
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait(timeout=10)


def test_index_picks_the_on_disk_bm25_above_the_large_corpus_size(tmp_path: Path, monkeypatch):
  """backend="auto" (gin/runs/index.gin's default): bm25s in memory for a corpus up to
  LARGE_CORPUS_BYTES, tantivy on disk above it (wiki-18's 21M passages would need ~126 GB of
  bm25s)."""
  from asearcher_jax.apps import index as index_app

  corpus = tmp_path / "c.jsonl"
  corpus.write_text("".join(json.dumps({"id": str(i), "contents": f'"T{i}"\nword{i} text'}) + "\n"
                            for i in range(20)))  # fmt: skip
  size = corpus.stat().st_size
  assert index_app.auto_backend([corpus]) == "bm25"
  monkeypatch.setattr(index_app, "LARGE_CORPUS_BYTES", size - 1)
  assert index_app.auto_backend([corpus]) == "tantivy"
  assert index_app.build_index(corpus=str(corpus), index_dir=str(tmp_path / "ix"),
                               show_progress=False) == 0  # fmt: skip
  assert read_manifest(tmp_path / "ix")["backend"] == "tantivy"
  monkeypatch.setattr(index_app, "LARGE_CORPUS_BYTES", size)
  assert index_app.build_index(corpus=str(corpus), index_dir=str(tmp_path / "small"),
                               show_progress=False) == 0  # fmt: skip
  assert read_manifest(tmp_path / "small")["backend"] == "bm25"
