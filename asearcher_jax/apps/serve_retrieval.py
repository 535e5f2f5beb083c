"""`asearcher serve-retrieval`: the retrieval server (`/retrieve`, `/access`, `/health`).

Runs with no gin file at all: the shipped corpus's BM25 index (built first if missing) on
loopback port 8000.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from asearcher_jax import storage
from asearcher_jax.apps import rehearsal
from asearcher_jax.apps.index import default_index_dir
from asearcher_jax.tools.retrieval.corpus import CorpusError, default_corpus_paths
from asearcher_jax.tools.retrieval.index import build_index_dir, load_encoder, load_index
from asearcher_jax.tools.retrieval.server import RetrievalServerConfig, run_server

log = logging.getLogger(__name__)

# The port `asearcher serve-retrieval` listens on when nothing binds one (gin/runs binds it too).
DEFAULT_PORT = 8000


def serve(
  *,
  index_dir: str | None = None,
  encoder: str | None = None,
  server: RetrievalServerConfig | None = None,
) -> int:
  """Serves `/retrieve`, `/access` and `/health` until interrupted.

  With no `index_dir`, the shipped corpus's index is used and built first if missing (about a
  second). `encoder` overrides the manifest's encoder spec for a dense index.

  Args:
    index_dir: an index built by `asearcher index`; None: the shipped corpus's (built if missing).
    encoder: a dense or hybrid index's query encoder ("e5:<HF dir>" or 'module:factory'); None:
      the manifest's (thread workers only: process workers load the manifest's).
    server: how the server listens and what it accepts (host, port, address file, limits,
      workers, batching); None: the defaults on port 8000.
  """
  if rehearsal.active():  # `asearcher rehearse`: a CPU role, nothing to compile for a chip
    return rehearsal.cpu_role("retrieval")
  config = RetrievalServerConfig(port=DEFAULT_PORT) if server is None else server
  if index_dir is None:
    out = default_index_dir()
    build_index_dir(corpus=default_corpus_paths(), index_dir=out, show_progress=False)
  else:  # a gs:// index is served from the local cache (faiss and tantivy read local files)
    out = Path(storage.local_copy(index_dir, what="serve_retrieval.serve.index_dir"))
  if not out.exists():
    raise CorpusError(f"index directory {out} does not exist (run `asearcher index` first)")
  if encoder and config.worker_kind == "process":
    raise CorpusError(
      "an encoder override needs thread workers (process workers load the index's own)"
    )
  index = load_index(out, encoder=load_encoder(encoder) if encoder else None)
  log.info("loaded index %s in %.2f s", out, index.manifest["load_s"])
  asyncio.run(run_server(index, config))
  return 0
