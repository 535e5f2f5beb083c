from __future__ import annotations

import pytest
from flax import nnx

from asearcher_jax.model import transformer
from asearcher_jax.serving.driver import Driver, DriverConfig
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.tokenizer import Tokenizer
from tests.model.test_model import small_cfg

VOCAB = 101  # tiny model; its ids are valid Qwen2 ids, so the real tokenizer decodes them


@pytest.fixture(scope="session")
def tokenizer():
  return Tokenizer.qwen2()


def tiny_model(seed: int = 0, **kw):
  return transformer.Transformer(small_cfg(vocab_size=VOCAB, **kw), rngs=nnx.Rngs(seed))


@pytest.fixture
def make_driver(tokenizer):
  drivers = []

  def make(
    model=None, *, slots=4, max_seq_len=64, buckets=(8, 16, 32), decode_rows=(8, 16), **driver_kw
  ):
    engine = Engine.from_model(
      model or tiny_model(),
      tokenizer,
      EngineConfig(
        max_slots=slots, max_seq_len=max_seq_len, prefill_buckets=buckets, decode_rows=decode_rows
      ),
    )
    d = Driver(engine, DriverConfig(**driver_kw))
    drivers.append(d)
    return d

  yield make
  for d in drivers:
    d.close()
