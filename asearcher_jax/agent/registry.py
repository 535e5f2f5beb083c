"""Every agent by name, so training, evaluation and synthesis build the same agents the same way.

An agent is built from a generation client, a tokenizer and a toolbox (never from weights), with
its own frozen config. Names are what gin binds (`train_config.AgentChoice.name`,
`commands.evaluate.agent`); the older evaluation spellings stay accepted so existing run
directories and gin files keep working.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asearcher_jax.agent.asearcher import AsearcherAgent, AsearcherAgentConfig
from asearcher_jax.agent.base import Agent, Limits
from asearcher_jax.agent.reasoning import ReasoningAgent, ReasoningAgentConfig
from asearcher_jax.agent.search_r1 import SearchR1Agent, SearchR1AgentConfig
from asearcher_jax.errors import AsearcherError
from asearcher_jax.serving.types import SamplingParams
from asearcher_jax.tokenizer import Tokenizer

# name -> (agent class, its config class)
AGENTS: dict[str, tuple[type[Agent], type]] = {
  "asearcher": (AsearcherAgent, AsearcherAgentConfig),
  "reasoning": (ReasoningAgent, ReasoningAgentConfig),
  "search_r1": (SearchR1Agent, SearchR1AgentConfig),
}
# Older spellings (evaluation run directories record them).
ALIASES = {"asearcher-reasoning": "reasoning", "search-r1": "search_r1"}


def resolve(name: str, config: Any = None) -> tuple[type[Agent], Any]:
  """(agent class, config): the config checked against the agent, or that agent's default."""
  canonical = ALIASES.get(name, name)
  if canonical not in AGENTS:
    raise AsearcherError(f"agent must be one of {sorted(AGENTS)}, got {name!r}")
  cls, config_cls = AGENTS[canonical]
  config = config if config is not None else config_cls()
  if not isinstance(config, config_cls):
    raise AsearcherError(
      f"agent {name!r} takes a {config_cls.__name__}, got {type(config).__name__}"
    )
  return cls, config


def agent_factory(
  name: str,
  config: Any,
  *,
  client: Any,
  tokenizer: Tokenizer,
  toolbox: Any,
  limits: Limits | None = None,
) -> Callable[[SamplingParams], Agent]:
  """A factory of fresh agents (one per episode) sharing the client and the toolbox; a bad name
  or a config of another agent fails here, before any episode runs."""
  cls, config = resolve(name, config)

  def make(sampling: SamplingParams) -> Agent:
    return cls(
      client=client, tokenizer=tokenizer, toolbox=toolbox, config=config, sampling=sampling,
      limits=limits,
    )  # fmt: skip

  return make
