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
