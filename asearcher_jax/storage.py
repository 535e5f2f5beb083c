"""What every user of a gs:// run directory shares (weights store, checkpoints, journals).

Paths go through `etils.epath`, which reaches GCS through gcsfs. gcsfs caches directory listings
per process and trusts them, for `exists` and for the size of a file it opens, until that process
writes there itself; on a pod other processes write the same prefixes (the trainer publishes, every
server polls; each trainer process writes its own parts), so a cached listing hides new objects
and cuts a rewritten pointer to its old length. `gcs_without_listing_cache` turns the cache off for
every gs:// filesystem made from then on; the modules that use gs:// call it at import, before any
filesystem exists.
"""

from __future__ import annotations

import os
from typing import Any


def is_url(path: Any) -> bool:
  return "://" in os.fspath(path)


def gcs_without_listing_cache() -> None:
  try:
    import fsspec.config
  except ImportError:  # no fsspec, no gs:// through epath either
    return
  for protocol in ("gs", "gcs"):
    fsspec.config.conf.setdefault(protocol, {})["use_listings_cache"] = False


class ShippedJournal:
  """An append-only journal kept on local disk and shipped to the run directory in whole objects.

  Appending and fsyncing on a bucket mount re-uploads the whole object at every flush (gcsfuse
  has no append), so a journal is appended locally and `ship` uploads the bytes appended since the
  last shipment as one sealed segment, `<remote>/<name>.segments/g<generation>/<offset>` (its
  offset in the journal), never touched again. `remote` is a gs:// URL or a path (a mount: each
  segment is then one new file, written once). The journal as a whole is the local file; where
  that is gone (a restarted VM) or shorter than what was shipped, `open` rebuilds it from the
  segments, up to the first gap. `rebase` starts a new generation holding the local file whole
  (after the owner rewrote it, e.g. compacted it) and deletes the older ones; `<name>.generation`
  names the current one (a small object write is atomic), so a crash mid-rebase leaves the old
  generation in force.
  """

  def __init__(self, local: str | os.PathLike, remote: str | os.PathLike, *, name: str) -> None:
    from etils import epath

    self.local = os.path.abspath(os.fspath(local))
    self.remote = epath.Path(os.fspath(remote) if is_url(remote) else os.path.abspath(remote))
    self.name = name
    self.generation = 0
    self.shipped = 0  # bytes of the local journal already in sealed segments

  def _segments_dir(self, generation: int):
    return self.remote / f"{self.name}.segments" / f"g{generation:06d}"

  def _pointer(self):
    return self.remote / f"{self.name}.generation"

  def _segments(self) -> list[tuple[int, Any]]:
    """(offset, path) of the current generation's segments, in order, up to the first gap."""
    folder = self._segments_dir(self.generation)
    if not folder.exists():
      return []
    found = sorted((int(p.name), p) for p in folder.iterdir() if p.name.isdigit())
    out, end = [], 0
    for offset, path in found:
      if offset != end:
        break  # a gap: what follows cannot be placed
      out.append((offset, path))
      end = offset + path.stat().length
    return out

  def open(self) -> int:
    """Reconciles the local journal with the shipped one; returns the bytes restored."""
    pointer = self._pointer()
    self.generation = int(pointer.read_text()) if pointer.exists() else 0
    segments = self._segments()
    end = segments[-1][0] + segments[-1][1].stat().length if segments else 0
    have = os.path.getsize(self.local) if os.path.exists(self.local) else 0
    if have >= end:
      self.shipped = end
      return 0
    tmp = self.local + ".restore"
    os.makedirs(os.path.dirname(self.local), exist_ok=True)
    with open(tmp, "wb") as f:
      for _, path in segments:
        f.write(path.read_bytes())
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, self.local)
    self.shipped = end
    return end - have

  def ship(self) -> int:
    """Uploads what was appended since the last shipment as one sealed segment; returns its
    bytes (0: nothing new). The caller holds its appends back meanwhile (a segment holds whole
    records only)."""
    size = os.path.getsize(self.local) if os.path.exists(self.local) else 0
    if size < self.shipped:  # the owner cut its journal below what was shipped: ship it anew
      return self.rebase()
    if size == self.shipped:
      return 0
    with open(self.local, "rb") as f:
      f.seek(self.shipped)
      data = f.read(size - self.shipped)
    folder = self._segments_dir(self.generation)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{self.shipped:016d}").write_bytes(data)
    self.shipped += len(data)
    return len(data)

  def rebase(self) -> int:
    """Ships the local journal whole as a new generation, then drops the older generations."""
    self.generation, self.shipped = self.generation + 1, 0
    shipped = self.ship()
    self._pointer().write_text(str(self.generation))
    for folder in (self.remote / f"{self.name}.segments").iterdir():
      if folder.name != f"g{self.generation:06d}":
        folder.rmtree(missing_ok=True)
    return shipped


def cache_root() -> str:
  """Where gs:// inputs are copied to be read locally ($ASEARCHER_HOME or ~/.cache/asearcher_jax)."""
  home = os.environ.get("ASEARCHER_HOME") or os.path.join(
    os.path.expanduser("~"), ".cache", "asearcher_jax"
  )
  return os.path.join(home, "gcs-cache")


def _files_under(folder: Any) -> list[Any]:
  """Every file below a gs:// folder (epath refuses `rglob` there: one listing per level)."""
  out = []
  for p in folder.iterdir():
    out.extend(_files_under(p) if p.is_dir() else [p])
  return out


def local_copy(path: str | os.PathLike, *, what: str) -> str:
  """A gs:// file or folder copied into the local cache (a path is returned as it is).

  Readers that need a local file (faiss, safetensors' memory map, tokenizers, gzip over a seek)
  take one: a checkpoint, a questions file, an index directory given as gs:// is copied once
  under `cache_root()` (a file already there at the bucket's size is kept, so a restart copies
  nothing), with one log line saying so; `what` names the input in it.
  """
  path = os.fspath(path)
  if not path.startswith(("gs://", "gcs://")):
    return path
  import logging
  import shutil

  from etils import epath

  gcs_without_listing_cache()
  src = epath.Path(path)
  local = os.path.join(cache_root(), path.split("://", 1)[1].rstrip("/"))
  if not src.exists():
    raise FileNotFoundError(f"{what}: {path} does not exist")
  files = [src] if src.is_file() else _files_under(src)
  logging.getLogger(__name__).info(
    "%s: copying %s (%d files) to the local cache %s", what, path, len(files), local
  )
  for f in files:
    dst = local if f == src else os.path.join(local, os.fspath(f.relative_to(src)))
    size = f.stat().length
    if os.path.exists(dst) and os.path.getsize(dst) == size:
      continue
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = f"{dst}.part"
    with f.open("rb") as r, open(tmp, "wb") as w:
      shutil.copyfileobj(r, w, 8 << 20)
    os.replace(tmp, dst)
  return local
