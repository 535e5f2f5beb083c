"""The policy as a JetStream engine: bucketed prefill, slot insert, one-token-per-slot generate.

Implements `jetstream.engine.engine_api.Engine` (0.2.2 contract) over our NNX Transformer, plus
what RL needs and JetStream lacks:
  * every generated token carries its logprob under the sampling distribution and the policy
    version of the weights that produced it, both written by the jitted step itself into the
    packed `ResultTokens` array (columns: token, valid, length, logprob bits, version);
  * params are `VersionedParams`, so swapping weights is swapping one value between two steps;
  * sampling settings and seeds are per slot (see sampling.py).
Shapes are fixed (slots x max_seq_len cache, a few buckets): nothing recompiles while serving.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import time
from collections.abc import Callable, Collection, Sequence
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asearcher_jax.model import ragged_paged
from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.model.kv_cache import PAGED_ATTENTION, KVCache, PagedKVCache
from asearcher_jax.model.transformer import Transformer
from asearcher_jax.serving import engine_steps as steps
from asearcher_jax.serving.engine_steps import DecodeState, Prefix, VersionedParams
from asearcher_jax.serving.jetstream import EngineContract, engine_api
from asearcher_jax.serving.mesh import (
  CACHE_HEADS,
  ServingMeshConfig,
  cache_sharding,
  engine_rules,
  make_engine_mesh,
  replicated,
)
from asearcher_jax.serving.sampling import SamplingMode, mode_for
from asearcher_jax.serving.types import SamplingParams
from asearcher_jax.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """Attributes:
  max_slots: decode batch: requests decoded together, one token each per step.
  max_seq_len: KV cache length per slot (prompt + generated tokens).
  prefill_buckets: padded prompt lengths, one compiled prefill each; lengths above
    max_seq_len are dropped and max_seq_len is always a bucket.
  suffix_buckets: extra padded lengths (besides the prefill buckets) for suffix prefills onto a
    cached prefix; a suffix costs its bucket, so keep a small one for 1-token continuations.
  decode_rows: decode-step sizes below max_slots: a step with at most r live slots (the
    smallest such r) gathers their cache rows and computes r rows instead of max_slots (agents
    park their slots while tools run, so few are live). One more compiled step per window and
    mode each; () always decodes every slot.
  decode_steps_per_call: most decode steps one generate call runs (`generate_chunk`: stop ids and
    per-slot budgets applied on the device; one dispatch and one host copy per call). Updates,
    aborts and admissions land at call boundaries. 1 (`generate`) is the default: the knob pays
    on accelerators, not on a CPU (docs/design_notes.md has the figures).
  decode_loop: the device loop of a multi-step call: "while" exits once no row emits (XLA:GPU
    reads its condition back every iteration); "fixed" runs all k iterations, spare ones masked
    (no read-back; real work on a CPU); "unrolled" is "fixed" as straight-line code. Same tokens.
  suffix_batch: how many parked slots one suffix prefill call may cover (`extend_slots`), in
    chunks of these sizes, largest first; each size above 1 compiles one more suffix prefill per
    shape. (1,), the default, is one call per slot: batching paid in isolation but agents' turns
    rarely arrive together and warm-up grew ~1.5x (docs/measurements.md, "Prefills").
  mesh: the engine's devices (tensor parallelism over heads, MLP and KV cache; see mesh.py).
  kv_layout: how keys/values are stored. "fixed": every slot reserves max_seq_len positions
    ([slots, max_seq_len] per layer). "paged": a pool of `num_pages` pages of `page_size`
    positions per layer and a page table per slot; a sequence holds only the pages its length
    needs, full pages of equal prefixes are shared (a group's prompt once, an episode's earlier
    turns), and the driver preempts the youngest sequences when the pool runs out (pages.py).
  page_size: positions per page ("paged"); max_seq_len must be a multiple of it.
  num_pages: pages in the pool, page 0 reserved as the null page ("paged"); 0: the fixed
    layout's memory, max_slots * max_seq_len / page_size, plus the null page.
  paged_attention: how attention reads the pages ("paged"; model/kv_cache.py PAGED_ATTENTION).
    "gather": each slot's pages gathered end to end (pure JAX, every backend); "ragged": JAX's
    ragged paged attention TPU kernel, each sequence over its own length only; "ragged_reference":
    the kernel's program with a pure-JAX stand-in (what CPU tests check the kernel's inputs with);
    "auto": ragged on TPU, gather elsewhere. Either way, where the tensor-parallel degree exceeds
    the KV heads (and divides by them) the pools hold each head once per chip
    (`ragged_paged.kv_repeat`), so every chip keeps one head's pages instead of all of them.
  prefill_tokens_per_call: most padded prompt tokens one whole-prompt prefill call takes: a
    bucket b is admitted k prompts at a time only where k * b fits (one prompt always); 0: no
    limit. Eight 32k prompts in one call need 115 GiB a chip for a 7B replica on v5p-8
    (`python -m launch rehearse`); the recipes bind 32,768.
  """

  max_slots: int = 8
  max_seq_len: int = 2048
  prefill_buckets: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
  suffix_buckets: tuple[int, ...] = (32, 64, 128, 256)
  decode_rows: tuple[int, ...] = (8, 16)
  decode_steps_per_call: int = 1
  decode_loop: Literal["while", "fixed", "unrolled"] = "while"
  suffix_batch: tuple[int, ...] = (1,)
  mesh: ServingMeshConfig = dataclasses.field(default_factory=ServingMeshConfig)
  kv_layout: Literal["fixed", "paged"] = "fixed"
  page_size: int = 16
  num_pages: int = 0
  paged_attention: Literal["auto", "gather", "ragged", "ragged_reference"] = "auto"
  prefill_tokens_per_call: int = 0

  def __post_init__(self):
    if self.max_slots < 1 or self.max_seq_len < 2:
      raise ValueError("max_slots must be >= 1 and max_seq_len >= 2")
    if self.decode_steps_per_call < 1:
      raise ValueError(f"decode_steps_per_call must be >= 1, got {self.decode_steps_per_call}")
    if self.decode_loop not in ("while", "fixed", "unrolled"):
      raise ValueError(f"decode_loop must be while, fixed or unrolled, got {self.decode_loop!r}")
    if 1 not in self.suffix_batch or min(self.suffix_batch) < 1:
      raise ValueError(f"suffix_batch must contain 1 and no size below 1, got {self.suffix_batch}")
    if self.kv_layout not in ("fixed", "paged"):
      raise ValueError(f"EngineConfig.kv_layout must be fixed or paged, got {self.kv_layout!r}")
    if self.paged_attention not in ("auto", *PAGED_ATTENTION):
      raise ValueError(
        f"EngineConfig.paged_attention must be auto, gather, ragged or ragged_reference, got "
        f"{self.paged_attention!r}"
      )
    if self.prefill_tokens_per_call < 0:
      raise ValueError(
        f"EngineConfig.prefill_tokens_per_call must be >= 0, got {self.prefill_tokens_per_call}"
      )
    if self.page_size < 1 or self.max_seq_len % self.page_size:
      raise ValueError(
        f"EngineConfig.page_size={self.page_size} must divide max_seq_len={self.max_seq_len}"
      )
    if self.kv_layout == "paged" and self.pool_pages - 1 < self.pages_per_seq:
      raise ValueError(
        f"EngineConfig.num_pages={self.num_pages} cannot hold one max_seq_len sequence "
        f"({self.pages_per_seq} pages plus the null page)"
      )

  @property
  def pages_per_seq(self) -> int:
    return self.max_seq_len // self.page_size

  @property
  def pool_pages(self) -> int:
    """Pages in the pool, the null page included (`num_pages`, or the fixed layout's memory)."""
    return self.num_pages or self.max_slots * self.pages_per_seq + 1

  @property
  def buckets(self) -> tuple[int, ...]:
    below = sorted({b for b in self.prefill_buckets if b < self.max_seq_len})
    return (*below, self.max_seq_len)

  @property
  def row_buckets(self) -> tuple[int, ...]:
    """Decode-step sizes, ascending; max_slots (every slot, no gather) is always the last."""
    return (*sorted({r for r in self.decode_rows if 0 < r < self.max_slots}), self.max_slots)

  @property
  def suffix_chunks(self) -> tuple[int, ...]:
    """Rows per suffix prefill call, largest first (always ending in 1)."""
    return tuple(sorted({k for k in self.suffix_batch if k <= self.max_slots}, reverse=True))

  @property
  def extend_buckets(self) -> tuple[int, ...]:
    below = {b for b in self.suffix_buckets if 0 < b < self.max_seq_len}
    return tuple(sorted(below | set(self.buckets)))


class Engine(EngineContract):
  """Our Transformer behind JetStream's Engine API (jitted steps in engine_steps.py), on its own
  mesh (`cfg.mesh` or `mesh`; shardings in mesh.py): the same steps serve one chip or a slice."""

  def __init__(
    self,
    model_cfg: ModelConfig,
    graphdef: nnx.GraphDef,
    params: nnx.State,
    tokenizer: Tokenizer,
    cfg: EngineConfig = EngineConfig(),
    *,
    version: int = 0,
    mesh: jax.sharding.Mesh | None = None,
  ):
    self.model_cfg = model_cfg
    self.cfg = cfg
    self.tokenizer = tokenizer
    self._graphdef = graphdef
    self._mesh = mesh or make_engine_mesh(cfg.mesh)
    shape = dict(self._mesh.shape)
    if tuple(shape) != sharding_lib.MESH_AXES or self._mesh.size != shape["tensor"]:
      raise ValueError(f"an engine mesh has axes data=1, fsdp=1, tensor; got {self._mesh.shape}")
    self._rules = engine_rules(model_cfg, self._mesh.shape["tensor"])
    # Where every weight lives; any params given to the engine are placed here first.
    self.param_shardings = sharding_lib.param_shardings(params, self._mesh, self._rules)
    self._initial = self.versioned(params, version)

  @classmethod
  def from_model(
    cls, model: Transformer, tokenizer: Tokenizer, cfg: EngineConfig = EngineConfig(), **kw
  ) -> Engine:
    graphdef, params = nnx.split(model)
    return cls(model.cfg, graphdef, params, tokenizer, cfg, **kw)

  def warmup(
    self,
    *,
    chunks: Sequence[int] = (1, 2, 4, 8),
    modes: Sequence[SamplingMode] = ("greedy", "sample"),
    extend: bool = True,
    jetstream: bool = True,
  ) -> float:
    """Compiles prefill (every bucket x admission chunk x mode), insert and every decode window
    (one step, and the multi-step call when decode_steps_per_call > 1) now, so that no request
    pays a compile later; returns the seconds taken. "truncate" (top-p/top-k) compiles on first
    use unless listed in `modes`. extend: also every suffix prefill shape (suffix bucket x window x
    mode, and x `suffix_batch` size) that prefix reuse uses. jetstream: also JetStream's own
    prefill and insert (one request, the general sampler), which only its gRPC server calls."""
    t0 = time.perf_counter()
    params, state = self.load_params(), self.init_decode_state()
    for bucket in self.cfg.buckets:
      prompt = [1] * min(bucket, self.cfg.max_seq_len - 1)
      for mode in modes:
        temp = 0.0 if mode == "greedy" else 1.0
        for k in self.prefill_chunks(bucket, chunks):
          sp = [SamplingParams(temperature=temp, top_p=0.9 if mode == "truncate" else 1.0)] * k
          prefixes = self.prefill_many(
            params=params, prompts=[prompt] * k, samplings=sp, seeds=list(range(k))
          )
          state = self.insert_many(prefixes, state, list(range(k)))
      if jetstream:
        padded, n = self.pad(prompt)
        state = self.insert(
          self.prefill(params=params, padded_tokens=padded, true_length=n), state, 0
        )
    if extend:  # the no-prefill admission of a continuing turn, then every suffix prefill
      state = self.activate_slot(state, 0, 1, 1, sampling=SamplingParams())
      for sb in self.cfg.extend_buckets:
        for window in self.windows:
          if window < sb and not self.paged:  # a paged suffix's padding may pass its window
            continue
          for mode in modes:
            sp = SamplingParams(temperature=0.0 if mode == "greedy" else 1.0)
            state, *_ = self.extend_slot(
              params, state, 0, [1], max(window - sb, 0), sampling=sp, bucket=sb, window=window
            )
            for k in self.cfg.suffix_chunks:
              if k > 1:
                state, *_ = self.extend_slots(
                  params, state, list(range(k)), [[1]] * k, [max(window - sb, 0)] * k,
                  samplings=[sp] * k, seeds=list(range(k)), bucket=sb, window=window,
                )  # fmt: skip
    for window in self.windows:
      for mode in modes:
        for size in self.cfg.row_buckets:
          live = range(size) if size < self.cfg.max_slots else None
          state, result = self.generate(params, state, max_length=window, mode=mode, live=live)
          if self.cfg.decode_steps_per_call > 1:
            slots = list(live or range(size))
            state, *_ = self.generate_chunk(
              params, state, slots, [1] * size, [()] * size, max_length=window, mode=mode
            )
    jax.block_until_ready(result.data)
    return time.perf_counter() - t0

  def _run(self, step: Callable, *args, **kwargs):
    """Every jitted step the engine dispatches goes through here: the one place an ahead-of-time
    engine (engine_aot.py) compiles a program instead of running it, so that a rehearsal compiles
    exactly the programs `warmup` and serving dispatch, with their arguments."""
    return step(*args, **kwargs)

  # --- JetStream Engine API -------------------------------------------------------------------

  def load_params(self, *args, **kwargs) -> VersionedParams:
    return self._initial

  def versioned(self, params: nnx.State, version: int) -> VersionedParams:
    """`params` placed into the engine's shardings, with their version. Weights arrive in any
    layout (host arrays from a weights store, a learner's fsdp shards, one device): each leaf
    moves to where the engine computes with it, and leaves already there stay (no copy)."""
    state = jax.device_put(params, self.param_shardings)
    return VersionedParams(
      state=state, version=jax.device_put(jnp.int32(version), self._replicated)
    )

  @property
  def _replicated(self) -> jax.sharding.NamedSharding:
    return replicated(self._mesh)

  @property
  def paged(self) -> bool:
    return self.cfg.kv_layout == "paged"

  def set_page_table(self, decode_state: DecodeState, table: np.ndarray) -> DecodeState:
    """The decode state with the host's page table ([slots, pages_per_seq] int32; pages.py):
    the pages every later call reads and writes. Calls dispatched earlier keep the old one."""
    table = jax.device_put(np.asarray(table, np.int32), self._replicated)
    return decode_state.replace(cache=decode_state.cache.replace(page_table=table))

  @property
  def windows(self) -> tuple[int, ...]:
    """The attended lengths decode and suffix steps are compiled for: every bucket, or only
    max_seq_len where attention reads each sequence over its own length (ragged paged), which
    a window would not change: one program where there were one per bucket (a 7B replica's
    warm-up, 145 programs -> 62)."""
    return (self.cfg.max_seq_len,) if self._window_free else self.cfg.buckets

  def window_for(self, length: int) -> int:
    """The window a step attending `length` positions runs over (see `windows`)."""
    return self.cfg.max_seq_len if self._window_free else self.bucket_for(length)

  @functools.cached_property
  def _window_free(self) -> bool:
    return self.paged and self.paged_attention in ("ragged", "ragged_reference")

  def prefill_chunks(self, bucket: int, chunks: Sequence[int]) -> tuple[int, ...]:
    """The sizes of `chunks` a whole-prompt prefill of `bucket` may admit at once (see
    `EngineConfig.prefill_tokens_per_call`), in their order; 1 always."""
    cap = self.cfg.prefill_tokens_per_call
    return tuple(k for k in chunks if k == 1 or not cap or k * bucket <= cap)

  def bucket_for(self, length: int) -> int:
    buckets = self.cfg.buckets
    i = bisect.bisect_left(buckets, length)
    if i == len(buckets):
      raise ValueError(f"prompt of {length} tokens exceeds max_seq_len={self.cfg.max_seq_len}")
    return buckets[i]

  def pad(self, tokens: Sequence[int]) -> tuple[np.ndarray, int]:
    """Right-pads tokens to their bucket: ([1, bucket] int32, true length)."""
    n = len(tokens)
    if n == 0:
      raise ValueError("cannot prefill an empty prompt")
    # Pad with id 0: padded positions are never attended to, but their keys/values are computed,
    # and an id outside a small model's vocabulary would embed as NaN (0 * NaN = NaN in AV).
    padded = np.zeros((1, self.bucket_for(n)), np.int32)
    padded[0, :n] = tokens
    return padded, n

  def prefill(
    self,
    *,
    params: VersionedParams,
    existing_prefix: Prefix | None = None,
    padded_tokens: jax.Array,
    true_length: int,
    sampling: SamplingParams | None = None,
    seed: int = 0,
  ) -> Prefix:
    if existing_prefix is not None:
      raise NotImplementedError("prefill on top of an existing prefix is not supported")
    sampling = sampling or SamplingParams(temperature=0.0)
    tokens = jnp.asarray(padded_tokens, jnp.int32).reshape(1, -1)
    return self._run(
      steps.PREFILL,
      self._graphdef,
      "truncate",
      params,
      tokens,
      jnp.asarray(true_length, jnp.int32),
      jax.random.PRNGKey(seed),
      jnp.asarray(sampling.temperature, jnp.float32),
      jnp.asarray(sampling.top_p, jnp.float32),
      jnp.asarray(sampling.top_k, jnp.int32),
    )

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
    return self._run(steps.INSERT, prefix, decode_state, jnp.asarray(slot, jnp.int32))

  def prefill_many(
    self,
    *,
    params: VersionedParams,
    prompts: Sequence[Sequence[int]],
    samplings: Sequence[SamplingParams],
    seeds: Sequence[int],
  ) -> Prefix:
    """Prefills several requests of the same bucket in one call (not part of JetStream's API;
    the RL driver admits bursts of agent turns this way). Returns a Prefix whose leaves have a
    leading request axis; insert it with `insert_many`. Its top_ids/top_logprobs hold
    `steps.TOP_N` alternatives per request when any sampling asks for top logprobs."""
    rows = [self.pad(p) for p in prompts]
    buckets = {r[0].shape[1] for r in rows}
    if len(buckets) != 1:
      raise ValueError(f"prefill_many needs prompts of one bucket, got buckets {sorted(buckets)}")
    tokens = np.stack([r[0] for r in rows])  # [k, 1, bucket]
    return self._run(
      steps.PREFILL_MANY,
      self._graphdef,
      mode_for(samplings),
      params,
      jnp.asarray(tokens),
      jnp.asarray([r[1] for r in rows], jnp.int32),
      jnp.stack([jax.random.PRNGKey(s) for s in seeds]),
      jnp.asarray([s.temperature for s in samplings], jnp.float32),
      jnp.asarray([s.top_p for s in samplings], jnp.float32),
      jnp.asarray([s.top_k for s in samplings], jnp.int32),
      top_n=steps.TOP_N if any(s.top_logprobs for s in samplings) else 0,
    )

  def insert_many(
    self, prefixes: Prefix, decode_state: DecodeState, slots: Sequence[int]
  ) -> DecodeState:
    return self._run(steps.INSERT_MANY, prefixes, decode_state, jnp.asarray(slots, jnp.int32))

  def generate(
    self,
    params: VersionedParams,
    decode_state: DecodeState,
    *,
    max_length: int | None = None,
    mode: SamplingMode = "truncate",
    live: Sequence[int] | None = None,
    top_n: int = 0,
  ) -> tuple[DecodeState, engine_api.ResultTokens]:
    """One token for every slot. max_length: an upper bound on every live slot's length after
    this step (the driver knows it); the step then attends over the smallest window that holds
    it. mode: the sampling path every live slot can use (`sampling.mode_for`). live: the slots
    that decode (the caller's word; every other slot must be inactive or its token unwanted):
    when they fit a `decode_rows` size, only that many slots are computed. The defaults
    (JetStream's orchestrator) attend over the whole cache with the general sampler. top_n: also
    report that many top alternatives per slot (`steps.result_top`); 0 (RL) computes none."""
    window = self.cfg.max_seq_len if max_length is None else self.window_for(max_length)
    size = self.rows_for(len(live)) if live is not None else self.cfg.max_slots
    if size == self.cfg.max_slots:
      return self._run(
        steps.GENERATE, self._graphdef, window, mode, params, decode_state, top_n=top_n
      )
    rows, mask = self._row_plan(live, size)
    return self._run(
      steps.GENERATE_ROWS,
      self._graphdef,
      window,
      mode,
      params,
      decode_state,
      rows,
      mask,
      top_n=top_n,
    )

  def generate_chunk(
    self,
    params: VersionedParams,
    decode_state: DecodeState,
    live: Sequence[int],
    budgets: Sequence[int],
    stop_ids: Sequence[Collection[int]],
    *,
    max_length: int,
    mode: SamplingMode = "truncate",
    top_n: int = 0,
  ) -> tuple[DecodeState, jax.Array, np.ndarray]:
    """Up to max(budgets) (at most `decode_steps_per_call`) tokens for each slot in `live`, in
    one call: slot live[i] emits at most budgets[i] tokens and stops after any of stop_ids[i].
    max_length: an upper bound on every live slot's length after its last step. Returns (state,
    the per-step result [steps, R, columns] on device (`steps.DECODE_CHUNK`), the slot of each
    of its R rows): tokens up to a row's first invalid one are that slot's, in order."""
    k = self.cfg.decode_steps_per_call
    n = min(k, max(budgets, default=0))
    if n < 1 or len(budgets) != len(live) or len(stop_ids) != len(live):
      raise ValueError(f"bad decode chunk: {len(live)} slots, budgets {list(budgets)}")
    size = self.rows_for(len(live))
    if size == self.cfg.max_slots:  # every slot, in order: the step needs no gather
      rows, mask = np.arange(size, dtype=np.int32), np.isin(np.arange(size), list(live))
    else:
      rows, mask = self._row_plan(live, size)
    budget = dict(zip((int(s) for s in live), budgets, strict=True))
    # Stop-id table width: a power of two (>= 4), so compiles stay few whatever the requests ask.
    width = max(4, 1 << (max((len(s) for s in stop_ids), default=0) - 1).bit_length())
    table = np.full((size, width), -1, np.int32)
    stops = dict(zip((int(s) for s in live), stop_ids, strict=True))
    for i, slot in enumerate(rows.tolist()):
      table[i, : len(stops.get(slot, ()))] = sorted(stops.get(slot, ()))
    plan = steps.ChunkPlan(
      rows=jnp.asarray(rows),
      live=jnp.asarray(mask),
      budget=jnp.asarray([budget.get(s, 0) for s in rows.tolist()], jnp.int32),
      stop_ids=jnp.asarray(table),
      steps=jnp.asarray(n, jnp.int32),
    )
    window = self.window_for(max_length)
    state, out = self._run(
      steps.DECODE_CHUNK,
      self._graphdef,
      window,
      mode,
      k,
      params,
      decode_state,
      plan,
      top_n=top_n,
      loop=self.cfg.decode_loop,
    )
    return state, out, rows

  def rows_for(self, n_live: int) -> int:
    """The decode-step size for n_live live slots."""
    return next(r for r in self.cfg.row_buckets if r >= n_live or r == self.cfg.max_slots)

  def _row_plan(self, live: Sequence[int], size: int) -> tuple[np.ndarray, np.ndarray]:
    """The live slots, padded to `size` with other (distinct) slots that only ride along."""
    chosen = sorted(set(int(s) for s in live))
    if len(chosen) > size or (chosen and not 0 <= chosen[0] <= chosen[-1] < self.cfg.max_slots):
      raise ValueError(f"bad live slots {list(live)} for a {size}-row step")
    taken = set(chosen)
    pad = [s for s in range(self.cfg.max_slots) if s not in taken][: size - len(chosen)]
    rows = np.asarray(chosen + pad, np.int32)
    return rows, np.arange(size) < len(chosen)

  def extend_plan(self, cached: int, prompt_len: int) -> tuple[int, int, int]:
    """How to admit a prompt of prompt_len tokens whose first `cached` tokens have valid keys and
    values in a slot: (start, suffix bucket, window). start <= cached and start < prompt_len (at
    least one token is fed, for the first token's logits); start + bucket <= window <= max_seq_len
    (start moves back, recomputing cached positions, where the padded suffix would overflow)."""
    start = min(cached, prompt_len - 1)
    buckets = self.cfg.extend_buckets
    sb = buckets[bisect.bisect_left(buckets, prompt_len - start)]
    if self.paged:  # padding writes nowhere: start stays, the window holds the real tokens
      return start, sb, self.window_for(prompt_len)
    start = min(start, self.cfg.max_seq_len - sb)
    return start, sb, self.bucket_for(start + sb)

  def _check_suffix(self, start: int, n: int, bucket: int, window: int) -> None:
    """A suffix of n tokens at `start` must fit its bucket, and the bucket its window and cache
    (paged: the real tokens must fit the window; padding writes nowhere)."""
    end = start + (n if self.paged else bucket)
    if n < 1 or n > bucket or end > window or window > self.cfg.max_seq_len:
      raise ValueError(f"bad suffix prefill: start={start} n={n} bucket={bucket} window={window}")

  def extend_slot(
    self,
    params: VersionedParams,
    decode_state: DecodeState,
    slot: int,
    suffix: Sequence[int],
    start: int,
    *,
    sampling: SamplingParams,
    seed: int = 0,
    bucket: int | None = None,
    window: int | None = None,
    write: bool = True,
  ) -> tuple[DecodeState, jax.Array, jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
    """Prefills `suffix` into `slot` at offset `start` on top of the keys/values already there
    (positions < start) and activates the slot, like insert(prefill(prefix + suffix)) but paying
    only for the suffix. Returns (state, first token, its logprob, version, (top alternative ids,
    their logprobs): `steps.TOP_N` of them when sampling asks for top logprobs) on device.
    write=False (paged): the suffix's keys/values are cached already, in pages other slots may
    share; they are attended, not written."""
    n = len(suffix)
    if bucket is None:
      _, bucket, window = self.extend_plan(start, start + n)
    self._check_suffix(start, n, bucket, window)
    if self.paged:
      state, tok, lp, version, top = self.extend_slots(
        params, decode_state, [slot], [suffix], [start], samplings=[sampling], seeds=[seed],
        bucket=bucket, window=window, writes=[write],
      )  # fmt: skip
      return state, tok[0], lp[0], version, (top[0][0], top[1][0])
    padded = np.zeros((1, bucket), np.int32)
    padded[0, :n] = suffix
    key = jax.random.PRNGKey(seed)
    temperature = jnp.asarray(sampling.temperature, jnp.float32)
    top_p = jnp.asarray(sampling.top_p, jnp.float32)
    top_k = jnp.asarray(sampling.top_k, jnp.int32)
    slot_ = jnp.asarray(slot, jnp.int32)
    row, tok, lp, version, top = self._run(
      steps.EXTEND_ROW,
      self._graphdef,
      window,
      mode_for([sampling]),
      params,
      decode_state.cache,
      slot_,
      jnp.asarray(padded),
      jnp.asarray(start, jnp.int32),
      jnp.asarray(n, jnp.int32),
      steps.RowSampling(key, temperature, top_p, top_k),
      top_n=steps.TOP_N if sampling.top_logprobs else 0,
    )
    state = self._run(
      steps.PUT_ROW,
      decode_state, row, slot_, jnp.asarray(start + n, jnp.int32), tok, key, temperature, top_p,
      top_k,
    )  # fmt: skip
    return state, tok, lp, version, top

  def extend_slots(
    self,
    params: VersionedParams,
    decode_state: DecodeState,
    slots: Sequence[int],
    suffixes: Sequence[Sequence[int]],
    starts: Sequence[int],
    *,
    samplings: Sequence[SamplingParams],
    seeds: Sequence[int],
    bucket: int,
    window: int,
    writes: Sequence[bool] | None = None,
  ) -> tuple[DecodeState, jax.Array, jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
    """`extend_slot` for several distinct slots in one call, every suffix padded to one `bucket`
    and attending over one `window` (at least each row's start + bucket). Returns (state, first
    tokens [k], their logprobs [k], version, (top ids [k, n], their logprobs [k, n])) on device;
    row i is exactly what `extend_slot` gives slots[i] alone (same keys, positions and mode).
    writes: per slot, `extend_slot`'s write (paged; default all True)."""
    k = len(slots)
    if not k == len(suffixes) == len(starts) == len(samplings) == len(seeds) or len(set(slots)) < k:
      raise ValueError(f"bad batched suffix prefill: slots {list(slots)}, {len(suffixes)} suffixes")
    padded = np.zeros((k, bucket), np.int32)
    for i, (suffix, start) in enumerate(zip(suffixes, starts, strict=True)):
      n = len(suffix)
      self._check_suffix(start, n, bucket, window)
      padded[i, :n] = suffix
    samp = steps.RowSampling(
      jnp.stack([jax.random.PRNGKey(s) for s in seeds]),
      jnp.asarray([s.temperature for s in samplings], jnp.float32),
      jnp.asarray([s.top_p for s in samplings], jnp.float32),
      jnp.asarray([s.top_k for s in samplings], jnp.int32),
    )
    slots_ = jnp.asarray(slots, jnp.int32)
    starts_ = np.asarray(starts, np.int32)
    lengths = np.asarray([len(x) for x in suffixes], np.int32)
    top_n = steps.TOP_N if any(s.top_logprobs for s in samplings) else 0
    if self.paged:
      write_lengths = lengths * np.asarray(writes or [True] * k, np.int32)
      return self._run(
        steps.EXTEND_PAGED,
        self._graphdef, window, mode_for(samplings), params, decode_state, slots_,
        jnp.asarray(padded), jnp.asarray(starts_), jnp.asarray(lengths),
        jnp.asarray(write_lengths), samp, top_n=top_n,
      )  # fmt: skip
    rows, tok, lp, version, top = self._run(
      steps.EXTEND_ROWS,
      self._graphdef, window, mode_for(samplings), params, decode_state.cache, slots_,
      jnp.asarray(padded), jnp.asarray(starts_), jnp.asarray(lengths), samp,
      top_n=steps.TOP_N if any(s.top_logprobs for s in samplings) else 0,
    )  # fmt: skip
    state = self._run(
      steps.PUT_ROWS, decode_state, rows, slots_, jnp.asarray(starts_ + lengths), tok, samp
    )
    return state, tok, lp, version, top

  def activate_slot(
    self,
    decode_state: DecodeState,
    slot: int,
    token: int,
    length: int,
    *,
    sampling: SamplingParams,
    seed: int = 0,
  ) -> DecodeState:
    """Makes a slot whose cache holds `length` valid positions live with `token` to feed next, no
    prefill: the next decode step feeds it at position `length` and samples the first new token
    from it with the key and position a suffix prefill of that one token would use. For a turn
    that continues the slot's last call with nothing new (its prompt is the cached tokens plus
    the token that call sampled last)."""
    if not 0 <= length < self.cfg.max_seq_len or not 0 <= slot < self.cfg.max_slots:
      raise ValueError(f"bad activation: slot={slot} length={length}")
    return self._run(
      steps.ACTIVATE,
      decode_state, jnp.asarray(slot, jnp.int32), jnp.asarray(length, jnp.int32),
      jnp.asarray(token, jnp.int32), jax.random.PRNGKey(seed),
      jnp.asarray(sampling.temperature, jnp.float32), jnp.asarray(sampling.top_p, jnp.float32),
      jnp.asarray(sampling.top_k, jnp.int32),
    )  # fmt: skip

  def release(self, decode_state: DecodeState, slot: int) -> DecodeState:
    """Marks a slot inactive: decode steps stop advancing it and never write inside its cached
    prefix (the driver parks finished requests' slots this way for prefix reuse)."""
    return self._run(steps.RELEASE, decode_state, jnp.asarray(slot, jnp.int32))

  def get_prefix_destination_sharding(self) -> Prefix:
    """Where a prefix lands on this engine (JetStream's disaggregated prefill -> generate
    transfer): its cache split like the decode state's, the scalars replicated."""
    shape = (1, 1, self.model_cfg.num_kv_heads, self.model_cfg.resolved_head_dim)
    kv = cache_sharding(self._mesh, self._rules, shape)
    n = self.model_cfg.num_layers
    rep = self._replicated
    return Prefix(cache=KVCache(k=(kv,) * n, v=(kv,) * n), true_length=rep, next_token=rep,
                  next_logprob=rep, version=rep, key=rep, temperature=rep, top_p=rep,
                  top_k=rep, top_ids=rep, top_logprobs=rep)  # fmt: skip

  def init_decode_state(self, *args, **kwargs) -> DecodeState:
    """An empty decode state, created in place on the mesh: the KV cache (or page pools) split
    by KV heads (no full copy on one device first), the per-slot arrays (and a page table that
    maps nothing) replicated."""
    make, shardings = decode_state_program(self.model_cfg, self.cfg, self._mesh)
    return jax.jit(make, out_shardings=shardings)()

  @property
  def kv_heads_per_chip(self) -> int:
    """KV heads each device of the engine's mesh keeps in its cache (or page pools): what
    tensor parallelism saves the cache, read from the shardings, nothing allocated."""
    make, shardings = decode_state_program(self.model_cfg, self.cfg, self._mesh)
    cache, where = jax.eval_shape(make).cache, shardings.cache
    pool, sharding = (cache.kv[0], where.kv[0]) if self.paged else (cache.k[0], where.k[0])
    heads = sharding.shard_shape(pool.shape)[2]
    return heads // 2 if self.paged else heads  # a page pool holds keys and values side by side

  @property
  def paged_attention(self) -> str:
    """How this engine's paged attention reads its pages ("auto" resolved for its devices)."""
    return pages_layout(self.model_cfg, self.cfg, self._mesh).attention


def pages_layout(
  model_cfg: ModelConfig, cfg: EngineConfig, mesh: jax.sharding.Mesh
) -> _PagesLayout:
  """How an engine of `cfg` on `mesh` lays out and reads its page pools: "auto" attention
  resolved for the mesh's devices, KV heads repeated to the chips, and the mesh the ragged
  kernel runs per chip on where the pools' heads are split."""
  t = mesh.shape["tensor"]
  attention = cfg.paged_attention
  if attention == "auto":
    attention = "ragged" if mesh.devices.flat[0].platform == "tpu" else "gather"
  split = t > 1 and engine_rules(model_cfg, t)[CACHE_HEADS] == "tensor"
  return _PagesLayout(
    attention=attention, repeat=ragged_paged.kv_repeat(model_cfg, t), mesh=mesh if split else None
  )


def decode_state_program(
  model_cfg: ModelConfig, cfg: EngineConfig, mesh: jax.sharding.Mesh
) -> tuple[Callable[[], DecodeState], DecodeState]:
  """(make, shardings): the function that builds an empty decode state and where each of its
  arrays lives on `mesh` -- the KV cache (or page pools) split by KV heads, the per-slot arrays
  (and the page table) replicated. `Engine.init_decode_state` runs it; the ahead-of-time
  compile of the engine's steps (rl/aot.py) takes its shapes."""
  rules = engine_rules(model_cfg, mesh.shape["tensor"])
  make = functools.partial(_empty_state, model_cfg, cfg, pages_layout(model_cfg, cfg, mesh))
  abstract = jax.eval_shape(make)
  shardings = jax.tree.map(lambda _: replicated(mesh), abstract)
  if cfg.kv_layout == "paged":
    kv = cache_sharding(mesh, rules, abstract.cache.kv[0].shape)
    cache = shardings.cache.replace(kv=(kv,) * len(abstract.cache.kv))
  else:
    kv = cache_sharding(mesh, rules, abstract.cache.k[0].shape)
    cache = shardings.cache.replace(
      k=(kv,) * len(abstract.cache.k), v=(kv,) * len(abstract.cache.v)
    )
  return make, shardings.replace(cache=cache)


class _PagesLayout(NamedTuple):
  """How an engine's page pools are laid out and read (see EngineConfig.paged_attention)."""

  attention: str  # kv_cache.PAGED_ATTENTION
  repeat: int  # copies of each KV head the pools hold (ragged_paged.kv_repeat)
  mesh: jax.sharding.Mesh | None  # the mesh that splits the pools' heads, if any


def _empty_state(model_cfg: ModelConfig, cfg: EngineConfig, pages: _PagesLayout) -> DecodeState:
  s = cfg.max_slots
  if cfg.kv_layout == "paged":
    cache = PagedKVCache.init(
      model_cfg, slots=s, num_pages=cfg.pool_pages, page_size=cfg.page_size,
      pages_per_seq=cfg.pages_per_seq, repeat=pages.repeat, attention=pages.attention,
      mesh=pages.mesh,
    )  # fmt: skip
  else:
    cache = KVCache.init(model_cfg, batch=s, max_len=cfg.max_seq_len)
  return DecodeState(
    cache=cache,
    lengths=jnp.zeros((s,), jnp.int32),
    next_tokens=jnp.zeros((s,), jnp.int32),
    keys=jnp.zeros((s, 2), jnp.uint32),
    temperature=jnp.zeros((s,), jnp.float32),
    top_p=jnp.ones((s,), jnp.float32),
    top_k=jnp.zeros((s,), jnp.int32),
    active=jnp.zeros((s,), bool),
  )
