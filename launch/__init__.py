"""Launching asearcher_jax runs: Cloud TPU slices (gcloud) or the same plan as local processes.

Outside the `asearcher_jax` package on purpose: the library never imports its launcher. Entry
point: `python -m launch ACTION --spec SPEC.toml` (launch/cli.py).
"""
