"""`asearcher fetch`: what a recipe reads, by its Hugging Face ids, into a directory or a bucket.

A recipe names files on the run's bucket (model, questions, corpus, index); nothing else says
where they come from. A bundle lists them once, per recipe, by Hugging Face id, with the place
each one takes under the destination (the bucket layout of docs/reproduce.md). Downloads go
through `huggingface_hub` (which honours $HF_ENDPOINT and $HF_TOKEN), each file is checked
against the hash the Hub gives for it (the sha256 of an LFS file, the git blob sha1 of a small
one) and recorded with its sha256 in `fetch_manifest.json` at the destination, written after
every file: a re-run, or one after an interruption, skips every file the manifest holds at its
recorded size with the hash the Hub still gives it (a new commit that left a file alone does not
fetch it again; `rehash` re-reads them and compares their sha256), and a half-downloaded file
resumes where it stopped. A gs:// destination is written through `etils.epath`; each file is
staged on local disk first (`staging_dir`) and uploaded whole.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asearcher_jax import storage
from asearcher_jax.errors import AsearcherError, ConfigValueError

log = logging.getLogger(__name__)

MANIFEST = "fetch_manifest.json"


class FetchError(AsearcherError):
  """A downloaded file is not what the Hub says it is (exit status 1: the data, not the config)."""


CHUNK = 8 << 20  # bytes read at a time when hashing or uploading


@dataclasses.dataclass(frozen=True, kw_only=True)
class Artifact:
  """One Hugging Face repository, or the files of it that match `include`, and where they go."""

  # The Hugging Face id ("Qwen/Qwen2.5-7B", "inclusionAI/ASearcher-train-data").
  repo_id: str
  # "model" or "dataset".
  repo_type: str = "model"
  # Glob patterns over the repository's paths; (): every file.
  include: tuple[str, ...] = ()
  # The folder under the destination the files go to.
  dest: str
  # True: each file by its base name directly in `dest` (a data repository whose folders are
  # its own affair: the recipe names `data/ASearcher-Base-35k.jsonl`); False: the repository's
  # folders kept (a model directory).
  flatten: bool = False
  # Branch, tag or commit; the manifest records the commit it resolved to.
  revision: str = "main"


_TRAIN = "inclusionAI/ASearcher-train-data"
_TEST = "inclusionAI/ASearcher-test-data"
_KNOWLEDGE = "inclusionAI/ASearcher-Local-Knowledge"
# What every ASearcher-Local recipe reads beside its model: the training questions, the test
# sets, wiki-18 (passages and whole pages for `access`), its prebuilt e5 Flat index and the e5
# encoder that embeds the queries.
_LOCAL_DATA = (
  Artifact(
    repo_id=_TRAIN, repo_type="dataset", include=("*ASearcher-Base-35k.jsonl",), dest="data",
    flatten=True,
  ),
  Artifact(repo_id=_TEST, repo_type="dataset", dest="data/test"),
  Artifact(
    repo_id=_KNOWLEDGE, repo_type="dataset", include=("*wiki_corpus.jsonl", "*wiki_webpages.jsonl"),
    dest="corpus/wiki18", flatten=True,
  ),
  Artifact(
    repo_id=_KNOWLEDGE, repo_type="dataset", include=("*e5_Flat.index",), dest="indexes/e5_flat",
    flatten=True,
  ),
  Artifact(repo_id="intfloat/e5-base-v2", dest="models/e5-base-v2"),
)  # fmt: skip

# Bundle name -> what its recipe reads. The layout under the destination is the recipes' (their
# MODEL_DIR, QUESTIONS, CORPUS, PAGES, PREBUILT and ENCODER constants under /mnt/asearcher).
BUNDLES: dict[str, tuple[Artifact, ...]] = {
  "asearcher_local_7b": (Artifact(repo_id="Qwen/Qwen2.5-7B", dest="models/Qwen2.5-7B"), *_LOCAL_DATA),
  "asearcher_local_14b": (Artifact(repo_id="Qwen/Qwen2.5-14B", dest="models/Qwen2.5-14B"), *_LOCAL_DATA),
  "search_r1_7b": (Artifact(repo_id="Qwen/Qwen2.5-7B", dest="models/Qwen2.5-7B"), *_LOCAL_DATA),
  "asearcher_web_qwq_32b": (
    Artifact(repo_id="Qwen/QwQ-32B", dest="models/QwQ-32B"),
    Artifact(
      repo_id=_TRAIN, repo_type="dataset", include=("*ASearcher-LRM-35k.jsonl",), dest="data",
      flatten=True,
    ),
    Artifact(repo_id=_TEST, repo_type="dataset", dest="data/test"),
  ),
}  # fmt: skip


def parse_artifact(spec: str) -> Artifact:
  """`[dataset:]owner/name[@revision]=dest[:glob,glob]` (the `extra` parameter) -> an Artifact."""
  repo, eq, rest = spec.partition("=")
  if not eq or not rest or "/" not in repo:
    raise ConfigValueError(
      f"fetch.fetch.extra: {spec!r} is not '[dataset:]owner/name[@rev]=dest[:glob,glob]'"
    )
  repo_type = "model"
  if repo.startswith(("dataset:", "model:")):
    repo_type, _, repo = repo.partition(":")
  repo, _, revision = repo.partition("@")
  dest, _, globs = rest.partition(":")
  include = tuple(g for g in globs.split(",") if g)
  return Artifact(
    repo_id=repo, repo_type=repo_type, include=include, dest=dest, flatten=bool(include),
    revision=revision or "main",
  )  # fmt: skip


def sha256_of(path: Any) -> str:
  """Streams a local or gs:// file through sha256."""
  h = hashlib.sha256()
  with _open(path, "rb") as f:
    while block := f.read(CHUNK):
      h.update(block)
  return h.hexdigest()


def git_blob_sha1(path: str | os.PathLike) -> str:
  """The id git (and the Hub, for a file not in LFS) gives these bytes."""
  h = hashlib.sha1(f"blob {os.path.getsize(path)}\0".encode())
  with open(path, "rb") as f:
    while block := f.read(CHUNK):
      h.update(block)
  return h.hexdigest()


def _path(p: str) -> Any:
  from etils import epath

  return epath.Path(p) if storage.is_url(p) else Path(p)


def _open(path: Any, mode: str):
  return path.open(mode) if storage.is_url(path) else open(path, mode)


def _wanted(files: Sequence[str], art: Artifact) -> list[str]:
  if not art.include:
    return [f for f in files if not f.startswith(".")]
  return [f for f in files if any(fnmatch.fnmatch(f, g) for g in art.include)]


def _target(art: Artifact, rfilename: str) -> str:
  return f"{art.dest.strip('/')}/{os.path.basename(rfilename) if art.flatten else rfilename}"


class _Manifest:
  """`fetch_manifest.json` at the destination: what is there, from where, with its sha256."""

  def __init__(self, root: Any) -> None:
    self.path = root / MANIFEST
    self.files: dict[str, dict[str, Any]] = {}
    if self.path.exists():
      self.files = json.loads(self.path.read_text()).get("files", {})

  def save(self) -> None:
    text = json.dumps({"files": self.files}, indent=1, sort_keys=True)
    if storage.is_url(self.path):
      self.path.write_text(text)  # one object write: whole or absent
      return
    tmp = Path(f"{self.path}.tmp")
    tmp.write_text(text)
    os.replace(tmp, self.path)


def _verify_against_hub(local: str, sibling: Any, where: str) -> str:
  """sha256 of the downloaded file, after checking it against the Hub's own hash of it."""
  digest = sha256_of(local)
  lfs = getattr(sibling, "lfs", None)
  if lfs is not None and getattr(lfs, "sha256", None):
    if digest != lfs.sha256:
      raise FetchError(f"fetch: {where}: sha256 {digest} but the Hub says {lfs.sha256}")
  elif getattr(sibling, "blob_id", None):
    blob = git_blob_sha1(local)
    if blob != sibling.blob_id:
      raise FetchError(f"fetch: {where}: git blob {blob} but the Hub says {sibling.blob_id}")
  return digest


def _put(local: str, dst: Any) -> None:
  """Moves a verified staged file into place (a local rename, or an upload to gs://)."""
  if storage.is_url(dst):
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(local, "rb") as src, dst.open("wb") as out:
      shutil.copyfileobj(src, out, CHUNK)
    os.remove(local)
    return
  dst.parent.mkdir(parents=True, exist_ok=True)
  shutil.move(local, dst)


def _hub_hash(sibling: Any) -> str | None:
  """What the Hub says a file's bytes are: its LFS sha256, else its git blob id."""
  lfs = getattr(sibling, "lfs", None)
  return getattr(lfs, "sha256", None) or getattr(sibling, "blob_id", None)


def _complete(entry: dict | None, dst: Any, sibling: Any, rehash: bool) -> bool:
  """Whether the file at `dst` is the one the Hub has now: recorded by the manifest with the
  Hub's hash of it (a new commit that left the file alone changes nothing) at its size."""
  if not entry or entry.get("hub_hash") != _hub_hash(sibling) or not dst.exists():
    return False
  size = dst.stat().length if storage.is_url(dst) else dst.stat().st_size
  if size != entry["size"]:
    return False
  return not rehash or sha256_of(dst) == entry["sha256"]


def fetch_artifacts(
  artifacts: Sequence[Artifact],
  to: str,
  *,
  staging_dir: str | None = None,
  rehash: bool = False,
  endpoint: str | None = None,
  token: str | None = None,
) -> dict[str, int]:
  """Downloads `artifacts` under `to`; returns counts of the files fetched and skipped."""
  from huggingface_hub import HfApi, hf_hub_download

  root = _path(to)
  if not storage.is_url(to):
    root.mkdir(parents=True, exist_ok=True)
  staging = Path(staging_dir) if staging_dir else None
  if staging is None:
    staging = (
      Path(os.environ.get("ASEARCHER_HOME") or Path.home() / ".cache" / "asearcher_jax")
      / "fetch-staging"
      if storage.is_url(to)
      else Path(to) / ".fetch-staging"
    )
  endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
  api = HfApi(endpoint=endpoint, token=token)
  manifest = _Manifest(root)
  counts = {"fetched": 0, "skipped": 0, "bytes": 0}
  for art in artifacts:
    try:
      info = api.repo_info(
        art.repo_id, repo_type=art.repo_type, revision=art.revision, files_metadata=True
      )
    except Exception as e:  # the Hub's errors name the repository; keep them to one line
      raise ConfigValueError(f"fetch: {art.repo_type} {art.repo_id}@{art.revision}: {e}") from None
    siblings = {s.rfilename: s for s in info.siblings or ()}
    wanted = _wanted(sorted(siblings), art)
    if not wanted:
      raise ConfigValueError(
        f"fetch: {art.repo_type} {art.repo_id}@{info.sha} has no file matching {art.include}"
      )
    targets = [_target(art, f) for f in wanted]
    if len(set(targets)) != len(targets):
      raise ConfigValueError(f"fetch: {art.repo_id}: two files flatten to one name in {art.dest}")
    for rfilename, target in zip(wanted, targets, strict=True):
      dst = root / target
      if _complete(manifest.files.get(target), dst, siblings[rfilename], rehash):
        counts["skipped"] += 1
        continue
      t0 = time.monotonic()
      local = hf_hub_download(
        art.repo_id, rfilename, repo_type=art.repo_type, revision=info.sha,
        local_dir=staging / art.repo_type / art.repo_id, endpoint=endpoint, token=token,
      )  # fmt: skip
      where = f"{art.repo_id}/{rfilename}@{info.sha[:12]}"
      digest = _verify_against_hub(local, siblings[rfilename], where)
      size = os.path.getsize(local)
      _put(local, dst)
      manifest.files[target] = {
        "repo_id": art.repo_id, "repo_type": art.repo_type, "file": rfilename,
        "commit": info.sha, "size": size, "sha256": digest,
        "hub_hash": _hub_hash(siblings[rfilename]),
      }  # fmt: skip
      manifest.save()
      counts["fetched"] += 1
      counts["bytes"] += size
      log.info("fetched %s -> %s (%d bytes, %.1f s)", where, dst, size, time.monotonic() - t0)
  shutil.rmtree(staging, ignore_errors=True)  # all is in place: nothing left to resume
  return counts


def fetch(
  *,
  bundle: str | None = None,
  to: str | None = None,
  extra: Sequence[str] = (),
  staging_dir: str | None = None,
  rehash: bool = False,
  endpoint: str | None = None,
) -> int:
  """`asearcher fetch BUNDLE --to DEST`: what a recipe reads, by Hugging Face id. Returns 0.

  Into a directory or a gs:// prefix, each file checked against the Hub's hash and recorded in
  DEST/fetch_manifest.json; a re-run skips what is complete.

  Args:
    bundle: a name of `BUNDLES` (asearcher_local_7b, asearcher_local_14b, search_r1_7b,
      asearcher_web_qwq_32b); None: only `extra`.
    to: the destination: a local directory or a gs:// prefix (the run's bucket, mounted at
      /mnt/asearcher on the pod).
    extra: more repositories, each '[dataset:]owner/name[@rev]=dest[:glob,glob]'.
    staging_dir: where files wait between download and upload (gs:// destinations; default
      $ASEARCHER_HOME/fetch-staging) or rename (default `to`/.fetch-staging).
    rehash: re-read every completed file and compare its sha256 with the manifest's, rather
      than trusting its recorded size.
    endpoint: the Hub's address; None: $HF_ENDPOINT, else huggingface.co.
  """
  if to is None:
    raise ConfigValueError("fetch.fetch.to: required (a directory or gs:// prefix; --to PATH)")
  if bundle is not None and bundle not in BUNDLES:
    raise ConfigValueError(f"fetch.fetch.bundle: {bundle!r} is none of {sorted(BUNDLES)}")
  artifacts = list(BUNDLES[bundle]) if bundle else []
  artifacts += [parse_artifact(s) for s in ([extra] if isinstance(extra, str) else extra)]
  if not artifacts:
    raise ConfigValueError("fetch: nothing to fetch (name a bundle or give fetch.fetch.extra)")
  counts = fetch_artifacts(artifacts, to, staging_dir=staging_dir, rehash=rehash, endpoint=endpoint)
  print(json.dumps({"to": to, "bundle": bundle, **counts}))
  return 0
