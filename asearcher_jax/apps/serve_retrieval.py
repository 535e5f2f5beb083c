"""`asearcher serve-retrieval`: the retrieval server (`/retrieve`, `/access`, `/health`).

Runs with no gin file at all: the shipped corpus's BM25 index (built first if missing) on a
loopback port.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from asearcher_jax.apps.index import default_index_dir
from asearcher_jax.tools.retrieval.corpus import CorpusError, default_corpus_paths
from asearcher_jax.tools.retrieval.index import build_index_dir, load_encoder, load_index
from asearcher_jax.tools.retrieval.server import RetrievalServerConfig, run_server

log = logging.getLogger(__name__)


def serve(
  *,
  index_dir: str | None = None,
  host: str = "127.0.0.1",
  port: int = 8000,
  addr_dir: str | None = None,
  default_topk: int = 3,
  max_topk: int = 100,
  max_batch: int = 512,
  max_inflight: int = 1024,
  max_request_bytes: int = 1 << 20,
  workers: int = 2,
  batch_window_ms: float = 2.0,
  search_timeout_s: float = 30.0,
  encoder: str | None = None,
) -> int:
  """Serves `/retrieve`, `/access` and `/health` until interrupted.

  With no `index_dir`, the shipped corpus's index is used and built first if missing (about a
  second). `encoder` overrides the manifest's encoder spec for a dense index.

  Args:
    index_dir: an index built by `asearcher index`; None: the shipped corpus's (built if missing).
    host: interface to bind; loopback by default so nothing is exposed by accident.
    port: TCP port; 0 picks a free one (read it from the address file or the log).
    addr_dir: directory for the discovery file `Host{ip}_IP{port}.txt`; None: none.
    default_topk: topk used when a request omits it or sends 0 (ASearcher's server default).
    max_topk: largest topk a request may ask for.
    max_batch: most queries (or urls) one request may carry.
    max_inflight: requests served at once; more get 503.
    max_request_bytes: largest request body in bytes (413 beyond it).
    workers: threads scoring batches at once (throughput grows with them up to the host's cores).
    batch_window_ms: under load, how long arriving requests are collected into the next batch.
    search_timeout_s: a search or page lookup not answered within this is a 503.
    encoder: 'module:factory' of a dense index's query encoder; None: the manifest's.
  """
  if index_dir is None:
    out = default_index_dir()
    build_index_dir(corpus=default_corpus_paths(), index_dir=out, show_progress=False)
  else:
    out = Path(index_dir)
  if not out.exists():
    raise CorpusError(f"index directory {out} does not exist (run `asearcher index` first)")
  index = load_index(out, encoder=load_encoder(encoder) if encoder else None)
  log.info("loaded index %s in %.2f s", out, index.manifest["load_s"])
  config = RetrievalServerConfig(
    host=host,
    port=port,
    addr_dir=addr_dir,
    default_topk=default_topk,
    max_topk=max_topk,
    max_batch=max_batch,
    max_inflight=max_inflight,
    max_request_bytes=max_request_bytes,
    workers=workers,
    batch_window_ms=batch_window_ms,
    search_timeout_s=search_timeout_s,
  )
  asyncio.run(run_server(index, config))
  return 0
