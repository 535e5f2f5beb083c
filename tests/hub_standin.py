"""A local server that speaks the part of the Hugging Face Hub's protocol `huggingface_hub` uses to
download (`HfApi.repo_info`, `hf_hub_download`, `snapshot_download`), so `asearcher fetch` is
tested with the real client and never the network (HF_ENDPOINT or `endpoint=` points at it).

  GET  /api/{models|datasets}/{owner}/{name}[/revision/{rev}]   id, sha (commit), siblings
  HEAD /[datasets/]{owner}/{name}/resolve/{rev}/{path}           X-Repo-Commit, ETag,
  GET  (same)                                                    X-Linked-Etag/-Size (LFS files)
                                                                 and Content-Length; Range

A file the Hub keeps in LFS (here: over `LFS_OVER` bytes or a weights/index suffix) has its
sha256 as its ETag and X-Linked-Etag; a small one its git blob sha1, as the Hub serves them.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

LFS_OVER = 10_000
LFS_SUFFIXES = (".safetensors", ".index", ".bin")


def _is_lfs(path: str, data: bytes) -> bool:
  return len(data) > LFS_OVER or path.endswith(LFS_SUFFIXES)


def _blob_sha1(data: bytes) -> str:
  return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


class HubStandIn:
  """Repositories held in memory: `add(repo_type, repo_id, {path: bytes})` or `add_dir`."""

  def __init__(self) -> None:
    self.repos: dict[tuple[str, str], dict[str, bytes]] = {}
    self.commits: dict[tuple[str, str], str] = {}
    self.downloads: list[str] = []  # paths of every GET of a file, in order
    self._server: ThreadingHTTPServer | None = None

  def add(self, repo_type: str, repo_id: str, files: dict[str, bytes]) -> str:
    key = (repo_type, repo_id)
    self.repos[key] = dict(files)
    listing = json.dumps({p: _blob_sha1(d) for p, d in sorted(files.items())}).encode()
    self.commits[key] = hashlib.sha1(listing).hexdigest()
    return self.commits[key]

  def add_dir(self, repo_type: str, repo_id: str, folder: Path) -> str:
    files = {
      str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }
    return self.add(repo_type, repo_id, files)

  @property
  def url(self) -> str:
    assert self._server is not None
    return f"http://127.0.0.1:{self._server.server_address[1]}"

  def __enter__(self) -> HubStandIn:
    self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
    threading.Thread(target=self._server.serve_forever, daemon=True).start()
    return self

  def __exit__(self, *exc) -> None:
    assert self._server is not None
    self._server.shutdown()
    self._server.server_close()

  def _repo(self, repo_type: str, repo_id: str, rev: str) -> tuple[dict[str, bytes], str] | None:
    key = (repo_type, repo_id)
    if key not in self.repos or rev not in ("main", self.commits[key]):
      return None
    return self.repos[key], self.commits[key]

  def info(self, repo_type: str, repo_id: str, rev: str) -> dict | None:
    found = self._repo(repo_type, repo_id, rev)
    if found is None:
      return None
    files, commit = found
    siblings = []
    for path, data in sorted(files.items()):
      row = {"rfilename": path, "size": len(data), "blobId": _blob_sha1(data)}
      if _is_lfs(path, data):
        sha = hashlib.sha256(data).hexdigest()
        row["lfs"] = {"sha256": sha, "size": len(data), "pointerSize": 134}
      siblings.append(row)
    return {"id": repo_id, "sha": commit, "private": False, "siblings": siblings}


_API = re.compile(r"^/api/(models|datasets)/([^/]+/[^/]+)(?:/revision/([^/?]+))?/?(?:\?.*)?$")
_RESOLVE = re.compile(r"^/(datasets/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+?)(?:\?.*)?$")


def _handler(hub: HubStandIn) -> type[BaseHTTPRequestHandler]:
  class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet: the test prints what it needs
      pass

    def _not_found(self, code: str) -> None:
      body = json.dumps({"error": code}).encode()
      self.send_response(404)
      self.send_header("X-Error-Code", code)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      if self.command != "HEAD":
        self.wfile.write(body)

    def _file(self) -> None:
      m = _RESOLVE.match(self.path)
      if not m:
        return self._not_found("RepoNotFound")
      repo_type = "dataset" if m.group(1) else "model"
      found = hub._repo(repo_type, m.group(2), m.group(3))
      if found is None:
        return self._not_found("RepoNotFound")
      files, commit = found
      path = m.group(4)
      if path not in files:
        return self._not_found("EntryNotFound")
      data = files[path]
      lfs = _is_lfs(path, data)
      etag = hashlib.sha256(data).hexdigest() if lfs else _blob_sha1(data)
      start = 0
      ranged = self.headers.get("Range")
      if ranged and self.command == "GET":
        start = int(re.match(r"bytes=(\d+)-", ranged).group(1))
      body = data[start:]
      self.send_response(206 if start else 200)
      self.send_header("X-Repo-Commit", commit)
      self.send_header("ETag", f'"{etag}"')
      if lfs:
        self.send_header("X-Linked-Etag", f'"{etag}"')
        self.send_header("X-Linked-Size", str(len(data)))
      if start:
        self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
      self.send_header("Content-Length", str(len(body)))
      self.send_header("Content-Type", "application/octet-stream")
      self.end_headers()
      if self.command == "GET":
        hub.downloads.append(f"{m.group(2)}/{path}")
        self.wfile.write(body)

    def do_HEAD(self) -> None:
      self._file()

    def do_GET(self) -> None:
      m = _API.match(self.path)
      if not m:
        return self._file()
      repo_type = "model" if m.group(1) == "models" else "dataset"
      info = hub.info(repo_type, m.group(2), m.group(3) or "main")
      if info is None:
        return self._not_found("RepoNotFound")
      body = json.dumps(info).encode()
      self.send_response(200)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

  return Handler
