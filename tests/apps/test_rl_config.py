"""The quickstart's and the long-horizon pipeline's RL runs are `TrainConfig`s bound in gin, as
`asearcher train`'s is: each knob has one name. The values asserted here are the ones the
pipelines' own flat RL config derived until 2026-12-01 (then copied into a TrainConfig by hand); a
change of them is a change of the experiments (docs/measurements.md), not of the configuration."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from asearcher_jax import main
from asearcher_jax.apps import cli_help
from asearcher_jax.apps import long_horizon as lh
from asearcher_jax.apps import quickstart as qs
from asearcher_jax.apps.train_config import AgentChoice, LearnerConfig, TrainConfig
from asearcher_jax.model.steps import OptimizerConfig
from asearcher_jax.rl.learner import PPOConfig
from asearcher_jax.rl.rollout import RolloutConfig
from asearcher_jax.rl.staleness import StalenessConfig
from asearcher_jax.serving.driver import DriverConfig
from asearcher_jax.serving.engine import EngineConfig

QUICKSTART = ["gin/experiments/quickstart.gin"]
QUICKSTART_CI = [*QUICKSTART, "gin/overlays/quickstart_ci.gin"]
LONG = ["gin/experiments/long_horizon.gin"]
ROW_BUCKETS = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class _Built(Exception):
  pass


def pipeline_args(monkeypatch, subcommand: str, files: list[str], params=()) -> dict[str, Any]:
  """What the configured pipeline hands its RL stages (`quickstart.rl_stages`), nothing run."""
  seen: dict[str, Any] = {}

  def capture(**kw: Any) -> None:
    seen.update(kw)
    raise _Built

  monkeypatch.setattr(qs, "rl_stages", capture)
  fn = main.configure(subcommand, files, list(params))
  with pytest.raises(_Built):
    fn()
  return seen


def quickstart_rl(*, max_seconds: float, ppo: PPOConfig, **parts: Any) -> TrainConfig:
  """The RL config the quickstart built from its flat fields, with the given parts."""
  defaults = dict(
    train_steps=1000, batch_timeout_s=900.0, reward="answer", temperature=1.0, seed=0,
    staleness=StalenessConfig(batch_groups=2, max_staleness=4, max_concurrent=12),
    engine=qs.QUICKSTART_ENGINE,
    driver=DriverConfig(request_timeout_s=600.0, kv_on_update="recompute", batch_reprefill=True),
    agent=AgentChoice(name="asearcher", configs={"asearcher": qs.QUICKSTART_AGENT}),
    rollout=RolloutConfig(group_size=8, episode_timeout_s=600.0, seed=0, curriculum=False),
  )  # fmt: skip
  return TrainConfig(
    max_seconds=max_seconds,
    learner=LearnerConfig(ppo=ppo, optimizer=OptimizerConfig(learning_rate=1e-4, weight_decay=0.0)),
    **{**defaults, **parts},
  )


QUICKSTART_PPO = PPOConfig(
  row_len=2048, short_row_lens=(1024,), row_buckets=ROW_BUCKETS, temperature=1.0,
  ppo_n_minibatches=1, ppo_epochs=1, micro_rows=4,
)  # fmt: skip


def test_the_quickstart_gin_file_binds_the_rl_the_quickstart_ran(monkeypatch):
  args = pipeline_args(monkeypatch, "quickstart", QUICKSTART)
  rl = args["rl"]
  assert rl == quickstart_rl(max_seconds=420.0, ppo=QUICKSTART_PPO)
  # The parts named one by one (what the old code derived from its flat fields and the engine).
  assert rl.engine == qs.QUICKSTART_ENGINE
  assert (rl.ppo().row_len, rl.ppo().short_row_lens, rl.ppo().micro_rows) == (2048, (1024,), 4)
  assert rl.ppo().row_buckets == qs.LEARNER_ROW_BUCKETS
  assert rl.learner.optimizer.learning_rate == 1e-4 and rl.learner.optimizer.weight_decay == 0.0
  assert rl.driver.request_timeout_s == 600.0 and rl.rollout.episode_timeout_s == 600.0
  assert rl.rollout.seed == 0 and rl.seed == 0
  assert (rl.staleness.batch_groups, rl.staleness.max_staleness) == (2, 4)
  assert rl.staleness.max_concurrent == 12 and rl.max_seconds == 420.0 and rl.reward == "answer"
  assert args["pool"] == qs.SynthWikiRL(questions="heldout", kinds=None, prefix_hops=())
  assert args["evaluation"] == qs.QuickstartEval(questions=64, k=4)
  # Python callers (the notebook) get the same run.
  assert rl == qs.QUICKSTART_RL


def test_the_ci_overlay_shrinks_the_same_config(monkeypatch):
  args = pipeline_args(monkeypatch, "quickstart", QUICKSTART_CI)
  ci_engine = EngineConfig(
    max_slots=8, max_seq_len=2048, prefill_buckets=(512, 2048), suffix_buckets=(256,)
  )
  assert args["rl"] == quickstart_rl(
    max_seconds=5.0, ppo=QUICKSTART_PPO, batch_timeout_s=300.0, engine=ci_engine,
    staleness=StalenessConfig(batch_groups=2, max_staleness=4, max_concurrent=4),
  )  # fmt: skip
  assert args["evaluation"] == qs.QuickstartEval(questions=4, k=2, engine_warmup=False)


def test_the_long_horizon_gin_file_binds_the_rl_it_ran(monkeypatch):
  args = pipeline_args(monkeypatch, "long-horizon", LONG)
  rl = args["rl"]
  long_ppo = dataclasses.replace(
    QUICKSTART_PPO, row_len=3072, short_row_lens=(1024, 2048), micro_rows=2
  )
  assert rl == quickstart_rl(
    max_seconds=1500.0, ppo=long_ppo, engine=lh.LONG_ENGINE,
    agent=AgentChoice(name="asearcher", configs={"asearcher": lh.LONG_AGENT}),
  )  # fmt: skip
  assert args["pool"] == qs.SynthWikiRL(questions="train")
  assert args["world"] == lh.LONG_WORLD
  # The Python default differs only in its time budget (the quickstart's, as before).
  assert dataclasses.replace(lh.LONG_RL, max_seconds=1500.0) == rl


def test_long_horizon_overlays_bind_the_same_names(monkeypatch):
  over = "gin/overlays/long_horizon/"
  args = pipeline_args(
    monkeypatch, "long-horizon",
    [*LONG, over + "chains_4_16.gin", over + "hop_credit.gin", over + "curriculum.gin"],
  )  # fmt: skip
  assert args["rl"].max_seconds == 2100.0 and args["rl"].rollout.curriculum
  assert args["pool"].hop_credit == 0.3
  pages = pipeline_args(monkeypatch, "long-horizon", [*LONG, over + "pages.gin"])
  assert qs.synthwiki_agent(pages["rl"]) == lh.PAGES_AGENT


def test_a_flag_names_an_rl_knob_as_train_does(monkeypatch):
  flags = [
    "staleness.StalenessConfig.max_staleness = 0",
    "steps.OptimizerConfig.learning_rate = 3e-4",
  ]
  rl = pipeline_args(monkeypatch, "quickstart", QUICKSTART, flags)["rl"]
  assert rl.staleness.max_staleness == 0 and rl.learner.optimizer.learning_rate == 3e-4


_LINE = re.compile(r"^  ([\w.]+)\.(\w+) = ")


def _help_params(subcommand: str) -> dict[str, set[str]]:
  out: dict[str, set[str]] = {}
  for line in main._help(subcommand, []).splitlines():
    m = _LINE.match(line)
    if m:
      out.setdefault(m.group(1), set()).add(m.group(2))
  return out


def test_quickstart_help_lists_the_rl_parameters_as_train_help_does():
  def rl_only(*, config: TrainConfig) -> None:
    """Every config class a TrainConfig reaches."""

  classes = [c.__qualname__ for c in cli_help.builders(rl_only)]
  train, quick, long = (_help_params(s) for s in ("train", "quickstart", "long-horizon"))

  def by_class(params: dict[str, set[str]]) -> dict[str, tuple[str, frozenset[str]]]:
    return {
      q: next((sel, frozenset(fs)) for sel, fs in params.items() if sel.endswith("." + q))
      for q in classes
    }

  assert "TrainConfig" in classes and "PPOConfig" in classes and "StalenessConfig" in classes
  assert by_class(quick) == by_class(train)
  assert by_class(long) == by_class(train)
  assert "max_seconds" in train["train_config.TrainConfig"]


@pytest.mark.parametrize("subcommand, files", [("quickstart", QUICKSTART), ("long-horizon", LONG)])
def test_one_seed_is_the_evaluations_and_the_rollouts(monkeypatch, subcommand, files):
  """As when the evaluation's seed was also the RL's, a second seed of a recipe reseeds the
  evaluations and the RL rollouts together: one binding, SEED."""
  args = pipeline_args(monkeypatch, subcommand, files, ["SEED = 1"])
  assert args["evaluation"].seed == args["rl"].rollout.seed == args["rl"].seed == 1


def test_train_honours_the_time_budget(monkeypatch, tmp_path):
  """`asearcher train` trains to `max_seconds` as the quickstart does (the same field)."""
  from types import SimpleNamespace

  from asearcher_jax.apps import train as train_lib

  budgets = []

  def fake_run(*, max_seconds=None, on_step=None):
    budgets.append(max_seconds)
    return {}

  run = SimpleNamespace(
    start=lambda **kw: None, close=lambda: None, learner=SimpleNamespace(version=0),
    trainer=SimpleNamespace(run=fake_run, trained_ids=[]),
  )  # fmt: skip
  monkeypatch.setattr(train_lib, "build_run", lambda *a, **kw: run)
  monkeypatch.setattr(train_lib.wiring, "policy", lambda **kw: None)
  monkeypatch.setattr(train_lib, "load_training_qa", lambda *a, **kw: [])
  for budget in (None, 30.0):
    config = TrainConfig(max_seconds=budget)
    assert train_lib.train(config=config, run_dir=str(tmp_path)) == 0
  assert budgets == [None, 30.0]
