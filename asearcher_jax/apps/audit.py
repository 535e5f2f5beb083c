"""`asearcher audit RUN_DIR`: whether a training run's files are consistent, read from them alone.

  asearcher audit RUN_DIR [--batch_groups B] [--first_version V] [--eta N]
  asearcher audit --gin_param='audit.audit.run_dir="RUN_DIR"' --gin_param=audit.audit.eta=4

RUN_DIR is what `asearcher train` wrote, or a quickstart / long-horizon directory (its rl/). The
replay logs, the trained tokens' versions and the resume log are read independently of the
trainer's own metrics (`rl.audit`), so the answer holds whatever happened to the processes
(kills, restarts, a full disk): no group lost, none trained twice, token versions that never go
backwards, resumed episodes that matched their journals and, given the run's eta, no trained
token older than eta versions. It also summarises the trainer-sampler logprob agreement per
engine path and dtype from the metrics log (`rl.audit.agreement_summary`). Run it once the run
has stopped (nothing writing RUN_DIR).

Prints a report, then one JSON object on its last line. Exit status 0 when the run is
consistent, 1 when the audit finds a problem, 2 when RUN_DIR is not a run directory.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from asearcher_jax.errors import AsearcherError, ConfigValueError
from asearcher_jax.rl import audit as run_audit


def audit(
  *,
  run_dir: str = "runs/quickstart",
  batch_groups: int = 1,
  first_version: int = 0,
  eta: int | None = None,
) -> int:
  """Prints the audit of a run directory; returns 0 (consistent) or 1 (a problem found).

  Args:
    run_dir: the run directory to audit (`asearcher train`'s, or one holding it as rl/).
    batch_groups: groups per training step (the run's StalenessConfig.batch_groups): the i-th
      trained group was trained by version first_version + i // batch_groups.
    first_version: policy version of the run's first training step (0: a fresh run).
    eta: the run's staleness bound (StalenessConfig.max_staleness); None: max staleness is
      reported, not checked (the files do not record it).
  """
  if batch_groups < 1:
    raise ConfigValueError(f"batch_groups (--batch_groups) must be >= 1, got {batch_groups}")
  if first_version < 0:
    raise ConfigValueError(f"first_version (--first_version) must be >= 0, got {first_version}")
  if eta is not None and eta < 0:
    raise ConfigValueError(f"eta (--eta) must be >= 0, got {eta}")
  try:
    run = run_audit.train_dir(run_dir)
  except OSError as e:
    raise ConfigValueError(str(e)) from None
  result = run_audit.audit_run(run, batch_groups=batch_groups, first_version=first_version)
  problems = result.problems(eta=eta)
  r = result
  checked = f"eta = {eta}" if eta is not None else "not checked: give --eta"
  rows = [
    ("run directory", str(run)),
    ("groups pushed", r.pushed),
    ("  trained", r.committed),
    ("  discarded (stale)", r.discarded),
    ("  still queued", r.pending),
    ("  lost", r.lost),
    ("  pushed or trained twice", r.duplicated),
    ("  unknown to the log", r.unknown),
    ("max staleness", f"{r.max_staleness} ({checked}; B = {batch_groups})"),
    ("versions backwards", r.versions_backwards),
    ("resumed episodes", r.resumed_episodes),
    ("  calls replayed", r.replayed_calls),
    ("  diverged", r.diverged),
  ]
  agreement = run_audit.agreement_summary(run)
  for tag, a in sorted(agreement.items()):
    rows.append((f"agreement {tag}", (
      f"|dlogp| mean {a['abs_mean']:.3g} max {a['abs_max']:.3g} (step {a['worst_step']}), "
      f"KL k3 {a['kl_k3']:.3g}, ratio outside [0.5, 2] {a['out_frac']:.3g}, over "
      f"{int(a['tokens'])} tokens of {a['steps']} steps"
    )))  # fmt: skip
  for name, value in rows:
    print(f"{name:26} {value}")
  print("consistent" if not problems else "PROBLEMS:\n" + "\n".join(f"  {p}" for p in problems))
  summary = {
    "run_dir": str(run), **result.as_dict(), "batch_groups": batch_groups,
    "first_version": first_version, "eta": eta, "consistent": not problems, "problems": problems,
    "agreement": agreement,
  }  # fmt: skip
  print(json.dumps(summary), flush=True)
  return 1 if problems else 0


def main(argv: Sequence[str] | None = None) -> int:
  """The positional command line (`RUN_DIR [--batch_groups B] [--first_version V] [--eta N]`)."""
  p = argparse.ArgumentParser(prog="asearcher audit", description=__doc__.splitlines()[0])
  p.add_argument("run_dir")
  p.add_argument("--batch_groups", type=int, default=1, help="groups per training step (B)")
  p.add_argument("--first_version", type=int, default=0, help="version of the first step")
  p.add_argument("--eta", type=int, default=None, help="the run's staleness bound, checked")
  a = p.parse_args(argv)
  try:
    return audit(
      run_dir=a.run_dir, batch_groups=a.batch_groups, first_version=a.first_version, eta=a.eta
    )
  except AsearcherError as e:  # exit status as the gin-bound form gives it
    config = isinstance(e, ConfigValueError)
    print(f"asearcher audit: {'config error' if config else 'error'}: {e}", file=sys.stderr)
    return 2 if config else 1


if __name__ == "__main__":
  sys.exit(main())
