"""asearcher_jax: fully asynchronous RL for long-horizon LLM search agents in JAX/Flax."""

from asearcher_jax import tpu_env as _tpu_env

__version__ = "0.1.0"

# libtpu (installed for `asearcher compile`) reads its environment when JAX first starts a
# backend; on a host without a TPU it would print metadata-server warnings then. Any program
# that imports the package before that (benchmarks, notebooks, tests) starts quietly; with a TPU
# attached nothing is set (tpu_env.py).
_tpu_env.quiet_libtpu()
