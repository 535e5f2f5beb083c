"""The agent's tools: the built-in `search` and `access` for the local-knowledge and the web
settings, and any tool registered by name (`base.Tool`, `registry`; docs/extending.md).

`toolbox.ToolBox` is the one entry point for rollouts: it dispatches a parsed tool call by tag to
its tool (the built-ins call a provider client: `search`, `access`), through the persistent cache
(`cache`) and the cost budget (`budget`), and returns the text the agent sees plus per-call stats.
`retrieval/` holds the corpus readers, the index and the local retrieval server.
"""
