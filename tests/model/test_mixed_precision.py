"""Mixed precision: a pure-bf16 update at an RL learning rate rounds away, fp32 master weights keep it.

Both paths take one AdamW step from the same bf16 checkpoint values on the same batch, and both are
checked against the same step in float64 numpy (from the same gradients): the fp32 master matches
it to float32 rounding, the pure-bf16 result is that reference rounded to bf16, which for
lr = 1e-6 is the old weight: the update is lost (the bug every bf16 checkpoint had).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asearcher_jax.model import steps, transformer
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.rl.learner import Learner, PPOConfig

LR = 1e-6
OPT = steps.OptimizerConfig(learning_rate=LR, weight_decay=0.0, grad_clip=None)


def _cfg(param_dtype: str, dtype: str = "bfloat16") -> ModelConfig:
  return ModelConfig(
    vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
    num_kv_heads=2, rope_theta=10000.0, param_dtype=param_dtype, dtype=dtype,
  )  # fmt: skip


def _batch(vocab: int) -> dict:
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, vocab, (2, 16))
  return {
    "tokens": jnp.asarray(tokens, jnp.int32),
    "positions": jnp.asarray(np.tile(np.arange(16), (2, 1)), jnp.int32),
    "segment_ids": jnp.ones((2, 16), jnp.int32),
    "loss_mask": jnp.ones((2, 16), jnp.float32),
  }


def _flat(state) -> dict:
  return {k: np.asarray(v.get_value() if hasattr(v, "get_value") else v)
          for k, v in nnx.to_flat_state(state)}  # fmt: skip


def _one_step(params, graphdef, batch):
  opt = steps.make_optimizer(OPT)
  state = steps.init_train_state(params, opt)
  step = jax.jit(lambda s, b: steps.train_step(graphdef, opt, steps.nll_loss, s, b))
  new, _ = step(state, batch)
  return new.params


def _adam_step_float64(p: np.ndarray, g: np.ndarray) -> np.ndarray:
  """optax.adamw's first step in float64: m_hat = g, v_hat = g^2."""
  g = g.astype(np.float64)
  return p.astype(np.float64) - LR * g / (np.sqrt(g * g) + OPT.eps)


@pytest.mark.slow
def test_bf16_update_rounds_away_and_fp32_master_weights_keep_it():
  # Storage is what differs (bf16 vs fp32 master); the forward runs in float32 here so that the
  # reference's gradient equals the step's own to float32 rounding (bf16 compute would add
  # gradient noise that Adam's normalised first step amplifies, unrelated to storage).
  model = transformer.Transformer(_cfg("bfloat16", dtype="float32"), rngs=nnx.Rngs(0))
  graphdef, params_bf16 = nnx.split(model)
  batch = _batch(97)
  master = steps.cast_floating(params_bf16, "float32")  # the same values, fp32 storage
  grads = jax.jit(jax.grad(lambda p: steps.nll_loss(graphdef, p, batch)[0]))(master)

  pure = _flat(_one_step(params_bf16, graphdef, batch))
  mixed = _flat(_one_step(master, graphdef, batch))
  before, g = _flat(params_bf16), _flat(grads)

  moved_pure = moved_mixed = total = total_live = checked = 0
  for k, p0 in before.items():
    ref = _adam_step_float64(p0, g[k])
    assert pure[k].dtype == jnp.bfloat16 and mixed[k].dtype == np.float32
    # Where |g| is small, Adam's normalised step g / (|g| + eps) follows rounding noise in g
    # itself (the step's gradient is computed inside its own jit, and XLA:CPU's reduction order
    # differs between machines): there only the step's size is checked, for both storages.
    firm = np.abs(g[k]) > 1e-4
    # Pure bf16 is the reference rounded to bf16 (within one bf16 spacing).
    spacing = np.maximum(np.abs(p0.astype(np.float64)), np.abs(ref)) * 2.0**-7
    assert np.all((np.abs(pure[k].astype(np.float64) - ref) <= spacing)[firm]), k
    pure_step = np.abs(pure[k].astype(np.float64) - p0.astype(np.float64))
    assert np.all(pure_step <= LR * 1.01 + np.abs(p0.astype(np.float64)) * 2.0**-7), k
    # fp32 master weights match the float64 step to float32 rounding (where |g| is firm).
    # Tolerance: one float32 spacing of the weight, plus 2e-5 of the step for optax's float32
    # bias correction (1 - 0.999 in float32 is 1.3e-5 off).
    tol = np.abs(ref) * 2.0**-23 + 2e-5 * LR
    assert np.all(np.abs(mixed[k].astype(np.float64) - ref)[firm] <= tol[firm]), k
    checked += int(firm.sum())
    step = np.abs(mixed[k].astype(np.float64) - p0.astype(np.float64))
    assert np.all(step <= LR * 1.01 + np.abs(p0.astype(np.float64)) * 2.0**-23), k
    if p0.ndim >= 2:  # the weight matrices (biases start at 0, where bf16 resolves 1e-6)
      # Where half a bf16 spacing exceeds the step (|w| > 512 lr), the update must vanish.
      big = np.abs(p0.astype(np.float64)) > 512 * LR
      assert np.array_equal(pure[k][big], p0[big]), k
      moved_pure += int(np.sum(pure[k] != p0))
      live = g[k] != 0  # embedding rows of tokens the batch lacks get no gradient
      moved_mixed += int(np.sum((mixed[k] != p0.astype(np.float32)) & live))
      total += p0.size
      total_live += int(live.sum())
  assert checked > 0.5 * sum(p.size for p in before.values()), checked
  assert moved_pure < 0.03 * total, f"{moved_pure} of {total} bf16 weights moved at lr {LR}"
  assert moved_mixed == total_live, f"{moved_mixed} of {total_live} master weights moved"


def test_learner_keeps_fp32_masters_and_gives_the_engine_bf16():
  graphdef, params = nnx.split(transformer.Transformer(_cfg("bfloat16"), rngs=nnx.Rngs(0)))
  learner = Learner(graphdef, params, ppo=PPOConfig(row_len=16), optimizer=OPT)
  dtypes = {leaf.dtype for leaf in jax.tree.leaves(learner.state.params)}
  assert dtypes == {jnp.dtype("float32")}
  moments = [x for x in jax.tree.leaves(learner.state.opt_state) if x.ndim >= 1]
  assert moments and all(x.dtype == jnp.float32 for x in moments)
  served = learner.params_copy()
  assert {leaf.dtype for leaf in jax.tree.leaves(served)} == {jnp.dtype("bfloat16")}
  # Pure bf16 is still selectable (master_dtype=None), e.g. to reproduce the old behaviour.
  old = Learner(
    graphdef, params, ppo=PPOConfig(row_len=16), optimizer=OPT,
    precision=steps.PrecisionConfig(master_dtype=None),
  )  # fmt: skip
  assert {leaf.dtype for leaf in jax.tree.leaves(old.state.params)} == {jnp.dtype("bfloat16")}
