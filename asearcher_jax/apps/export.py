"""`asearcher export`: an RL run's policy, from any of its checkpoints, as a Hugging Face model
directory (config.json + safetensors + the run's tokenizer).

  asearcher export --gin_param='export.export.run_dir="runs/quickstart"' \
                   --gin_param='export.export.out_dir="runs/quickstart/hf"'
  python -m asearcher_jax.apps.export RUN_DIR OUT_DIR [--step N] [--dtype bfloat16]

Why: RL checkpoints are Orbax train states (parameters and optimizer state) that only a trainer
restores; the exported directory is what `asearcher eval`, `serve-model`, `sft`, `train`
(`model_dir`) and transformers' `from_pretrained` load, so a trained policy can be evaluated on
other questions, served, fine-tuned or shared. Only the parameters are read (not the optimizer
state), as numpy on the host, so a checkpoint written by a multi-process learner exports from one
process. The architecture comes from the run's `policy_config.json` (written when the run
starts); runs older than that file name the model directory they started from (`model_dir`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from asearcher_jax.apps.train import POLICY_CONFIG
from asearcher_jax.checkpoint import CheckpointConfig, Checkpointer
from asearcher_jax.errors import AsearcherError, CheckpointError, ConfigValueError
from asearcher_jax.model import hf_io
from asearcher_jax.model import steps as model_steps
from asearcher_jax.model.config import from_hf_config
from asearcher_jax.sft.export import copy_tokenizer

# Written beside the weights: which run, step and policy version they are.
EXPORTED_FROM = "exported_from.json"


def train_run_dir(run_dir: str | Path) -> Path:
  """The directory holding `checkpoints/`: `run_dir` itself (`asearcher train`) or its `rl/`
  (`asearcher quickstart`, `long-horizon`)."""
  run = Path(run_dir)
  for d in (run, run / "rl"):
    if (d / "checkpoints").is_dir():
      return d
  raise AsearcherError(f"no checkpoints/ in {str(run)!r} or {str(run / 'rl')!r}: not an RL run")


def policy_config(run: Path, model_dir: str | None) -> dict:
  """The policy's HF config: the run's own, else `model_dir`'s config.json."""
  if (run / POLICY_CONFIG).is_file():
    try:
      config = json.loads((run / POLICY_CONFIG).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise AsearcherError(f"{run / POLICY_CONFIG} is not a JSON config ({e})") from None
    if not isinstance(config, dict):
      raise AsearcherError(f"{run / POLICY_CONFIG} is not a JSON object")
    return config
  if model_dir is None:
    raise AsearcherError(
      f"{str(run)!r} has no {POLICY_CONFIG} (a run older than it): set export.model_dir to the "
      "model directory the run started from (its config.json gives the architecture)"
    )
  return hf_io.read_config(model_dir)


def export(
  *,
  run_dir: str = "runs/quickstart",
  out_dir: str | None = None,
  step: int | None = None,
  dtype: str | None = None,
  model_dir: str | None = None,
) -> int:
  """Writes the policy of one checkpoint as a Hugging Face model directory; returns 0.

  Args:
    run_dir: an RL run directory (`asearcher train`'s, or a quickstart / long-horizon run, whose
      `rl/` is used).
    out_dir: where the model directory goes (None: `<run>/export/step_<step>`).
    step: the checkpoint (policy version) to export; None: the newest.
    dtype: the weights' dtype on disk (None: the dtype the policy was loaded in).
    model_dir: the model directory the run started from, for runs without `policy_config.json`.
  """
  t0 = time.time()
  if dtype is not None:  # before anything is restored or written
    try:
      ok = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
      ok = False
    if not ok:
      raise ConfigValueError(f"dtype {dtype!r} is not a float dtype (e.g. 'bfloat16', 'float32')")
  run = train_run_dir(run_dir)
  if out_dir is not None:
    _check_out_dir(Path(out_dir))
  config = policy_config(run, model_dir)
  try:
    cfg = from_hf_config(config)
  except (KeyError, TypeError, ValueError) as e:
    where = run / POLICY_CONFIG if (run / POLICY_CONFIG).is_file() else Path(model_dir or "")
    raise AsearcherError(f"{where}: not a model config this version reads ({type(e).__name__}: "
                         f"{e})") from None  # fmt: skip
  tokenizer_dir = run / "tokenizer"
  if not (tokenizer_dir / "tokenizer.json").is_file():
    raise AsearcherError(f"no tokenizer in {str(tokenizer_dir)!r}: the run did not start")
  with Checkpointer(CheckpointConfig(directory=str(run / "checkpoints"), async_save=False)) as ck:
    steps = ck.all_steps()
    if not steps:
      raise AsearcherError(f"no complete checkpoint in {str(run / 'checkpoints')!r}")
    step = max(steps) if step is None else step
    if step not in steps:
      raise AsearcherError(f"no checkpoint for step {step} in {str(run)!r}; it has {steps}")
    try:
      # The learner checkpoints the form it trained in (stacked layers under scan_layers).
      stacked = "stacked_layers" in ck.part_keys("train_state", "params", step)
      graphdef, abstract = model_steps.abstract_params(cfg, stacked=stacked)
      params = ck.restore_part("train_state", "params", abstract, step)
      _, meta = ck.restore({"meta": None}, step)
    except CheckpointError as e:  # e.g. a config of another model: shapes differ
      raise AsearcherError(f"cannot export step {step} of {str(run)!r}: {e}") from e
  _check_shapes(abstract, params)
  params = model_steps.list_form(graphdef, params)
  graphdef, _ = model_steps.abstract_params(cfg)
  out = Path(out_dir) if out_dir else run / "export" / f"step_{step}"
  model = nnx.merge(graphdef, params)
  hf_io.save(model, out, dtype=dtype)
  if jax.process_index() == 0:
    copy_tokenizer(tokenizer_dir, out)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    record = {
      "run_dir": str(run.resolve()), "step": step, "version": meta["meta"].get("version", step),
      "dtype": dtype or cfg.param_dtype, "exported_at": when,
    }  # fmt: skip
    (out / EXPORTED_FROM).write_text(json.dumps(record, indent=2) + "\n")
  print(f"exported step {step} of {run} -> {out} ({time.time() - t0:.1f} s)", flush=True)
  return 0


def _check_out_dir(out: Path) -> None:
  """Writing replaces a directory's safetensors: only an empty one or an earlier export may be
  written over, never a model directory the user has (the run's warm start, say)."""
  blocker = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
  if blocker is not None:  # else the safetensors writer fails deep inside with an OS error
    raise ConfigValueError(
      f"{str(blocker)!r} is a file, so {str(out)!r} cannot be a model directory: choose another "
      "out_dir; nothing was written"
    )
  if out.is_dir() and any(out.iterdir()) and not (out / EXPORTED_FROM).is_file():
    raise ConfigValueError(
      f"{str(out)!r} exists and is not an earlier export (no {EXPORTED_FROM}): choose another "
      "out_dir; nothing was written"
    )


def _check_shapes(abstract: nnx.State, params: nnx.State) -> None:
  want = {p: v.get_value().shape for p, v in nnx.to_flat_state(abstract)}
  got = {p: v.get_value().shape for p, v in nnx.to_flat_state(params)}
  bad = [p for p in want if got.get(p) != want[p]]
  if bad:
    p = bad[0]
    raise AsearcherError(
      f"checkpoint parameter {'.'.join(map(str, p))} has shape {got.get(p)}, the policy config "
      f"says {want[p]}: model_dir / {POLICY_CONFIG} is not this run's model"
    )


def main(argv: Sequence[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m asearcher_jax.apps.export", description=__doc__)
  ap.add_argument("run_dir")
  ap.add_argument("out_dir", nargs="?")
  ap.add_argument("--step", type=int)
  ap.add_argument("--dtype")
  ap.add_argument("--model_dir")
  a = ap.parse_args(argv)
  try:
    return export(
      run_dir=a.run_dir, out_dir=a.out_dir, step=a.step, dtype=a.dtype, model_dir=a.model_dir
    )
  except AsearcherError as e:  # exit status as `asearcher export` gives it
    config = isinstance(e, ConfigValueError)
    print(f"asearcher export: {'config error' if config else 'error'}: {e}", file=sys.stderr)
    return 2 if config else 1


if __name__ == "__main__":
  sys.exit(main())
