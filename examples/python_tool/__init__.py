"""A Python-executor tool and an agent that uses it beside search (docs/extending.md).

Nothing under `asearcher_jax/` names this package: the tool and the agent reach the trainer and
the evaluation through `"module:Class"` strings in gin (`train.gin`, `eval.gin` here).
"""
