"""The benchmark workload's SteeringClient keeps every call inside its token budget: the appended
search/answer action counts against max_new_tokens, so no training sequence outgrows the
engine's context (a 2,050-token sequence once stopped `benchmarks/async_vs_sync.py`)."""

from __future__ import annotations

import asyncio

from asearcher_jax.serving.types import GenerationResult, SamplingParams
from asearcher_jax.tokenizer import Tokenizer
from harness.agent_workload import (
  LogNormal,
  SafeRng,
  SteeringClient,
  write_byte_tokenizer,
)


class _Echo:
  """Generates exactly as many tokens as asked (ids 100...)."""

  async def generate(self, token_ids, sampling, max_new_tokens, stop=(), stop_token_ids=None):
    n = max_new_tokens
    return GenerationResult(tokens=list(range(100, 100 + n)), logprobs=[-1.0] * n,
                            versions=[3] * n, stop_reason="length")  # fmt: skip


def test_steered_calls_never_exceed_max_new_tokens(tmp_path):
  tok = Tokenizer.from_dir(str(write_byte_tokenizer(tmp_path)))
  long_outputs = LogNormal(median=40.0, sigma=0.1, low=30, high=50)  # always wants ~40 tokens
  client = SteeringClient(_Echo(), tok, k=2, rng=SafeRng(0), output_len=long_outputs)

  async def go():
    out = []
    for budget in (64, 45, 20, 3):
      res = await client.generate([1, 2], SamplingParams(), budget, stop=("</search>",))
      out.append((budget, res))
    return out

  results = asyncio.run(go())
  for budget, res in results:
    assert len(res.tokens) <= budget, (budget, len(res.tokens))
    assert len(res.logprobs) == len(res.versions) == len(res.tokens)
  text = tok.decode(results[0][1].tokens[-30:])
  assert text.endswith("</search>")  # with room, the whole action is appended
  assert tok.decode(results[1][1].tokens).endswith("</search>")  # 45: engine output shrinks
