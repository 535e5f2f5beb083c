"""An agent that searches and runs Python: the ASearcher base-model agent with a prompt that
lists its ToolBox's tools (each tool's tag and description), so the same class works with any
tool set. Everything else (act and read turns, compaction, budgets, token-exact trajectories) is
`AsearcherAgent`'s: a `<python>` result is one read turn like a search result.
"""

from __future__ import annotations

from asearcher_jax.agent.asearcher import AsearcherAgent, AsearcherAgentConfig

PROMPT = (
  "A conversation between User and Assistant. The user asks a question, and the Assistant answers "
  "it. The Assistant thinks inside <think> </think>, and may call these tools, one per turn:\n"
  "{tools}\n"
  "Each tool's result is returned between <information> and </information>. When the Assistant "
  "is done, it gives the answer inside <answer> and </answer>, e.g. <answer> 42 </answer>.\n"
  "User: {question}\nAssistant: \n<think>\n"
)


class CodeSearchAgent(AsearcherAgent):
  """Search and a code executor beside it: arithmetic, dates and lists are computed, not guessed."""

  name = "code_search"
  config_class = AsearcherAgentConfig

  def tool_lines(self) -> str:
    """One line per tool the agent's ToolBox has a backend for: `<tag> ... </tag>: description`."""
    tools = getattr(self.toolbox, "tools", None) or {}
    return "\n".join(
      f"- <{t.tag}> ... </{t.tag}>: {t.description}" for t in tools.values() if t.available
    )

  def prompt(self, question: str, valid_inst: bool) -> str:
    return PROMPT.replace("{tools}", self.tool_lines()).replace("{question}", question)
