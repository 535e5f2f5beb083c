"""Fixtures of the example tests: the real retrieval server over the shipped corpus (the tool
tests' fixtures, reused) and the real tokenizer."""

from __future__ import annotations

import pytest

from asearcher_jax.tokenizer import Tokenizer
from tests.tools.conftest import retrieval_server, shipped_index, shipped_index_dir  # noqa: F401


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
  return Tokenizer.qwen2()
