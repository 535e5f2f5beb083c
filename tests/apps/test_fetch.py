"""`asearcher fetch` against a local stand-in of the Hugging Face Hub (tests/hub_standin.py, the
real `huggingface_hub` client through HF_ENDPOINT, never the network): the 7B ASearcher-Local
bundle (a tiny model served under Qwen/Qwen2.5-7B's id, ASearcher-Base-35k.jsonl, a test set,
a wiki-18-format corpus and pages, a faiss e5_Flat.index) lands in the recipe's layout with
verified sha256s, a re-run fetches nothing, a damaged file is fetched again; then the recipe
trains from the fetched files, from a directory and from a gs:// bucket (the GCS emulator)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from asearcher_jax.apps import fetch
from tests.hub_standin import HubStandIn
from tests.tools.test_retrieval_server import SeededEncoder

REPO = Path(__file__).resolve().parents[2]
RECIPE = "gin/experiments/asearcher_local_qwen2_5_7b.gin"
OVERLAY = "gin/overlays/recipe_tiny.gin"
# The index's query encoder: a seeded stand-in for e5 (the fetched e5-base-v2 directory is a
# stub here; the e5 encoder itself is tested against transformers in tests/tools/test_dense_e5.py).
ENCODER = "tests.tools.test_retrieval_server:make_seeded_encoder"


def _model_dir(tmp: Path) -> Path:
  """A tiny Qwen2 checkpoint as a Hugging Face directory: config.json, safetensors, tokenizer."""
  from flax import nnx

  from asearcher_jax.model import hf_io, presets, transformer

  out = tmp / "qwen-tiny"
  cfg = presets.model_config(name="qwen2-tiny")
  hf_io.save(transformer.Transformer(cfg, rngs=nnx.Rngs(0)), out)
  tokenizers = REPO / "asearcher_jax" / "assets" / "tokenizers"
  for f in tokenizers.rglob("*"):
    if f.is_file() and f.name != "LICENSE":
      shutil.copy(f, out / f.name)
  return out


def _jsonl(rows: list[dict]) -> bytes:
  return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
  """The Hub stand-in holding every repository the asearcher_local_7b bundle names."""
  import faiss

  tmp = tmp_path_factory.mktemp("hub")
  hub = HubStandIn()
  hub.add_dir("model", "Qwen/Qwen2.5-7B", _model_dir(tmp))
  questions = [
    {"question": f"Which page holds word{i}?", "answer": [f"Page {i}"], "aug_answer": [],
     "source": "test", "qid": f"q{i}"}
    for i in range(8)
  ]  # fmt: skip
  hub.add("dataset", "inclusionAI/ASearcher-train-data", {
    "README.md": b"stand-in\n",
    "ASearcherBase35k/ASearcher-Base-35k.jsonl": _jsonl(questions),
    "ASearcherLRM35k/ASearcher-LRM-35k.jsonl": _jsonl(questions[:2]),
  })  # fmt: skip
  hub.add("dataset", "inclusionAI/ASearcher-test-data", {"Bamboogle/test.jsonl": _jsonl(questions)})
  passages = [f'"Page {i}"\nword{i} topic{i % 7} filler text number {i}' for i in range(64)]
  url = "https://en.wikipedia.org/w/index.php?title=Page%20{}"
  corpus = [{"id": str(i), "contents": c, "url": url.format(i)} for i, c in enumerate(passages)]
  vectors = SeededEncoder().encode(passages, kind="passage")
  vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
  flat = faiss.IndexFlatIP(vectors.shape[1])
  flat.add(vectors)
  faiss.write_index(flat, str(tmp / "e5_Flat.index"))
  hub.add("dataset", "inclusionAI/ASearcher-Local-Knowledge", {
    "wiki_corpus.jsonl": _jsonl(corpus),
    "wiki_webpages.jsonl": _jsonl([{"url": r["url"], "contents": r["contents"]} for r in corpus]),
    "e5.index/e5_Flat.index": (tmp / "e5_Flat.index").read_bytes(),
  })  # fmt: skip
  hub.add("model", "intfloat/e5-base-v2", {"config.json": b'{"model_type": "bert"}'})
  with hub:
    yield hub


def _cli(
  *args: str, hub: HubStandIn, timeout: float = 300, logs: Path | None = None
) -> subprocess.CompletedProcess:
  """`asearcher ARGS` against the stand-in; `logs`: stdout and stderr go to files there as the
  command runs (a long one can be watched), and are read back."""
  # The suite runs offline (tests/conftest.py); the stand-in is on loopback.
  env = {
    **os.environ,
    "HF_ENDPOINT": hub.url,
    "HF_HUB_OFFLINE": "0",
    "HF_HUB_DISABLE_TELEMETRY": "1",
  }
  argv = [sys.executable, "-m", "asearcher_jax.main", *args]
  if logs is None:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
  logs.mkdir(parents=True, exist_ok=True)
  with open(logs / "stdout", "w") as out, open(logs / "stderr", "w") as err:
    code = subprocess.run(argv, stdout=out, stderr=err, timeout=timeout, cwd=REPO, env=env)
  stdout, stderr = (logs / "stdout").read_text(), (logs / "stderr").read_text()
  return subprocess.CompletedProcess(argv, code.returncode, stdout, stderr)


LAYOUT = (
  "models/Qwen2.5-7B/config.json",
  "models/Qwen2.5-7B/model.safetensors",
  "models/Qwen2.5-7B/vocab.json",
  "data/ASearcher-Base-35k.jsonl",
  "data/test/Bamboogle/test.jsonl",
  "corpus/wiki18/wiki_corpus.jsonl",
  "corpus/wiki18/wiki_webpages.jsonl",
  "indexes/e5_flat/e5_Flat.index",
  "models/e5-base-v2/config.json",
)


def test_fetch_lays_out_the_bundle_verified_and_a_rerun_fetches_only_what_is_missing(hub, tmp_path):
  dest = tmp_path / "bucket"
  first = _cli("fetch", "asearcher_local_7b", "--to", str(dest), hub=hub)
  assert first.returncode == 0, first.stderr[-3000:]
  summary = json.loads(first.stdout.strip().splitlines()[-1])
  manifest = json.loads((dest / fetch.MANIFEST).read_text())["files"]
  assert summary["fetched"] == len(manifest) and summary["skipped"] == 0
  for path in LAYOUT:
    assert path in manifest, path
  for path, entry in manifest.items():  # every recorded sha256 is the file's
    assert fetch.sha256_of(dest / path) == entry["sha256"], path
    assert entry["size"] == (dest / path).stat().st_size
  assert "data/ASearcher-LRM-35k.jsonl" not in manifest  # the 7B bundle takes the base set
  assert not (dest / ".fetch-staging").exists()

  before = len(hub.downloads)
  again = _cli("fetch", "asearcher_local_7b", "--to", str(dest), hub=hub)
  assert again.returncode == 0, again.stderr[-3000:]
  assert json.loads(again.stdout.strip().splitlines()[-1])["skipped"] == len(manifest)
  assert len(hub.downloads) == before  # complete files are not downloaded again

  damaged = dest / "data" / "ASearcher-Base-35k.jsonl"
  damaged.write_bytes(damaged.read_bytes()[:10])
  (dest / "corpus" / "wiki18" / "wiki_webpages.jsonl").unlink()
  third = _cli("fetch", "asearcher_local_7b", "--to", str(dest), hub=hub)
  assert third.returncode == 0, third.stderr[-3000:]
  assert sorted(hub.downloads[before:]) == [
    "inclusionAI/ASearcher-Local-Knowledge/wiki_webpages.jsonl",
    "inclusionAI/ASearcher-train-data/ASearcherBase35k/ASearcher-Base-35k.jsonl",
  ]
  assert fetch.sha256_of(damaged) == manifest["data/ASearcher-Base-35k.jsonl"]["sha256"]

  # A new commit that adds a file and leaves the others alone fetches only the new one.
  before = len(hub.downloads)
  hub.add(
    "model", "intfloat/e5-base-v2", {"config.json": b'{"model_type": "bert"}', "README.md": b"e5"}
  )
  fourth = _cli("fetch", "asearcher_local_7b", "--to", str(dest), hub=hub)
  assert fourth.returncode == 0, fourth.stderr[-3000:]
  assert hub.downloads[before:] == ["intfloat/e5-base-v2/README.md"]

  # The recipe configures on the fetched directory (the bucket test below also trains on it):
  # the preflight names the one input a fetch does not bring, the index (`asearcher index`
  # builds it from the fetched corpus), and passes once it is there.
  index = dest / "indexes" / "wiki18_e5"
  args = _train_args(str(dest), index, tmp_path / "run")
  refused = _cli(*args, "--check", hub=hub)
  assert refused.returncode == 2 and "wiki18_e5' does not exist" in refused.stderr
  assert "build it with `asearcher index`" in refused.stderr
  index.mkdir(parents=True)  # where `asearcher index` writes (its build: the bucket test below)
  checked = _cli(*args, "--check", hub=hub)
  assert checked.returncode == 0 and "configuration ok" in checked.stdout, checked.stderr[-3000:]


def test_fetch_names_a_bad_bundle_or_repository_in_one_line(hub, tmp_path):
  bad = _cli("fetch", "asearcher_local_8b", "--to", str(tmp_path), hub=hub)
  assert bad.returncode == 2
  assert (
    bad.stderr.strip()
    .splitlines()[-1]
    .startswith(
      "asearcher fetch: config error: fetch.fetch.bundle: 'asearcher_local_8b' is none of"
    )
  )
  missing = _cli(
    "fetch", "--to", str(tmp_path), "--gin_param=fetch.fetch.extra=['nobody/nothing=models/x']",
    hub=hub,
  )  # fmt: skip
  assert missing.returncode == 2
  assert "fetch: model nobody/nothing@main" in missing.stderr.strip().splitlines()[-1]
  with pytest.raises(Exception, match="owner/name"):
    fetch.parse_artifact("no-slash=x")
  art = fetch.parse_artifact("dataset:org/data@v1=data:*.jsonl,*.json")
  assert (art.repo_type, art.repo_id, art.revision, art.include, art.flatten) == (
    "dataset", "org/data", "v1", ("*.jsonl", "*.json"), True
  )  # fmt: skip


def _train_args(root: str, index_dir: Path, run_dir: Path) -> list[str]:
  """The recipe under the tiny overlay, reading the fetched model, questions and index."""
  return [
    "train", RECIPE, f"--gin_file={OVERLAY}",
    f'--gin_param=commands.train.model_dir="{root}/models/Qwen2.5-7B"',
    f'--gin_param=loading.PolicyConfig.model_dir="{root}/models/Qwen2.5-7B"',
    f'--gin_param=commands.train.questions="{root}/data/ASearcher-Base-35k.jsonl"',
    f'--gin_param=commands.train.retrieval_index_dir="{index_dir}"',
    f'--gin_param=commands.train.run_dir="{run_dir}"',
    "--gin_param=train_config.TrainConfig.train_steps=2",
    # A random tiny checkpoint never answers: every group would score 0 and be dropped as
    # without variance, so the smoke reward (as tests/launch/test_pod_e2e.py's loaded policy).
    '--gin_param=train_config.TrainConfig.reward="smoke"',
  ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(1200)  # ~90 s on 2 shared cores (2026-12-04); a loaded host takes longer
def test_the_local_7b_recipe_trains_two_steps_on_what_fetch_put_in_a_bucket(
  hub, tmp_path, gcs_bucket, monkeypatch
):
  """Into the GCS emulator's bucket; the dense index is built from the bucket's corpus and
  prebuilt faiss file, and the run reads model and questions from gs:// (the local cache)."""
  root = f"{gcs_bucket}/asearcher"
  monkeypatch.setenv("ASEARCHER_HOME", str(tmp_path / "home"))  # the gs:// cache, per test

  got = _cli("fetch", "asearcher_local_7b", "--to", root, hub=hub)
  assert got.returncode == 0, got.stderr[-3000:]
  assert json.loads(got.stdout.strip().splitlines()[-1])["fetched"] >= len(LAYOUT)
  again = _cli("fetch", "asearcher_local_7b", "--to", root, "--gin_param=fetch.fetch.rehash=True",
               hub=hub)  # fmt: skip
  assert again.returncode == 0 and json.loads(again.stdout.splitlines()[-1])["fetched"] == 0

  index_dir = tmp_path / "indexes" / "wiki18_e5"
  built = _cli(
    "index",
    f'--gin_param=index.build_index.corpus="{root}/corpus/wiki18/wiki_corpus.jsonl"',
    f'--gin_param=index.build_index.pages_file="{root}/corpus/wiki18/wiki_webpages.jsonl"',
    f'--gin_param=index.build_index.index_dir="{index_dir}"',
    '--gin_param=index.build_index.backend="dense"',
    f'--gin_param=index.build_index.encoder="{ENCODER}"',
    f'--gin_param=index.DenseIndexConfig.prebuilt="{root}/indexes/e5_flat/e5_Flat.index"',
    hub=hub,
  )
  assert built.returncode == 0, built.stderr[-3000:]
  assert "64 passages" in built.stdout

  run_dir = tmp_path / "run"
  checked = _cli(*_train_args(root, index_dir, run_dir), "--check", hub=hub)
  assert checked.returncode == 0, checked.stderr[-3000:]
  assert "configuration ok" in checked.stdout
  trained = _cli(*_train_args(root, index_dir, run_dir), hub=hub, timeout=1500,
                 logs=tmp_path / "train_logs")  # fmt: skip
  assert trained.returncode == 0, trained.stderr[-5000:]
  summary = json.loads(trained.stdout.strip().splitlines()[-1])
  assert summary["version"] == 2, summary
  assert len((run_dir / "metrics" / "metrics.jsonl").read_text().strip().splitlines()) == 2
  log = trained.stderr
  assert "model_dir: copying gs://" in log and "questions: copying gs://" in log
  assert "models/Qwen2.5-7B (qwen2" in log  # the policy is the fetched checkpoint


def test_a_file_unlike_the_hubs_hash_of_it_is_refused(tmp_path):
  """Checked against the LFS sha256 the Hub publishes, else the git blob id (as `git
  hash-object` computes it)."""
  import hashlib

  from huggingface_hub.hf_api import BlobLfsInfo, RepoSibling

  f = tmp_path / "f.jsonl"
  f.write_bytes(b'{"question": "q"}\n')
  blob = subprocess.run(["git", "hash-object", str(f)], capture_output=True, text=True, check=True)
  assert fetch.git_blob_sha1(f) == blob.stdout.strip()
  sha = hashlib.sha256(f.read_bytes()).hexdigest()
  small = RepoSibling(rfilename="f.jsonl", size=18, blob_id=blob.stdout.strip())
  assert fetch._verify_against_hub(str(f), small, "x") == sha
  lfs = RepoSibling(rfilename="f.jsonl", lfs=BlobLfsInfo(size=18, sha256=sha, pointer_size=134))
  assert fetch._verify_against_hub(str(f), lfs, "x") == sha
  with pytest.raises(fetch.FetchError, match=r"^fetch: org/x/f.jsonl: git blob \w+ but the Hub"):
    fetch._verify_against_hub(str(f), RepoSibling(rfilename="f", blob_id="0" * 40), "org/x/f.jsonl")
  wrong = BlobLfsInfo(size=18, sha256="0" * 64, pointer_size=134)
  with pytest.raises(fetch.FetchError, match=r"sha256 \w+ but the Hub says 0{64}"):
    fetch._verify_against_hub(str(f), RepoSibling(rfilename="f", lfs=wrong), "x")
