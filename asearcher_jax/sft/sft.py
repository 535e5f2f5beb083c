"""Supervised fine-tuning of a policy on expert trajectories: the loss, and the training loop.

The loss is the mean NLL of the generated tokens only (loss_mask = 1), computed on packed rows;
the step is `model.steps.train_step` (AdamW, clipping, schedule, donated state, explicit mesh
shardings), so SFT and RL share one optimizer path. `SFTTrainer` is a thin orchestrator with
named phases: restore -> (batch -> step -> log -> eval -> checkpoint)* -> final eval. The data
plan of step k is a pure function of k (see `sft.data`), so resuming from a checkpoint
continues with exactly the batches an uninterrupted run would have seen.

Precision and processes work as in the RL learner (`rl.learner.Learner`): parameters and Adam's
moments are kept in `PrecisionConfig.master_dtype` (fp32: a bf16 checkpoint's small updates do
not round away) while the forward runs in the model config's dtype, and the export goes back to
the dtype each parameter was loaded in. In a multi-process program (`jax.distributed`) every
process builds the same data plan, so each step's global batch is known everywhere and each
process places only the rows its own devices hold (`sharding.put`); Orbax writes every
process's shards, and only process 0 writes metrics and the HF export.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from asearcher_jax import distributed
from asearcher_jax.checkpoint import CheckpointConfig, Checkpointer, abstract_like
from asearcher_jax.metric_writer import MetricWriter
from asearcher_jax.model import sharding as sharding_lib
from asearcher_jax.model import steps
from asearcher_jax.model.transformer import Transformer, score_and_correct
from asearcher_jax.sft import data as data_lib

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
  """Attributes:
  steps: optimizer steps in total (a resumed run counts the restored ones).
  max_seconds: stop (checkpoint, eval, export) after this much training time in this process;
    None = no time budget.
  row_len: tokens per packed row; longer sequences are handled by `long_sequences`.
  rows_per_batch: rows per optimizer step (a multiple of the mesh's data x fsdp size).
  long_sequences: "truncate" keeps the first row_len tokens, "drop" skips the sequence.
  min_score: skip trajectories scored below this (None: train on every trajectory).
  eval_fraction: trajectories held out for the eval loss (whole trajectories).
  eval_every: evaluate every this many steps (0: only at the end).
  log_every: write train metrics every this many steps.
  checkpoint_every: Orbax checkpoint every this many steps (and always at the end).
  max_to_keep: newest checkpoints kept.
  seed: data shuffling and eval split seed (the init seed is the command's).
  progress: show a tqdm progress bar on stderr.
  """

  steps: int = 1000
  max_seconds: float | None = None
  row_len: int = 1024
  rows_per_batch: int = 8
  long_sequences: Literal["truncate", "drop"] = "truncate"
  min_score: float | None = None
  eval_fraction: float = 0.05
  eval_every: int = 100
  log_every: int = 10
  checkpoint_every: int = 200
  max_to_keep: int = 2
  seed: int = 0
  progress: bool = True

  def __post_init__(self):
    if self.steps < 0:
      raise ValueError(f"steps must be >= 0, got {self.steps}")
    if self.row_len < 2 or self.rows_per_batch < 1:
      raise ValueError(f"need row_len >= 2 and rows_per_batch >= 1, got {self}")
    if self.long_sequences not in ("truncate", "drop"):
      raise ValueError(f"long_sequences must be 'truncate' or 'drop', got {self.long_sequences!r}")
    if min(self.eval_every, self.checkpoint_every) < 0 or self.log_every < 1:
      raise ValueError("eval_every/checkpoint_every must be >= 0 and log_every >= 1")


def default_optimizer(total_steps: int) -> steps.OptimizerConfig:
  """AdamW for small from-scratch policies: 1e-3 peak, 5% warmup, cosine to 10%."""
  return steps.OptimizerConfig(
    learning_rate=1e-3, warmup_steps=max(total_steps // 20, 1), total_steps=max(total_steps, 2),
    end_lr_ratio=0.1, weight_decay=0.01, grad_clip=1.0,
  )  # fmt: skip


# --- pure functions ---------------------------------------------------------------------------


def masked_token_stats(
  graphdef: nnx.GraphDef, params: nnx.State, batch: steps.Batch
) -> dict[str, jax.Array]:
  """Sums over loss-masked tokens of a packed batch: nll, correct (greedy argmax == target),
  tokens. Alignment as in `transformer.score`: position t is predicted from t - 1 of the same
  segment, so a segment's first token and padding never count."""
  model: Transformer = nnx.merge(graphdef, params)
  tokens, seg = batch["tokens"], batch["segment_ids"]
  # Logits over chunks of positions (ModelConfig.logits_chunk), aligned with the tokens they
  # predict: a segment's first token and padding score 0 and are masked out here.
  lp, correct = score_and_correct(model, tokens, batch["positions"], seg)
  lp, correct = lp[:, 1:], correct[:, 1:]
  valid = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
  mask = jnp.where(valid, batch["loss_mask"][:, 1:].astype(jnp.float32), 0.0)
  return {"nll": -(lp * mask).sum(), "correct": (correct * mask).sum(), "tokens": mask.sum()}


def sft_loss(
  graphdef: nnx.GraphDef, params: nnx.State, batch: steps.Batch
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """steps.LossFn: mean NLL over loss-masked tokens (equals `steps.nll_loss` up to the
  denominator, which here counts only predictable tokens), with token accuracy as a metric."""
  s = masked_token_stats(graphdef, params, batch)
  n = jnp.maximum(s["tokens"], 1.0)
  loss = s["nll"] / n
  return loss, {"loss": loss, "accuracy": s["correct"] / n, "tokens": s["tokens"]}


def compile_eval_step(
  graphdef: nnx.GraphDef,
  params: nnx.State,
  *,
  mesh: Mesh | None = None,
  rules: Mapping = sharding_lib.DEFAULT_RULES,
):
  """Jitted (params, batch) -> masked_token_stats, batch sharded over data x fsdp."""
  fn = functools.partial(masked_token_stats, graphdef)
  if mesh is None:
    return jax.jit(fn)

  def sharded(p, b):
    with sharding_lib.activation_sharding(mesh, rules):
      return fn(p, b)

  replicated = NamedSharding(mesh, PartitionSpec())
  return jax.jit(
    sharded,
    in_shardings=(steps.shardings_of(params), sharding_lib.batch_sharding(mesh, rules=rules)),
    out_shardings=replicated,
  )


# --- the loop ---------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class SFTResult:
  """What a run did (the command turns it into the summary and the model card)."""

  start_step: int  # step restored from the checkpoint (0 for a fresh run)
  step: int  # last completed step
  train_seconds: float  # training time in this process
  train_tokens: int  # real (non-padding) tokens stepped over in this process
  history: list[dict[str, float]]  # logged train/eval metrics
  final: dict[str, float]  # last train loss/accuracy and the final eval loss/accuracy


class SFTTrainer:
  """Holds the donated TrainState, the compiled step/eval, the data plan, checkpointer, writer."""

  def __init__(
    self,
    graphdef: nnx.GraphDef,
    params: nnx.State,
    *,
    config: SFTConfig,
    train_seqs: Sequence[data_lib.Seq],
    eval_seqs: Sequence[data_lib.Seq] = (),
    optimizer: steps.OptimizerConfig | None = None,
    out_dir: str | Path,
    pad_id: int = 0,
    mesh: Mesh | None = None,
    rules: Mapping = sharding_lib.DEFAULT_RULES,
    meta: Mapping[str, object] | None = None,
    precision: steps.PrecisionConfig = steps.PrecisionConfig(),
  ) -> None:
    self.config = c = config
    self.graphdef = graphdef
    self.mesh = mesh
    self.out_dir = Path(out_dir)
    self.meta = dict(meta or {})
    shards = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
    if c.rows_per_batch % shards:
      raise ValueError(
        f"rows_per_batch={c.rows_per_batch} is not a multiple of the {shards} data shards"
      )
    self.plan = data_lib.EpochPlan(
      train_seqs, row_len=c.row_len, rows_per_batch=c.rows_per_batch, seed=c.seed, pad_id=pad_id
    )
    self.eval_data = data_lib.eval_batches(
      eval_seqs, row_len=c.row_len, rows_per_batch=c.rows_per_batch, pad_id=pad_id
    )
    opt = steps.make_optimizer(optimizer or default_optimizer(c.steps))
    # The export gets each parameter back in the dtype it was loaded in (see the docstring).
    self._export_dtypes = jax.tree.map(lambda x: x.dtype, params)
    params = steps.cast_floating(params, precision.master_dtype)
    if mesh is None and jax.process_count() > 1:
      raise ValueError("a multi-process SFT run needs a mesh over every process's devices")
    if mesh is not None:
      # The same values on every process (one init seed, one checkpoint); each process places
      # only the shards its devices hold.
      params = sharding_lib.put(params, sharding_lib.param_shardings(params, mesh, rules))
    self.state = steps.init_train_state(params, opt)
    self._batch_sharding = None if mesh is None else sharding_lib.batch_sharding(mesh, rules=rules)
    self._train = steps.compile_train_step(graphdef, opt, sft_loss, self.state, mesh=mesh,
                                           rules=rules)  # fmt: skip
    self._eval = compile_eval_step(graphdef, params, mesh=mesh, rules=rules)
    self.checkpointer = Checkpointer(
      CheckpointConfig(directory=str(self.out_dir / "checkpoints"), max_to_keep=c.max_to_keep)
    )
    self.writer = MetricWriter(self.out_dir / "metrics")
    self._saved_step: int | None = None

  # --- phases ---------------------------------------------------------------------------------

  def restore(self) -> int:
    """Restores the latest checkpoint in out_dir; returns its step (0 when there is none)."""
    step = self.checkpointer.latest_step()
    if step is None:
      return 0
    _, items = self.checkpointer.restore(
      {"train_state": abstract_like(self.state), "meta": None}, step
    )
    self.state = items["train_state"]
    self._saved_step = int(step)
    old = items["meta"].get("data_sha256")
    if old is not None and old != self.meta.get("data_sha256"):
      log.warning("resuming on different data than the checkpoint was trained on")
    log.info("resumed SFT at step %d", step)
    return int(step)

  def export_params(self) -> nnx.State:
    """The trained parameters in the dtypes the policy was loaded in (the master copy is fp32)."""
    return jax.tree.map(
      lambda x, d: x.astype(d) if x.dtype != d else x, self.state.params, self._export_dtypes
    )

  def to_device(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    host = {k: batch[k] for k in data_lib.BATCH_KEYS}
    if self._batch_sharding is None:
      return jax.device_put(host)
    # Every process built the same global batch; each takes only the rows its devices hold.
    return sharding_lib.put(host, self._batch_sharding)

  def evaluate(self) -> dict[str, float]:
    """Token-weighted NLL and greedy accuracy over every held-out generated token."""
    if not self.eval_data:
      return {}
    sums = [self._eval(self.state.params, self.to_device(b)) for b in self.eval_data]
    tot = {k: float(sum(np.asarray(s[k]) for s in jax.device_get(sums))) for k in sums[0]}
    n = max(tot["tokens"], 1.0)
    return {"eval/loss": tot["nll"] / n, "eval/accuracy": tot["correct"] / n,
            "eval/tokens": tot["tokens"]}  # fmt: skip

  def checkpoint(self, step: int) -> None:
    """Saves the train state at `step` (once: a time-budget stop may follow a periodic save)."""
    if step == self._saved_step:
      return
    self._saved_step = step
    meta = {"step": step, **{k: v for k, v in self.meta.items() if isinstance(v, (str, int))}}
    self.checkpointer.save(step, {"train_state": self.state, "meta": meta}, force=True)

  def train(self, *, until_step: int | None = None) -> SFTResult:
    """Runs restore -> steps -> final eval; `until_step` stops early (as an interruption would:
    only the periodic checkpoints are written)."""
    c = self.config
    start = step = self.restore()
    stop_at = c.steps if until_step is None else min(until_step, c.steps)
    history: list[dict[str, float]] = []
    pending: list[dict[str, jax.Array]] = []
    last: dict[str, float] = {}
    tokens = 0
    t0 = time.perf_counter()
    t_log, tok_log = t0, 0
    bar = tqdm(total=c.steps, initial=step, disable=not c.progress, desc="sft", unit="step",
               dynamic_ncols=True)  # fmt: skip
    try:
      while step < stop_at:
        # Several processes: process 0's clock decides for all (they must stop together).
        if c.max_seconds is not None and distributed.agree(
          time.perf_counter() - t0 > c.max_seconds
        ):
          log.info("time budget of %.0f s reached at step %d", c.max_seconds, step)
          break
        epoch, host = self.plan.batch(step)
        real = int((host["segment_ids"] > 0).sum())
        self.state, m = self._train(self.state, self.to_device(host))
        step += 1
        tokens += real
        tok_log += real
        pending.append(m)
        bar.update(1)
        if step % c.log_every == 0 or step == stop_at:
          jax.block_until_ready(m)  # dispatch is async: time the finished steps
          now = time.perf_counter()
          last = self._log_train(step, epoch, pending, tok_log / max(now - t_log, 1e-9))
          history.append(last)
          bar.set_postfix(loss=f"{last['sft/loss']:.3f}", acc=f"{last['sft/accuracy']:.3f}")
          pending, t_log, tok_log = [], now, 0
        if c.eval_every and step % c.eval_every == 0 and step < stop_at:
          history.append(self._log_eval(step))
        if c.checkpoint_every and step % c.checkpoint_every == 0 and step < c.steps:
          self.checkpoint(step)
      train_seconds = time.perf_counter() - t0
      if pending:
        last = self._log_train(step, step // self.plan.batches_per_epoch, pending, 0.0)
        history.append(last)
      finished = step >= c.steps or until_step is None
      if finished and step > start:
        self.checkpoint(step)
      final = {k: v for k, v in last.items() if k in ("sft/loss", "sft/accuracy")}
      if finished:
        ev = self._log_eval(step)
        history.append(ev)
        final.update({k: v for k, v in ev.items() if k != "step"})
    finally:
      bar.close()
      self.checkpointer.wait()
      self.writer.flush()
    return SFTResult(
      start_step=start, step=step, train_seconds=train_seconds, train_tokens=tokens,
      history=history, final=final,
    )  # fmt: skip

  def close(self) -> None:
    self.checkpointer.close()
    self.writer.close()

  # --- metrics ----------------------------------------------------------------------------------

  def _log_train(
    self, step: int, epoch: int, pending: Sequence[Mapping[str, jax.Array]], tokens_per_s: float
  ) -> dict[str, float]:
    ms = jax.device_get(list(pending))
    w = np.asarray([float(m["tokens"]) for m in ms])
    wsum = max(float(w.sum()), 1.0)
    out = {
      "step": float(step),
      "sft/loss": float(sum(float(m["loss"]) * x for m, x in zip(ms, w)) / wsum),
      "sft/accuracy": float(sum(float(m["accuracy"]) * x for m, x in zip(ms, w)) / wsum),
      "sft/grad_norm": float(np.mean([float(m["grad_norm"]) for m in ms])),
      "sft/loss_tokens": float(w.sum()),
      "sft/epoch": float(epoch),
    }
    if tokens_per_s:
      out["perf/tokens_per_s"] = tokens_per_s
    self.writer.write(step, {k: v for k, v in out.items() if k != "step"})
    return out

  def _log_eval(self, step: int) -> dict[str, float]:
    ev = self.evaluate()
    if ev:
      self.writer.write(step, ev)
      log.info("step %d: eval loss %.4f accuracy %.4f", step, ev["eval/loss"],
               ev["eval/accuracy"])  # fmt: skip
    return {"step": float(step), **ev}
