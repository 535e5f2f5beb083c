"""Fixtures of the reliability suite: the byte tokenizer and the shipped BM25 index."""

from pathlib import Path

import pytest

from harness.agent_workload import write_byte_tokenizer
from tests.tools.conftest import shipped_index_dir  # noqa: F401

BYTE_VOCAB = 260  # 256 bytes + 3 specials, rounded up


@pytest.fixture(scope="session")
def byte_tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
  return write_byte_tokenizer(tmp_path_factory.mktemp("bytetok"))
