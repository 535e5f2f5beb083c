"""Views of what runs write, for notebooks (HTML) and the terminal (rich): episodes turn by turn
and token by token, training curves, evaluation comparisons, synthesis questions.

Layered above rl / evaluation / synthesis (it reads their formats) and below apps, so a notebook
imports `asearcher_jax.views` and `asearcher inspect` (apps/inspect.py) draws the same things.
"""
