"""Engine warm-up: compile every prefill, insert, suffix-prefill and decode shape up front.

Split from engine.py to keep that module to the engine itself; `Engine.warmup` calls this.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from asearcher_jax.serving.sampling import SamplingMode
from asearcher_jax.serving.types import SamplingParams

if TYPE_CHECKING:
  from asearcher_jax.serving.engine import Engine


def warmup(
  engine: Engine,
  *,
  chunks: Sequence[int] = (1, 2, 4, 8),
  modes: Sequence[SamplingMode] = ("greedy", "sample"),
  extend: bool = True,
) -> float:
  """Compiles prefill (every bucket x admission chunk x mode), insert and every decode window
  (one step, and the multi-step call when decode_steps_per_call > 1) now, so that no request
  pays a compile later; returns the seconds taken. "truncate" (top-p/top-k) compiles on first
  use unless listed in `modes`. extend: also every suffix prefill shape (suffix bucket x window x
  mode, and x `suffix_batch` size) that prefix reuse uses."""
  t0 = time.perf_counter()
  params, state = engine.load_params(), engine.init_decode_state()
  for bucket in engine.cfg.buckets:
    prompt = [1] * min(bucket, engine.cfg.max_seq_len - 1)
    for mode in modes:
      temp = 0.0 if mode == "greedy" else 1.0
      for k in chunks:
        sp = [SamplingParams(temperature=temp, top_p=0.9 if mode == "truncate" else 1.0)] * k
        prefixes = engine.prefill_many(params=params, prompts=[prompt] * k, samplings=sp,
                                       seeds=list(range(k)))  # fmt: skip
        state = engine.insert_many(prefixes, state, list(range(k)))
    padded, n = engine.pad(prompt)
    state = engine.insert(
      engine.prefill(params=params, padded_tokens=padded, true_length=n), state, 0
    )
  if extend:  # the no-prefill admission of a continuing turn, then every suffix prefill
    state = engine.activate_slot(state, 0, 1, 1, sampling=SamplingParams())
    for sb in engine.cfg.extend_buckets:
      for window in engine.cfg.buckets:
        if window < sb:
          continue
        for mode in modes:
          sp = SamplingParams(temperature=0.0 if mode == "greedy" else 1.0)
          state, *_ = engine.extend_slot(params, state, 0, [1], window - sb, sampling=sp,
                                         bucket=sb, window=window)  # fmt: skip
          for k in engine.cfg.suffix_chunks:
            if k > 1:
              state, *_ = engine.extend_slots(
                  params, state, list(range(k)), [[1]] * k, [window - sb] * k,
                  samplings=[sp] * k, seeds=list(range(k)), bucket=sb, window=window,
                )  # fmt: skip
  for window in engine.cfg.buckets:
    for mode in modes:
      for size in engine.cfg.row_buckets:
        live = range(size) if size < engine.cfg.max_slots else None
        state, result = engine.generate(params, state, max_length=window, mode=mode, live=live)
        if engine.cfg.decode_steps_per_call > 1:
          slots = list(live or range(size))
          state, *_ = engine.generate_chunk(params, state, slots, [1] * size, [()] * size,
                                            max_length=window, mode=mode)  # fmt: skip
  np.asarray(result.data)
  return time.perf_counter() - t0
