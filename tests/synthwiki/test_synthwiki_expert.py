"""The scripted SynthWiki expert drives the real AsearcherAgent against the real BM25 retrieval
server on loopback: perfect, it solves 1-3-hop questions; imperfect, measurably fewer; its
trajectories are token-exact, scored by the RL reward, and round-trip through JSONL."""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path

import pytest

from asearcher_jax.agent import AsearcherAgent
from asearcher_jax.apps.world import generate_expert_trajectories
from asearcher_jax.rl import reward
from asearcher_jax.synthwiki.expert import (
  COMPACT_AGENT,
  ExpertConfig,
  SynthWikiExpert,
  read_trajectories,
  write_trajectories,
)
from asearcher_jax.synthwiki.tokenizer import build_world_tokenizer
from asearcher_jax.synthwiki.wiki import TINY, build_synthwiki, parse_facts, render_fact
from asearcher_jax.testing import assert_token_exact
from asearcher_jax.tools.retrieval.index import build_index_dir, load_index
from asearcher_jax.tools.retrieval.server import RetrievalServer, RetrievalServerConfig
from asearcher_jax.tools.search import LocalRetrievalConfig
from asearcher_jax.tools.toolbox import make_toolbox


@pytest.fixture(scope="module")
def sw():
  return build_synthwiki(TINY)


@pytest.fixture(scope="module")
def tok(sw):
  return build_world_tokenizer(sw.world, sw.questions)


@pytest.fixture(scope="module")
def index_dir(sw, tmp_path_factory) -> Path:
  out = tmp_path_factory.mktemp("synthwiki")
  corpus = sw.world.write_corpus(out / "corpus.jsonl")
  build_index_dir(corpus=[corpus], index_dir=out / "index", show_progress=False)
  return out / "index"


@pytest.fixture
async def address(index_dir):
  server = RetrievalServer(load_index(index_dir), RetrievalServerConfig(port=0))
  port = await asyncio.wait_for(server.start(), 10)
  yield f"127.0.0.1:{port}"
  await asyncio.wait_for(server.stop(), 10)


def _accuracy(questions, trajs) -> dict[int, float]:
  by_hops = collections.defaultdict(list)
  for q, t in zip(questions, trajs):
    by_hops[q.hops].append(t.score)
  return {k: sum(v) / len(v) for k, v in sorted(by_hops.items())}


async def test_perfect_expert_solves_one_to_three_hops(sw, tok, address):
  qs = [q for q in sw.questions if q.hops <= 3]
  trajs = await asyncio.wait_for(
    generate_expert_trajectories(sw.world, qs, tokenizer=tok, retrieval_address=address), 60
  )
  assert len(trajs) == len(qs)
  acc = _accuracy(qs, trajs)
  assert set(acc) == {1, 2, 3} and all(a >= 0.9 for a in acc.values()), acc
  for q, t in zip(qs, trajs):
    assert not t.environment_failure and t.format_ok, t.errors
    assert t.score == reward.trajectory_reward(t).score
    if t.score == 1.0:
      assert t.pred_answer == q.answer and t.finish_reason == "answer"
    assert t.tools[0].name == "search"
    for call in t.calls:  # every fact the expert notes was in a result it had seen by then
      seen = "\n".join(e.text for e in t.tools if e.after_call < call.index)
      for f in parse_facts(call.text):
        assert render_fact(f.subject, f.relation, f.value) in seen, (call.text, q.question)
    for call in t.calls:  # what the agent decoded is what the expert meant, byte for byte
      assert tok.decode(call.output_ids.tolist()) == call.text


async def test_imperfect_expert_is_measurably_worse(sw, tok, address):
  qs = [q for q in sw.questions if q.hops <= 3]
  perfect = await generate_expert_trajectories(
    sw.world, qs, tokenizer=tok, retrieval_address=address
  )
  sloppy = await generate_expert_trajectories(
    sw.world, qs, tokenizer=tok, retrieval_address=address, expert=ExpertConfig.imperfect(0.6)
  )
  mean = lambda ts: sum(t.score for t in ts) / len(ts)  # noqa: E731
  assert mean(sloppy) < mean(perfect) - 0.2, (mean(sloppy), mean(perfect))
  assert mean(sloppy) > 0.1  # still a useful teacher


async def test_episode_is_token_exact_and_multi_hop(sw, tok, address):
  q = next(q for q in sw.questions if q.hops == 3 and not q.constraints)
  expert = SynthWikiExpert(sw.world, [q], tok, record=True)
  async with make_toolbox(local=LocalRetrievalConfig(addresses=(address,))) as box:
    agent = AsearcherAgent(client=expert, tokenizer=tok, toolbox=box, config=COMPACT_AGENT)
    traj = await asyncio.wait_for(agent.run(q.question, qid=q.id, answers=[q.answer]), 30)
  assert traj.pred_answer == q.answer and reward.trajectory_reward(traj).score == 1.0
  assert_token_exact(traj, expert.calls)
  assert [c.kind for c in traj.calls][:2] == ["act", "read"]
  queries = [e.argument for e in traj.tools if e.name == "search"]
  # each hop's query names the bridge entity the previous read turn found in the results
  for name, query in zip(q.gold_titles, queries):
    assert query.startswith(name)
  for name, (call, event) in zip(q.bridges, zip(traj.calls[1::2], traj.tools)):
    assert name in event.text and name in call.text


async def test_expert_retries_then_guesses_when_retrieval_misses(sw, tok, address):
  q = next(q for q in sw.questions if q.hops == 1 and not q.constraints)
  always_sloppy = ExpertConfig(p_sloppy_query=1.0, max_attempts=3)
  (traj,) = await generate_expert_trajectories(
    sw.world, [q], tokenizer=tok, retrieval_address=address, expert=always_sloppy
  )
  assert traj.finish_reason == "answer" and len(traj.tools) == 3
  assert all(q.start not in e.argument for e in traj.tools)  # sloppy: no entity name
  assert "is not in these results" in traj.calls[1].text


async def test_described_start_is_identified_from_the_results(sw, tok, address):
  qs = [q for q in sw.questions if q.constraints]
  trajs = await generate_expert_trajectories(sw.world, qs, tokenizer=tok, retrieval_address=address)
  solved = [t for t in trajs if t.score == 1.0]
  assert len(solved) >= 0.8 * len(qs)
  for q, t in zip(qs, trajs):
    if t.score == 1.0:
      assert any(f"{q.start} is the {q.noun} in question." in c.text for c in t.calls)


async def test_trajectories_round_trip_through_jsonl(sw, tok, address, tmp_path):
  qs = sw.questions[:4]
  trajs = await generate_expert_trajectories(
    sw.world, qs, tokenizer=tok, retrieval_address=address, n=6, seed=3
  )
  assert [t.qid for t in trajs] == [q.id for q in qs] + [qs[0].id, qs[1].id]
  path = write_trajectories(trajs, tmp_path / "expert.jsonl")
  back = read_trajectories(path)
  assert [t.to_json() for t in back] == [t.to_json() for t in trajs]
  assert all(t.calls[0].input_ids.size > 0 and t.score is not None for t in back)


async def test_same_seed_same_episode(sw, tok, address):
  qs = sw.questions[:10]
  cfg = ExpertConfig.imperfect(0.5, seed=7)
  a = await generate_expert_trajectories(
    sw.world, qs, tokenizer=tok, retrieval_address=address, expert=cfg
  )
  b = await generate_expert_trajectories(
    sw.world, qs, tokenizer=tok, retrieval_address=address, expert=cfg
  )
  assert [t.calls[-1].output_ids.tolist() for t in a] == [
    t.calls[-1].output_ids.tolist() for t in b
  ]
  # another group member (another sampling seed) takes other chances
  c = await generate_expert_trajectories(
    sw.world, qs, tokenizer=tok, retrieval_address=address, expert=cfg, seed=1
  )
  assert [t.to_json()["calls"] for t in a] != [t.to_json()["calls"] for t in c]


async def test_a_hasty_expert_makes_only_early_answers(sw, tok, address):
  """The warm start's hasty stage clones this expert: careful, except that at each act turn before
  its chain is resolved it answers with a guess with probability p_guess. So on a 1-hop question
  about half its episodes answer without searching (and are wrong), and every episode that
  searched is right: RL then has one behaviour to fix, and fixing it means searching more."""
  qs = [q for q in sw.questions if q.kind == "chain" and q.hops == 1 and not q.constraints]
  assert len(qs) >= 20
  trajs = await asyncio.wait_for(
    generate_expert_trajectories(
      sw.world, qs, tokenizer=tok, retrieval_address=address,
      expert=ExpertConfig(seed=1, p_guess=0.5),
    ),
    60,
  )  # fmt: skip
  searched = [t for t in trajs if t.tools]
  guessed = [t for t in trajs if not t.tools]
  assert 0.25 < len(guessed) / len(trajs) < 0.75, (len(guessed), len(trajs))
  assert all(t.finish_reason == "answer" and t.format_ok for t in trajs)
  assert sum(t.score for t in searched) >= 0.9 * len(searched)  # no sloppy query, no misread
  assert sum(t.score for t in guessed) <= 0.2 * len(guessed)
