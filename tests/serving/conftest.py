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


# Decode steps per generate call for tests that run both ways (`indirect` parametrization of
# make_driver): one step per call, and several with stops and budgets applied on the device.
BOTH_STEPS = pytest.mark.parametrize("make_driver", [1, 4], indirect=True, ids=["k1", "k4"])


@pytest.fixture
def make_driver(tokenizer, request):
  drivers = []
  default_steps = getattr(request, "param", 1)

  def make(model=None, *, slots=4, max_seq_len=64, buckets=(8, 16, 32), decode_rows=(8, 16),
           decode_steps=None, suffix_batch=(1, 2, 4, 8), **driver_kw):  # fmt: skip
    cfg = EngineConfig(
      max_slots=slots, max_seq_len=max_seq_len, prefill_buckets=buckets, decode_rows=decode_rows,
      decode_steps_per_call=decode_steps or default_steps, suffix_batch=suffix_batch,
    )  # fmt: skip
    engine = Engine.from_model(model or tiny_model(), tokenizer, cfg)
    d = Driver(engine, DriverConfig(**driver_kw))
    drivers.append(d)
    return d

  yield make
  for d in drivers:
    d.close()
