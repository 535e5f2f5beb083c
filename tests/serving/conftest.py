from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator

import pytest
from flax import nnx

from asearcher_jax.model import transformer
from asearcher_jax.serving.admission import Admission
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


# KV layouts for tests that run on both (`EngineConfig.kv_layout`): the fixed-slot cache is the
# oracle the paged one must equal. Paged tests use small pages, so sequences span several.
BOTH_LAYOUTS = pytest.mark.parametrize("kv_layout", ["fixed", "paged"])
TEST_PAGE_SIZE = 4


@pytest.fixture
def kv_layout() -> str:
  """The layout make_driver builds unless a test asks for another (`BOTH_LAYOUTS`)."""
  return "fixed"


@pytest.fixture
def make_driver(tokenizer, request, kv_layout):
  drivers = []
  default_steps = getattr(request, "param", 1)

  def make(model=None, *, slots=4, max_seq_len=64, buckets=(8, 16, 32), decode_rows=(8, 16),
           decode_steps=None, suffix_batch=(1, 2, 4, 8), decode_loop="while", layout=None,
           num_pages=0, paged_attention="auto", mesh=None, **driver_kw):  # fmt: skip
    cfg = EngineConfig(
      max_slots=slots, max_seq_len=max_seq_len, prefill_buckets=buckets, decode_rows=decode_rows,
      decode_steps_per_call=decode_steps or default_steps, suffix_batch=suffix_batch,
      decode_loop=decode_loop, kv_layout=layout or kv_layout, page_size=TEST_PAGE_SIZE,
      num_pages=num_pages, paged_attention=paged_attention,
      mesh=mesh or EngineConfig().mesh,
    )  # fmt: skip
    engine = Engine.from_model(model or tiny_model(), tokenizer, cfg)
    d = Driver(engine, DriverConfig(**driver_kw))
    drivers.append(d)
    return d

  yield make
  for d in drivers:
    d.close()


class DriverHold:
  """Where a test holds the driver thread: `reached` is set once the wrapped method has returned
  with its condition true, and the thread waits there until `release()` (or the block ends)."""

  def __init__(self) -> None:
    self.reached, self.released = threading.Event(), threading.Event()

  async def wait_reached(self, timeout: float = 60.0) -> None:
    assert await asyncio.to_thread(self.reached.wait, timeout), "the driver never got there"

  def release(self) -> None:
    self.released.set()


@contextlib.contextmanager
def hold_driver(
  driver: Driver | Admission, method: str, when: Callable[..., bool] = lambda *args: True
) -> Iterator[DriverHold]:
  """Holds the driver thread once, right after `driver.<method>(...)` returns with `when(...)`
  (given the same arguments) true, so a test can act at an exact point of the driver's loop: polled
  from the event loop instead, the point was missed on a busy machine (CI runs of 2026-11-26).
  `driver` may be the driver's `Admission` (`driver._admission`), whose methods run on that
  thread too."""
  hold, original = DriverHold(), getattr(driver, method)

  def held(*args):
    out = original(*args)
    if not hold.reached.is_set() and when(*args):
      hold.reached.set()
      hold.released.wait(30)
    return out

  setattr(driver, method, held)
  try:
    yield hold
  finally:
    hold.release()
    setattr(driver, method, original)
