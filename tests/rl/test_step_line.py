"""The trainer's one log line per step: a step without a finished episode says so, not `nan`."""

from asearcher_jax.rl.trainer import step_line


def test_step_line_reports_the_step_figures():
  line = step_line(
    7,
    {
      "ppo/loss": 0.12345,
      "rollout/reward": 0.5,
      "perf/trainer_idle_frac": 0.25,
      "staleness/head_max": 3.0,
    },
  )
  assert line == "step 7: loss 0.1235 reward 0.500 idle 0.25 staleness max 3.0"


def test_step_without_a_finished_episode_has_no_nan():
  line = step_line(3, {"ppo/loss": 0.1, "perf/trainer_idle_frac": 0.9})
  assert "nan" not in line
  assert "reward - (no episode finished)" in line
  assert line.startswith("step 3: loss 0.1000 ")
