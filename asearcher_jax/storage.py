"""What every user of a gs:// run directory shares (weights store, checkpoints, journals, logs).

Paths go through `etils.epath`, which reaches GCS through gcsfs. gcsfs caches directory listings
per process and trusts them, for `exists` and for the size of a file it opens, until that process
writes there itself; on a pod other processes write the same prefixes (the trainer publishes, every
server polls; each trainer process writes its own parts), so a cached listing hides new objects
and cuts a rewritten pointer to its old length. `gcs_without_listing_cache` turns the cache off for
every gs:// filesystem made from then on; the modules that use gs:// call it at import, before any
filesystem exists.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)


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
    self.local = os.path.abspath(os.fspath(local))
    self.remote = _epath(remote)
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

  def _read_generation(self) -> None:
    pointer = self._pointer()
    self.generation = int(pointer.read_text()) if pointer.exists() else 0

  def shipped_bytes(self) -> bytes | None:
    """The journal as shipped (its current generation, up to the first gap); None when nothing
    was ever shipped. What a reader of the run directory sees while the writer runs elsewhere."""
    self._read_generation()
    if not (self.remote / f"{self.name}.segments").exists():
      return None
    return b"".join(path.read_bytes() for _, path in self._segments())

  def open(self) -> int:
    """Reconciles the local journal with the shipped one; returns the bytes restored."""
    self._read_generation()
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


def _epath(path: str | os.PathLike):
  from etils import epath

  return epath.Path(os.fspath(path) if is_url(path) else os.path.abspath(path))


def jsonl_lines(text: str) -> list[str]:
  """The lines of a JSON Lines text: split on "\n" only. `str.splitlines` also splits on
  U+2028, U+2029 and U+0085, which JSON leaves unescaped inside strings when written
  with `ensure_ascii=False` (as our logs are): a model's text holding one of them tore its
  record in two (a "\r" before the "\n" is JSON whitespace). Like `splitlines`, a final "\n"
  ends the last line rather than starting an empty one."""
  lines = text.split("\n")
  if lines[-1] == "":
    lines.pop()
  return lines


def read_journal(path: str | os.PathLike) -> bytes | None:
  """The bytes of an append-only journal at `path`: the file itself, else what a
  `ShippedJournal` shipped there (`<path>.segments`, by a writer appending on its own disk);
  None when neither exists."""
  p = _epath(path)
  if p.exists():
    return p.read_bytes()
  return ShippedJournal(os.devnull, p.parent, name=p.name).shipped_bytes()


class ShippedLogs:
  """A run's logs appended on local disk and shipped to the run directory on a bucket.

  Each journal (a large append-only log, e.g. the episode export) is shipped in sealed segments
  (`ShippedJournal`) under its writer's lock, so a segment ends on a whole record; each file that
  matches `files` (small files that readers open whole: metrics.jsonl, TensorBoard events, the
  resume log) is copied whole when it changed. `open` brings back what a replaced VM lost:
  journals from their segments, files copied back (a `.jsonl` cut after its last full line, so
  appends never follow a torn one). A thread ships every `every_s`; `close` ships a last time.
  """

  def __init__(
    self,
    local: str | os.PathLike,
    remote: str | os.PathLike,
    *,
    journals: Mapping[str, threading.Lock],
    files: Sequence[str],
    every_s: float = 60.0,
  ) -> None:
    if every_s <= 0:
      raise ValueError(f"every_s must be > 0, got {every_s}")
    self.local = os.path.abspath(os.fspath(local))
    self.remote = _epath(remote)
    self.files = tuple(files)  # glob patterns relative to `local` ('/'-separated)
    self.every_s = every_s
    self._journals = {
      name: (ShippedJournal(os.path.join(self.local, name), self._remote_dir(name),
                            name=os.path.basename(name)), lock)
      for name, lock in journals.items()
    }  # fmt: skip
    self._copied: dict[str, tuple[int, int]] = {}  # file -> (size, mtime_ns) last shipped
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._ship_lock = threading.Lock()

  def _remote_dir(self, name: str):
    parent = os.path.dirname(name)
    return self.remote / parent if parent else self.remote

  def _local_files(self) -> list[str]:
    out = []
    for folder, _, names in os.walk(self.local):
      for n in names:
        rel = os.path.relpath(os.path.join(folder, n), self.local).replace(os.sep, "/")
        if any(fnmatch.fnmatch(rel, pat) for pat in self.files):
          out.append(rel)
    return sorted(out)

  def open(self) -> int:
    """Restores journals and files missing on local disk from the run directory; returns the
    bytes restored."""
    restored = sum(journal.open() for journal, _ in self._journals.values())
    for pattern in self.files:
      folder = self._remote_dir(pattern)
      if not folder.exists():
        continue
      for remote in folder.iterdir():
        rel = f"{os.path.dirname(pattern)}/{remote.name}".lstrip("/")
        local = os.path.join(self.local, rel)
        if os.path.exists(local) or not fnmatch.fnmatch(rel, pattern) or remote.is_dir():
          continue
        data = remote.read_bytes()
        if rel.endswith(".jsonl"):
          data = data[: data.rfind(b"\n") + 1]
        os.makedirs(os.path.dirname(local), exist_ok=True)
        with open(local, "wb") as f:
          f.write(data)
        st = os.stat(local)
        self._copied[rel] = (st.st_size, st.st_mtime_ns)
        restored += len(data)
    if restored:
      log.info("restored %d bytes of run logs from %s", restored, self.remote)
    return restored

  def ship(self) -> int:
    """Ships what changed since the last shipment; returns the bytes shipped."""
    with self._ship_lock:
      shipped = 0
      for journal, lock in self._journals.values():
        with lock:
          shipped += journal.ship()
      for rel in self._local_files():
        path = os.path.join(self.local, rel)
        st = os.stat(path)
        if self._copied.get(rel) == (st.st_size, st.st_mtime_ns):
          continue
        with open(path, "rb") as f:
          data = f.read()
        target = self.remote / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)  # one whole object: never appended on the bucket
        self._copied[rel] = (st.st_size, st.st_mtime_ns)
        shipped += len(data)
      return shipped

  def start(self) -> None:
    self._thread = threading.Thread(target=self._loop, name="ship-logs", daemon=True)
    self._thread.start()

  def _loop(self) -> None:
    while not self._stop.wait(self.every_s):
      try:
        self.ship()
      except Exception:  # a transient bucket error: the next round ships the same bytes
        log.exception("shipping run logs to %s failed; retrying in %.0f s", self.remote,
                      self.every_s)  # fmt: skip

  def close(self, timeout: float = 60.0) -> None:
    """Stops the thread and ships a last time (what the run wrote up to its end)."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout)
    self.ship()


def cache_root() -> str:
  """Where gs:// inputs are copied to be read locally ($ASEARCHER_HOME or ~/.cache/asearcher_jax)."""
  home = os.environ.get("ASEARCHER_HOME") or os.path.join(
    os.path.expanduser("~"), ".cache", "asearcher_jax"
  )
  return os.path.join(home, "gcs-cache")


# What a view of a run directory never reads (`local_copy(skip=RUN_HEAVY)`): weights, optimiser
# state and the replay queue's token arrays (GBs on a pod run); the rest a run writes is small.
RUN_HEAVY = ("checkpoints", "replay", "weights", "compile_cache")


def _files_under(folder: Any, skip: Sequence[str] = ()) -> list[Any]:
  """Every file below a gs:// folder (epath refuses `rglob` there: one listing per level),
  leaving out folders named in `skip`."""
  out = []
  for p in folder.iterdir():
    if p.is_dir():
      out.extend(_files_under(p, skip) if p.name not in skip else [])
    else:
      out.append(p)
  return out


def local_copy(path: str | os.PathLike, *, what: str, skip: Sequence[str] = ()) -> str:
  """A gs:// file or folder copied into the local cache (a path is returned as it is).

  Readers that need a local file (faiss, safetensors' memory map, tokenizers, gzip over a seek)
  take one: a checkpoint, a questions file, an index directory given as gs:// is copied once
  under `cache_root()` (a file already there at the bucket's size is kept, so a restart copies
  nothing), with one log line saying so; `what` names the input in it. `skip`: folders (by
  name, at any depth) left out, e.g. a run directory's checkpoints (`RUN_HEAVY`).
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
  files = [src] if src.is_file() else _files_under(src, skip)
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
