"""Every agent by name, so training, evaluation and synthesis build the same agents the same way.

An agent is built from a generation client, a tokenizer and a toolbox (never from weights), with
its own frozen config (`Agent.config_class`). Names are what gin binds
(`train_config.AgentChoice.name`, `commands.evaluate.agent`): a registered name, or
`"module:Class"` for an agent outside the package (imported on demand, then known by that
string). The older evaluation spellings stay accepted so existing run directories and gin files
keep working.
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
from asearcher_jax.tools.registry import load_class

# name -> (agent class, its config class or None); `register` adds to it.
AGENTS: dict[str, tuple[type[Agent], type | None]] = {}
# Older spellings (evaluation run directories record them).
ALIASES = {"asearcher-reasoning": "reasoning", "search-r1": "search_r1"}


def register(name: str, cls: type[Agent] | str, config_class: type | None = None) -> type[Agent]:
  """Registers an agent class (or a `"module:Class"` entry point) under `name`; its config class
  is `config_class`, else the class's own `config_class`. Re-registering the same is a no-op."""
  if isinstance(cls, str):
    cls = load_class(cls, Agent, "agent")
  if not (isinstance(cls, type) and issubclass(cls, Agent)):
    raise AsearcherError(f"agent {name!r}: {cls!r} is not a subclass of agent.base.Agent")
  entry = (cls, config_class if config_class is not None else cls.config_class)
  old = AGENTS.get(name)
  if old is not None and old != entry:
    raise AsearcherError(f"agent {name!r} is already registered as {old[0].__name__}")
  AGENTS[name] = entry
  return cls


register("asearcher", AsearcherAgent, AsearcherAgentConfig)
register("reasoning", ReasoningAgent, ReasoningAgentConfig)
register("search_r1", SearchR1Agent, SearchR1AgentConfig)


def canonical(name: str) -> str:
  """The name an agent is known by (an alias resolved; `"module:Class"` stays as written)."""
  return ALIASES.get(name, name)


def resolve(name: str, config: Any = None) -> tuple[type[Agent], Any]:
  """(agent class, config): the config checked against the agent, or that agent's default."""
  key = canonical(name)
  if key not in AGENTS and ":" in key:
    register(key, key)
  if key not in AGENTS:
    named = sorted(k for k in AGENTS if ":" not in k)  # entry points resolved earlier aside
    raise AsearcherError(f"agent must be one of {named} or 'module:Class', got {name!r}")
  cls, config_cls = AGENTS[key]
  if config_cls is None:
    return cls, config
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

  kwargs = {} if config is None else {"config": config}

  def make(sampling: SamplingParams) -> Agent:
    return cls(
      client=client, tokenizer=tokenizer, toolbox=toolbox, sampling=sampling, limits=limits,
      **kwargs,
    )  # fmt: skip

  return make
