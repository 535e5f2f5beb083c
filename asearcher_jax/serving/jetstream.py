"""The one compatibility layer for google-jetstream 0.2.2 (the last PyPI release).

That release (a) imports `seqio` (and through it TensorFlow) at import time only for
SentencePiece vocabularies we never use, (b) calls `jax.tree_map`, which current jax removed, and
(c) sets the root logger to DEBUG with a stdout handler when the orchestrator is imported. This
module fixes all three before anything else imports jetstream; everything in this package imports
jetstream through here. It also holds what JetStream's API asks of our engine and tokenizer that
does not depend on the model: `EngineContract` and `JetStreamTokenizer`.
"""

from __future__ import annotations

import logging
import os
import sys
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from asearcher_jax.tokenizer import Tokenizer


def _install_shims() -> None:
  if not hasattr(jax, "tree_map"):
    jax.tree_map = jax.tree.map  # used by orchestrator.delete_pytree on every insert
  try:
    import seqio
  except ImportError:
    seqio = types.ModuleType("seqio")
    vocabularies = types.ModuleType("seqio.vocabularies")

    class Vocabulary:  # only referenced in type positions by jetstream
      def __init__(self, *args, **kwargs):
        raise NotImplementedError("seqio vocabularies are not available; use the HF tokenizer")

    class SentencePieceVocabulary(Vocabulary):
      pass

    vocabularies.Vocabulary = Vocabulary
    vocabularies.SentencePieceVocabulary = SentencePieceVocabulary
    seqio.vocabularies = vocabularies
    sys.modules["seqio"] = seqio
    sys.modules["seqio.vocabularies"] = vocabularies


def _import_quietly():
  root = logging.getLogger()
  level, handlers = root.level, list(root.handlers)
  try:
    from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2

    return engine_api, tokenizer_api, tokenizer_pb2
  finally:
    root.setLevel(level)
    root.handlers[:] = handlers


_install_shims()
engine_api, tokenizer_api, tokenizer_pb2 = _import_quietly()


class _QuietJetStream(logging.Filter):
  """Drops 0.2.2's per-step INFO/DEBUG records (it logs through the root logger on every prefill,
  insert, decode and detokenize step); its warnings and errors still come through."""

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or f"{os.sep}jetstream{os.sep}" not in record.pathname


_QUIET = _QuietJetStream()


def import_core():
  """jetstream.core (orchestrator, server_lib, protos), imported without touching the root logger."""
  root = logging.getLogger()
  if _QUIET not in root.filters:
    root.addFilter(_QUIET)
  level, handlers = root.level, list(root.handlers)
  try:
    from jetstream.core import config_lib, orchestrator, server_lib
    from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc

    return types.SimpleNamespace(
      config_lib=config_lib,
      orchestrator=orchestrator,
      server_lib=server_lib,
      jetstream_pb2=jetstream_pb2,
      jetstream_pb2_grpc=jetstream_pb2_grpc,
    )
  finally:
    root.setLevel(level)
    root.handlers[:] = handlers


class JetStreamTokenizer(tokenizer_api.Tokenizer):
  """Our Tokenizer as JetStream's: encode pads to a power of two (>= 16) and never truncates."""

  def __init__(self, tokenizer: Tokenizer):
    self.tokenizer = tokenizer

  def encode(self, s: str, **kwargs) -> tuple[jax.Array | np.ndarray, int]:
    """Returns (padded ids, true length). `is_bos` is ignored (Qwen has no BOS token);
    `max_prefill_length` is not applied here: the engine rejects prompts that do not fit rather
    than silently dropping their head, as 0.2.2's `pad_tokens` would."""
    ids = self.tokenizer.encode(s)
    return pad_ids(ids, self.pad_id, jax_padding=kwargs.get("jax_padding", True))

  def decode(self, token_ids: list[int], **kwargs) -> str:
    return self.tokenizer.decode(token_ids)

  @property
  def pad_id(self) -> int:
    return self.tokenizer.pad_id

  @property
  def eos_id(self) -> int:
    return self.tokenizer.eos_id

  @property
  def bos_id(self) -> int:
    # Qwen has no BOS; nothing here prepends one (see `_Driver`). The pad id keeps the type.
    return self.tokenizer.pad_id

  @property
  def stop_tokens(self) -> set[int]:
    return set(self.tokenizer.stop_token_ids)


class EngineContract(engine_api.Engine):
  """JetStream's Engine properties and tokenizer methods, written once for both of our engines
  (`engine.Engine` and the orchestrator's `jetstream_server.JetStreamEngine`). A subclass sets
  `tokenizer` (ours), `cfg` (an `EngineConfig`: max_slots, max_seq_len) and `_mesh`, and writes
  the rest of the contract: load_params, init_decode_state, prefill, insert, generate."""

  tokenizer: Tokenizer
  cfg: Any  # engine.EngineConfig (imported there: engine.py imports this module)
  _mesh: jax.sharding.Mesh

  def get_prefix_destination_sharding(self) -> Any:
    return jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec())

  def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
    return tokenizer_pb2.TokenizerParameters(path="hf")

  def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> JetStreamTokenizer:
    return JetStreamTokenizer(self.tokenizer)

  @property
  def max_concurrent_decodes(self) -> int:
    return self.cfg.max_slots

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self.cfg.max_seq_len

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return self._mesh

  @property
  def colocated_cpus(self) -> None:
    return None


def pad_ids(ids, pad_id: int, *, jax_padding: bool = True) -> tuple[jax.Array | np.ndarray, int]:
  n = len(ids)
  width = max(16, 1 << max(n - 1, 0).bit_length())
  padded = np.full((width,), pad_id, np.int32)
  padded[:n] = np.asarray(ids, np.int32)
  return (jnp.asarray(padded) if jax_padding else padded), n
