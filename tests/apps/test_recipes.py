"""Every recipe in gin/experiments/ parses for each role it configures, and runs end to end on CPU
(3 RL steps) under gin/overlays/recipe_tiny.gin with every other binding it has."""

from __future__ import annotations

import json
from pathlib import Path

import gin
import pytest

from asearcher_jax import main as cli
from asearcher_jax.apps import gin_config
from asearcher_jax.tokenizer import Tokenizer
from tests.apps.test_train_agents_tools import PROMPT_MARKS, groups, prompt_text

REPO = Path(__file__).resolve().parents[2]
RECIPES = {
  "asearcher_local_qwen2_5_7b": ("asearcher", "local"),
  "asearcher_local_qwen2_5_14b": ("asearcher", "local"),
  "search_r1_qwen2_5_7b": ("search_r1", "local"),
  "asearcher_web_qwq_32b": ("reasoning", "web"),
}
OVERLAY = "gin/overlays/recipe_tiny.gin"
# The recipes run for 3 steps: one per agent (the 14b recipe is the 7b one at another size, the
# same program under the tiny overlay; it is parsed and checked above and by its plan test).
RUN_RECIPES = sorted(set(RECIPES) - {"asearcher_local_qwen2_5_14b"})


def value(name: str):
  """A bound value, evaluating a macro or @reference (`%N`, `@learner.PPOConfig()`)."""
  v = gin.query_parameter(name)
  return v.scoped_configurable_fn() if hasattr(v, "scoped_configurable_fn") else v


def configure(command: str, files: list[str], params: list[str] = ()):
  gin.clear_config()
  return cli.configure(command, files, list(params))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_configures_train_serve_and_plan(name):
  recipe = f"gin/experiments/{name}.gin"
  agent, tools = RECIPES[name]
  try:
    for command in ("train", "serve-model", "serve-retrieval", "plan"):
      if command == "serve-retrieval" and tools == "web":  # no retrieval server: a mistake
        with pytest.raises(gin_config.ConfigError, match="nothing here binds serve_retrieval"):
          configure(command, [recipe])
        continue
      configure(command, [recipe])
    if agent != "asearcher":  # the default agent is left unbound
      assert value("train_config.AgentChoice.name") == agent
    ppo = value("train_config.LearnerConfig.ppo")
    assert (ppo.eps_clip, ppo.reward_bias, ppo.reward_scale) == (0.4, -0.5, 10.0)
    assert value("rollout.RolloutConfig.group_size") == 16
    assert value("staleness.StalenessConfig.max_staleness") == 4
    if tools == "web":
      assert value("wiring.ToolsConfig.kind") == "web"
      assert value("reasoning.ReasoningAgentConfig.history_chars") == 25000
      assert value("reasoning.ReasoningAgentConfig.max_turns") == 128
  finally:
    gin.clear_config()


@pytest.mark.slow
@pytest.mark.parametrize("name", RUN_RECIPES)
def test_recipe_runs_three_steps_on_cpu_with_the_tiny_overlay(name, tmp_path, capsys):
  """Also what `asearcher train` must show for the agent it is given by name: the groups it
  trains are that agent's (the replay log names it; its prompt is that agent's own)."""
  run_dir = tmp_path / "run"
  try:
    fn = configure("train", [f"gin/experiments/{name}.gin", OVERLAY],
                   [f'commands.train.run_dir="{run_dir}"'])  # fmt: skip
    # The overlay changed sizes and plumbing only: the recipe's RL settings survive.
    ppo = value("train_config.LearnerConfig.ppo")
    assert (ppo.eps_clip, ppo.reward_scale, ppo.row_len) == (0.4, 10.0, 1024)
    assert value("staleness.StalenessConfig.max_staleness") == 4
    assert fn() == 0
  finally:
    gin.clear_config()
  summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert summary["version"] == 3, summary
  rows = (run_dir / "metrics" / "metrics.jsonl").read_text().strip().splitlines()
  assert len(rows) == 3
  agent = RECIPES[name][0]
  assert summary["agent"] == agent
  trained = groups(run_dir)
  assert trained and {g.metadata["agent"] for g in trained} == {agent}
  tok = Tokenizer.qwen2()
  for g in trained:
    assert PROMPT_MARKS[agent] in prompt_text(tok, g)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_engine_is_the_planned_and_compiled_serving_replica(name):
  """The serving engine binds the paged layout at the slots, pages and page size the planner's
  ServingShape models (one macro each binds both), so the plan and the compiled serving
  programs describe the engine that runs."""
  try:
    configure("serve-model", [f"gin/experiments/{name}.gin"])
    engine = value("serve_model.serve.engine")
    shape = value("planning.plan.serving")
  finally:
    gin.clear_config()
  assert engine.kv_layout == "paged"
  assert (engine.max_slots, engine.max_seq_len) == (shape.slots, shape.context)
  assert (engine.num_pages, engine.page_size) == (shape.pages, shape.page_size)


def test_launch_specs_start_the_serving_slices_their_recipe_plans():
  """A launch spec on the recipe's planned chip starts as many serving slices as the recipe's
  ServingShape.replicas (the step times in its header assume that many)."""
  from launch.spec import load

  checked = 0
  for path in sorted((REPO / "launch/specs").glob("*.toml")):
    if path.stem.startswith("local"):  # one host's processes (--backend local), no slices
      continue
    spec = load(path)
    recipe = REPO / spec.experiment
    if recipe.parent.name != "experiments" or recipe.stem not in RECIPES:
      continue
    try:
      configure("plan", [str(recipe.relative_to(REPO))])
      shape, chip = value("planning.plan.serving"), value("planning.plan.chip")
    finally:
      gin.clear_config()
    if spec.trainer.chip.name != chip:  # another generation (v5e): its own sizing
      continue
    assert len(spec.serving) == shape.replicas, path.name
    assert {s.chips for s in spec.serving} == {shape.chips}, path.name
    checked += 1
  assert checked >= 3


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_header_states_the_papers_target_dated_and_sourced(name):
  """Each real-model recipe says which published number it is after, when it was read and from
  where, and points at docs/reproduce.md's table, not at files outside the repository."""
  header = []
  for line in (REPO / "gin" / "experiments" / f"{name}.gin").read_text().splitlines():
    if not line.startswith("#"):
      break
    header.append(line)
  text = "\n".join(header)
  target = text[text.index("# Target:") :]
  assert "2026-12-02" in target and "docs/reproduce.md" in target, target
  assert any(src in text for src in ("inclusionAI/ASearcher", "PeterGriffinJin/Search-R1"))
  for outside in ("spec.md", "reference spec", "issue 5", "(issue "):
    assert outside not in text, (name, outside)
  for path in ("gin/overlays/recipe_tiny.gin", "docs/reproduce.md"):
    assert (REPO / path).exists()


@pytest.mark.parametrize("name", ["asearcher_local_qwen2_5_7b", "search_r1_qwen2_5_7b"])
def test_local_recipes_retrieve_with_e5_and_the_bm25_overlay_swaps_the_index(name):
  """As the paper: the recipe's index is the e5 one over wiki-18; the overlay points trainer
  and retrieval server at the BM25 index instead (one macro binds both)."""
  recipe = f"gin/experiments/{name}.gin"
  try:
    configure("train", [recipe])
    e5 = "/mnt/asearcher/indexes/wiki18_e5"
    assert value("commands.train.retrieval_index_dir") == e5
    assert value("serve_retrieval.serve.index_dir") == e5
    configure("train", [recipe, "gin/overlays/bm25_retrieval.gin"])
    bm25 = "/mnt/asearcher/indexes/wiki18_bm25"
    assert value("commands.train.retrieval_index_dir") == bm25
    assert value("serve_retrieval.serve.index_dir") == bm25
  finally:
    gin.clear_config()
