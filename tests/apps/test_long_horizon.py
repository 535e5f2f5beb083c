"""The long-horizon experiment: its questions need one search per hop (checked against the world
and with the perfect scripted expert over the real BM25 server), its warm-start expert gives up
early on long chains, and `long_horizon` runs end to end at CI size with the summary it promises.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import re

import pytest

from asearcher_jax.agent import AsearcherAgentConfig
from asearcher_jax.apps import long_dagger
from asearcher_jax.apps import long_horizon as lh
from asearcher_jax.apps import long_horizon_report as report
from asearcher_jax.apps import long_warm_start as lws
from asearcher_jax.apps import quickstart as qs
from asearcher_jax.apps.train_config import AgentChoice, TrainConfig
from asearcher_jax.apps.warm_start import WARM_START_OPTIMIZER, SFTStage
from asearcher_jax.apps.world import RetrievalThread, generate_expert_trajectories, prepare_world
from asearcher_jax.errors import AsearcherError
from asearcher_jax.model.sharding import MeshConfig
from asearcher_jax.rl.staleness import StalenessConfig
from asearcher_jax.serving.engine import EngineConfig
from asearcher_jax.sft.sft import SFTConfig
from asearcher_jax.synthwiki import chain_breaks
from asearcher_jax.synthwiki.expert import ExpertConfig, read_trajectories
from asearcher_jax.synthwiki.questions import chain_entities, hop_leaks, mentions
from asearcher_jax.synthwiki.wiki import URL_PREFIX, SynthWikiConfig, build_synthwiki, parse_facts
from asearcher_jax.synthwiki.world import RELATIONS
from asearcher_jax.tokenizer import Tokenizer
from asearcher_jax.tools.search import Document
from asearcher_jax.tools.toolbox import search_job

# ~50 entities, 8 chains per hop count from 4 to 8.
TINY_LONG = SynthWikiConfig(
  num_people=20, num_places=12, num_organisations=10, num_works=8,
  questions_per_hop=(0, 0, 0, 8, 8, 8, 8, 8), num_comparisons=0, isolate_hops=True, shuffle=True,
)  # fmt: skip


def test_long_world_has_4_to_12_hop_chains_each_hop_isolated():
  sw = build_synthwiki(lh.LONG_WORLD)
  hops = {q.hops for q in sw.questions}
  assert hops == set(range(4, 13))
  assert {"injection", "fuzzing"} <= {op for q in sw.questions for op in q.ops}
  assert sw.test and {q.hops for q in sw.test[:64]} >= {4, 8, 12}  # shuffled: the first mix
  for q in sw.questions:
    assert hop_leaks(sw.world, q) == [], q.id
    chain = chain_entities(sw.world, q)
    assert len(chain) == len(set(chain)) >= q.hops  # no entity twice
    for i, eid in enumerate(chain):  # the page of each chain entity names only its successor
      assert mentions(sw.world.entities[eid]) & set(chain) <= {*chain[i + 1 : i + 2]}


def test_longer_world_adds_13_to_16_hop_chains_and_keeps_the_shipped_warm_starts_tokenizer(
  tmp_path,
):
  short, longer = build_synthwiki(lh.LONG_WORLD), build_synthwiki(lh.LONGER_WORLD)
  assert {q.hops for q in longer.questions} == set(range(4, 17))
  assert longer.world.corpus_rows() == short.world.corpus_rows()
  split = {q.question: q.split for q in longer.questions}
  assert all(split.get(q.question) == q.split for q in short.questions)  # none changes side
  assert all(hop_leaks(longer.world, q) == [] for q in longer.questions if q.hops > 12)
  long_test = [q.hops for q in longer.test[:64] if q.hops >= 6]
  assert sum(long_test) / len(long_test) > 10  # one search a hop needs > 10 calls there
  _, files = prepare_world(tmp_path / "world", lh.LONGER_WORLD)
  shipped = lws.LONG_WARM_START / "tokenizer.json"
  assert (files.tokenizer / "tokenizer.json").read_bytes() == shipped.read_bytes()
  qs.check_tokenizer(files, lws.LONG_WARM_START)


@pytest.mark.slow
def test_longest_world_appends_17_to_32_hop_chains_and_changes_nothing_else(tmp_path):
  longer, longest = build_synthwiki(lh.LONGER_WORLD), build_synthwiki(lh.LONGEST_WORLD)
  n = len(longer.questions)
  assert longest.questions[:n] == longer.questions  # ids, order, splits: the held-out is the same
  appended = longest.questions[n:]
  assert sorted({q.hops for q in appended}) == list(range(17, 33))
  per_hop = [sum(q.hops == h for q in appended) for h in range(17, 33)]
  assert all(10 <= n <= 24 for n in per_hop) and sum(per_hop) > 15 * 24  # 32 hops run dry
  assert len({q.question for q in longest.questions}) == len(longest.questions)
  assert all(hop_leaks(longest.world, q) == [] for q in appended)
  assert {q.split for q in appended} == {"train", "test"}  # by start entity, as the others
  assert longest.digest() != longer.digest()
  _, files = prepare_world(tmp_path / "world", lh.LONGEST_WORLD)
  shipped = lws.LONG_WARM_START / "tokenizer.json"
  assert (files.tokenizer / "tokenizer.json").read_bytes() == shipped.read_bytes()
  assert lws._hop_range(dataclasses.asdict(lh.LONGEST_WORLD)) == "4-32"
  with pytest.raises(ValueError, match="question counts"):
    dataclasses.replace(lh.LONGER_WORLD, appended_questions_per_hop=(3, -1))


def test_hop_leaks_flags_a_back_link():
  sw = build_synthwiki(TINY_LONG)
  q = sw.questions[0]
  chain = chain_entities(sw.world, q)
  second = sw.world.entities[chain[1]]
  linked = dataclasses.replace(second, facts={**second.facts, "mentor": chain[0]})
  sw.world.entities[chain[1]] = linked  # the second page now names the start
  assert any(second.name in m for m in hop_leaks(sw.world, q))
  unisolated = build_synthwiki(dataclasses.replace(TINY_LONG, isolate_hops=False))
  assert any(hop_leaks(unisolated.world, x) for x in unisolated.questions)  # the rule bites


@pytest.fixture(scope="module")
def tiny_world(tmp_path_factory):
  """TINY_LONG's world files (BM25 index, tokenizer), made once for the expert tests."""
  return prepare_world(tmp_path_factory.mktemp("tiny_long") / "world", TINY_LONG)


def _play(tiny_world, expert, agent):
  """Every question of the tiny world played by the scripted `expert` over the real BM25 server."""
  sw, files = tiny_world
  with RetrievalThread(files.index) as server:
    return asyncio.run(generate_expert_trajectories(
      sw.world, sw.questions, tokenizer=Tokenizer.from_dir(files.tokenizer),
      retrieval_address=server.address, expert=expert, agent_config=agent, concurrency=8,
    ))  # fmt: skip


def test_perfect_expert_searches_once_per_hop_and_the_warm_start_expert_gives_up(tiny_world):
  qs_ = tiny_world[0].questions

  def play(expert):
    return _play(tiny_world, expert, lh.LONG_AGENT)

  def calls(t):
    return t.stats()["num_search"] + t.stats()["num_access"]

  perfect = play(ExpertConfig())
  assert sum(t.score for t in perfect) >= 0.9 * len(qs_)
  # Every hop takes its own search: the perfect expert, which notes every hop the retrieved
  # text resolves, needs at least one tool call per hop (BM25's third result may by chance be a
  # later page of the chain: allowed for one question in ten).
  assert sum(calls(t) >= q.hops for q, t in zip(qs_, perfect)) >= 0.9 * len(qs_)
  assert max(t.stats()["max_input_tokens"] for t in perfect) < lh.LONG_AGENT.max_tokens / 2
  hasty = play(ExpertConfig(give_up_after_hops=(2, 3)))
  for q, t in zip(qs_, hasty):
    assert calls(t) <= 3 + 2, q.id  # gave up after at most 3 hops (+ retries)
    assert t.pred_answer is not None and t.finish_reason == "answer"
  assert sum(t.score for t in hasty) <= 0.3 * len(qs_)


def test_snippets_state_no_fact_so_every_hop_needs_its_page():
  sw = build_synthwiki(TINY_LONG)
  docs = [Document(url=r["url"], contents=r["contents"]) for r in sw.world.corpus_rows()]
  full = parse_facts(search_job(docs, 5000).text)
  shown = parse_facts(search_job(docs, 5000, doc_sentences=1).text)
  assert {f.relation for f in shown} == {"kind"}  # the title and the intro sentence only
  assert len(shown) == len(docs) and len(full) > 3 * len(docs)
  assert {f.subject for f in shown} == {e.name for e in sw.world.entities.values()}


@pytest.mark.slow  # ~10 s
def test_page_reading_expert_searches_then_opens_the_page_for_every_hop(tiny_world):
  qs_ = tiny_world[0].questions

  def play(expert):
    return _play(tiny_world, expert, lh.PAGES_AGENT)

  perfect = play(lws.warm_start_expert(lws.LongWarmStart(
    give_up_after_hops=None, read_pages=True, max_attempts=4)))  # fmt: skip
  assert sum(t.score for t in perfect) >= 0.9 * len(qs_)
  two_per_hop = 0
  for q, t in zip(qs_, perfect):
    calls = [(e.name, e.argument, e.text) for e in t.tools]
    two_per_hop += t.stats()["num_search"] >= q.hops and t.stats()["num_access"] >= q.hops
    for i, (name, arg, _) in enumerate(calls):
      if name == "access":  # always a page the latest search listed (candidates: in turn)
        searches = [text for n, _, text in calls[:i] if n == "search"]
        assert searches and f"({arg})" in searches[-1] and arg.startswith(URL_PREFIX), q.id
  assert two_per_hop >= 0.9 * len(qs_)  # BM25 may list a later page of the chain by chance
  assert max(t.stats()["max_input_tokens"] for t in perfect) < lh.PAGES_AGENT.max_tokens / 2
  # The expert that does not open pages reads nothing from snippets: it falls back to opening
  # the page by name after two searches, three calls a hop.
  blind = play(ExpertConfig(max_attempts=4))
  assert all(t.stats()["num_search"] >= 2 * t.stats()["num_access"] for t in blind if t.score)


def test_snippet_expert_opens_a_page_only_where_the_snippet_hides_the_fact(tiny_world):
  """Three-sentence snippets (`SNIPPETS_AGENT`): the page-reading expert notes a hop's fact from
  the snippet when it is there and opens the page otherwise, so a solved chain takes exactly the
  calls `calls_needed` counts from the world's pages; the page world needs two a hop."""
  sw, files = tiny_world
  qs_ = {q.id: q for q in sw.questions}
  needed = report.calls_needed(qs_, files.corpus, lh.SNIPPETS_AGENT.doc_sentences)
  assert report.calls_needed(qs_, files.corpus, 0) == {i: q.hops for i, q in qs_.items()}
  assert report.calls_needed(qs_, files.corpus, 1) == {i: 2 * q.hops for i, q in qs_.items()}
  # Both kinds of hop occur: some facts are in the snippet, some only on the page.
  assert any(needed[i] < 2 * q.hops for i, q in qs_.items())
  assert any(needed[i] > q.hops for i, q in qs_.items())
  perfect = _play(tiny_world, lws.warm_start_expert(lws.LongWarmStart(
    give_up_after_hops=None, read_pages=True, max_attempts=4)), lh.SNIPPETS_AGENT)  # fmt: skip
  assert sum(t.score for t in perfect) >= 0.9 * len(qs_)
  exact = 0
  for q, t in zip(qs_.values(), perfect):
    stats = t.stats()
    exact += t.score == 1.0 and stats["num_search"] + stats["num_access"] == needed[q.id]
  # BM25 may list a later page of the chain by chance (its snippet then resolves a hop early).
  assert exact >= 0.8 * len(qs_)
  assert max(t.stats()["max_input_tokens"] for t in perfect) < lh.SNIPPETS_AGENT.max_tokens / 2


def test_plan_notes_list_the_relations_still_to_follow(tiny_world):
  """With `plan_notes`, the first turn lists the chain's relations in search order and every note
  that resolves a hop ends with the rest, so the next search's relation is the list's head."""
  qs_ = tiny_world[0].questions
  warm = lws.LongWarmStart(
    give_up_after_hops=None, read_pages=True, max_attempts=4, plan_notes=True
  )
  episodes = _play(tiny_world, lws.warm_start_expert(warm), lh.PAGES_PLAN_AGENT)
  assert sum(t.score for t in episodes) >= 0.9 * len(qs_)  # as good as without the notes
  checked = 0
  for q, t in zip(qs_, episodes):
    words = [RELATIONS[r].words for r in q.relations]
    assert f"Next: {', '.join(words)}." in t.calls[0].text
    heads = [m.group(1) for c in t.calls for m in re.finditer(r"Next: ([^,.]+)", c.text)]
    searches = [e.argument for e in t.tools if e.name == "search"]
    if not q.constraints and t.score == 1.0:
      assert heads == [*words, "answer"][: len(heads)] and heads[-1] == "answer"
      checked += 1
    for query in searches:  # every search names the relation at the head of the latest list
      assert any(query.endswith(w) or query == w for w in words) or q.constraints, query
    assert all(c.output_ids.size < lh.PAGES_PLAN_AGENT.max_new_tokens for c in t.calls)
  assert checked >= len(qs_) // 2


def with_agent(rl: TrainConfig, agent: AsearcherAgentConfig) -> TrainConfig:
  """`rl` training (and the pipeline evaluating) `agent`."""
  return dataclasses.replace(rl, agent=AgentChoice(name="asearcher", configs={"asearcher": agent}))


def test_the_page_reading_warm_start_needs_the_snippet_agent():
  with pytest.raises(AsearcherError, match=r"read_pages is True but agent\.doc_sentences is 0"):
    lh.long_horizon(warm_start_dir=None, warm=lws.LongWarmStart(read_pages=True),
                    run_dir="/nonexistent/never-written")  # fmt: skip
  with pytest.raises(AsearcherError, match=r"read_pages is False but agent\.doc_sentences is 1"):
    lh.long_horizon(warm_start_dir=None, rl=with_agent(lh.LONG_RL, lh.PAGES_AGENT),
                    run_dir="/nonexistent/x")  # fmt: skip


def test_the_warm_start_expert_gives_up_by_range_or_by_chance():
  geometric = lws.warm_start_expert(lws.LongWarmStart(give_up_after_hops=None, p_guess=0.15))
  assert geometric.p_guess == 0.15 and geometric.give_up_after_hops is None
  assert geometric.p_sloppy_query == 0.0  # imperfection 0: no other mistake
  ranged = lws.warm_start_expert(lws.LongWarmStart(give_up_after_hops=(2, 4), imperfection=0.4))
  assert ranged.give_up_after_hops == (2, 4) and ranged.p_guess == 0.25 * 0.4  # the level's
  words = lws._give_up({"give_up_after_hops": None, "p_guess": 0.15})
  assert "probability 0.15" in words and "after" not in words
  assert "after 2-4 hops" in lws._give_up({"give_up_after_hops": [2, 4]})


def test_give_up_range_is_checked():
  with pytest.raises(ValueError, match="give_up_after_hops"):
    ExpertConfig(give_up_after_hops=(3, 2))
  with pytest.raises(ValueError, match="give_up_after_hops"):
    ExpertConfig(give_up_after_hops=(0, 2))


# The SFTs on one of the test process's 8 fake devices (see test_pipeline_e2e.ONE_DEVICE).
ONE_DEVICE = MeshConfig(devices=1)


@pytest.mark.slow
def test_long_horizon_ci_size_reports_every_key(tmp_path):
  run_dir = tmp_path / "lh"
  sft_cfg = SFTConfig(steps=2, row_len=512, rows_per_batch=8, eval_every=2, checkpoint_every=2,
                      progress=False)  # fmt: skip
  shipped = tmp_path / "shipped"
  warm = lws.LongWarmStart(
    samples_per_question=1, give_up_after_hops=(2, 3), ship_to=str(shipped), copy_drills=2,
    sft=SFTStage(config=sft_cfg, optimizer=dataclasses.replace(
      WARM_START_OPTIMIZER, total_steps=2, warmup_steps=1), mesh=ONE_DEVICE),
  )  # fmt: skip
  # A 2-step warm start cannot answer: RL runs on the "smoke" reward (plumbing, not learning),
  # with the agent's limits at 3 tool calls and a 512-token engine (one prefill shape).
  common = dict(
    run_dir=str(run_dir), warm_start_dir=None, world=TINY_LONG, warm=warm,
    # Evaluated at T 0.5, RL at the default T 1.0 (ASearcher: Avg@4 at 0.6, training at 1.0).
    evaluation=qs.QuickstartEval(questions=4, k=2, concurrency=8, temperature=0.5),
    rl=dataclasses.replace(
      lh.LONG_RL, max_seconds=1.0, batch_timeout_s=300.0, reward="smoke",
      staleness=StalenessConfig(batch_groups=1, max_staleness=4, max_concurrent=2),
      engine=EngineConfig(
        max_slots=8, max_seq_len=512, prefill_buckets=(512,), suffix_buckets=(256,)
      ),
      agent=AgentChoice(name="asearcher", configs={"asearcher": dataclasses.replace(
        lh.LONG_AGENT, max_turns=7, max_tokens=512, max_new_tokens=32)}),
      rollout=dataclasses.replace(lh.LONG_RL.rollout, group_size=4),
      learner=dataclasses.replace(lh.LONG_RL.learner, ppo=dataclasses.replace(
        lh.LONG_RL.ppo(), row_len=512, short_row_lens=(256,), micro_rows=2)),
    ),
    pool=qs.SynthWikiRL(questions="train"),
    min_tool_calls=3,
  )  # fmt: skip
  with pytest.raises(AsearcherError, match="max_turns >= 61"):
    lh.long_horizon(**{**common, "min_tool_calls": 30})
  # The warm start alone: made, evaluated by hop count, given a card and shipped; no RL.
  stop = dataclasses.replace(warm, stop_after_card=True)
  assert lh.long_horizon(**{**common, "warm": stop}) == 0
  assert not (run_dir / "rl").exists()
  card = json.loads((shipped / "warm_start.json").read_text())
  assert card["command"] == f"asearcher long-horizon --gin_file {warm.recipe}"
  assert warm.recipe == "gin/experiments/long_horizon_warm_start.gin"
  assert card["data_sha256"] == card["sft_summary"]["data"]["data_sha256"]
  assert card["sft_summary"]["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1}  # ONE_DEVICE
  assert sum(v["samples"] for v in card["by_hops"].values()) == 4 * 2
  # Every evaluated episode's chain break is counted once, at a hop inside its chain.
  breaks = card["chain_breaks"]
  assert breaks["episodes"] == 4 * 2
  assert sum(breaks[k]["count"] for k in chain_breaks.KINDS) == 4 * 2
  assert all(0 <= int(h) <= 8 for k in chain_breaks.KINDS for h in breaks[k]["by_hop"])
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
    p.name for p in shipped.iterdir()
  }
  md = (shipped / "model_card.md").read_text()
  assert (
    card["data_files"]["expert_trajectories.jsonl"]
    == hashlib.sha256(
      (run_dir / "warm_start" / "expert_trajectories.jsonl").read_bytes()
    ).hexdigest()
  )
  assert "## Reproduce" in md and card["data_files"]["expert_trajectories.jsonl"] in md
  # The copy drills are an SFT input beside the expert's trajectories, named on the card.
  assert card["expert"]["copy_drills"] == 2 and "copy drills" in md
  assert card["data_files"]["copy_drills.jsonl"] in md
  assert card["sft_summary"]["data"]["trajectories"] > card["expert"]["trajectories"]
  assert str(shipped) in md  # the card's "Use" points at the shipped copy
  # The whole run resumes the warm start and reuses its evaluation (one "sft:" evaluation).
  assert lh.long_horizon(**common) == 0
  sft_evals = [c.parent for c in (run_dir / "eval").glob("*/config.json")
               if json.loads(c.read_text())["policy"].startswith("sft:")]  # fmt: skip
  assert len(sft_evals) == 1
  evals = [json.loads(c.read_text()) for c in (run_dir / "eval").glob("*/config.json")]
  assert sorted(e["policy"][:3] for e in evals) == ["rl:", "sft"]
  assert all(e["sampling"]["temperature"] == 0.5 for e in evals)
  assert card["temperature"] == 0.5
  s = json.loads((run_dir / "report" / "summary.json").read_text())
  for key in ("avg4_sft_long", "avg4_rl_long", "tool_calls_sft_long", "tool_calls_rl_long",
              "max_tool_calls_train", "wall_s", "peak_rss_mb"):  # fmt: skip
    assert key in s, key
  assert s["tool_calls_needed_long"] >= 6  # the mean hop count of the >= 6-hop questions
  assert s["rl_steps"] >= 1 and s["agent_max_turns"] >= 2 * s["min_tool_calls_allowed"] + 1
  dist = s["train_tool_calls"]
  assert dist and all(d["max"] >= d["p90"] >= 0 and d["max"] >= d["mean"] for d in dist)
  assert s["max_tool_calls_train"] == max(d["max"] for d in dist)
  assert set(s["accuracy_by_hops_sft"]) <= {str(h) for h in range(4, 9)}
  assert sum(v["samples"] for v in s["accuracy_by_hops_sft"].values()) == 4 * 2
  assert s["chain_breaks_sft"] == breaks  # the same evaluation, reused
  assert s["chain_breaks_rl"]["episodes"] == 4 * 2
  rate = s["hop_search_rate_rl"]  # None when no episode attempted a hop
  assert (rate is None) == (s["chain_breaks_rl"]["hops"]["attempted"] == 0)
  assert rate is None or 0 <= rate <= 1
  assert "Where the chains broke" in (run_dir / "report" / "long_horizon.md").read_text()
  assert s["replay_buckets"] and all(b["trained"] >= 0 for b in s["replay_buckets"].values())
  assert s["limit_hits"]["train_trajectories"] >= 4
  assert set(s["bars"]) >= {"tool_calls_rl_long>=10", "avg4_long_gain>=10pt"}
  assert s["warm_start_expert"]["trajectories"] > 0
  assert (run_dir / "report" / "long_horizon.md").read_text().startswith("# Long-horizon")
  assert (s["temperature_eval"], s["temperature_rl"]) == (0.5, 1.0)
  assert "sampled at T 0.5 (RL at T 1.0)" in (run_dir / "report" / "long_horizon.md").read_text()
  # A page-reading warm start fine-tuned from the shipped one (`init_from`): snippets in the
  # search results, the expert opens a page after its searches, SFT starts from those weights.
  pages = dataclasses.replace(
    stop, read_pages=True, max_attempts=4, init_from=str(shipped), ship_to=None, copy_drills=0
  )
  agent = dataclasses.replace(
    qs.synthwiki_agent(common["rl"]), doc_sentences=1, compact_search_results=False
  )
  pages_dir = tmp_path / "pages"
  # As on an accelerator lease: stop once the SFT has written its model, no evaluation, no card.
  pages_run = {**common, "run_dir": str(pages_dir), "rl": with_agent(common["rl"], agent)}
  assert (
    lh.long_horizon(**{**pages_run, "warm": dataclasses.replace(pages, stop_after_sft=True)}) == 0
  )
  assert (pages_dir / "warm_start" / "sft" / "model" / "model.safetensors").exists()
  assert not (pages_dir / "eval").exists()
  assert not (pages_dir / "warm_start" / "warm_start.json").exists()
  # Re-run without it, with one round of expert relabelling after the SFT (one pipeline call for
  # both, to keep the suite short): the SFT resumes at its last step (nothing trained again); the
  # model's own episodes on train questions (real engine and tools), the expert's turns where they
  # differ, a fine-tune from the SFT's model on those plus the SFT's files; the card says so and
  # evaluates the round's model.
  round_sft = SFTStage(config=sft_cfg, optimizer=dataclasses.replace(
    WARM_START_OPTIMIZER, total_steps=2, warmup_steps=1), mesh=ONE_DEVICE)  # fmt: skip
  dagger = long_dagger.DaggerStage(rounds=1, questions=3, samples=2, repeat=2, sft=round_sft)
  assert lh.long_horizon(**{**pages_run, "warm": dataclasses.replace(pages, dagger=dagger)}) == 0
  sft_summary = json.loads((pages_dir / "warm_start" / "sft" / "sft_summary.json").read_text())
  assert sft_summary["init"] == str(shipped)
  trajs = read_trajectories(pages_dir / "warm_start" / "expert_trajectories.jsonl")
  opened = [e for t in trajs for e in t.tools if e.name == "access"]
  assert opened and all(e.argument.startswith(URL_PREFIX) for e in opened)
  pages_card = json.loads((pages_dir / "warm_start" / "warm_start.json").read_text())
  assert sum(v["samples"] for v in pages_card["by_hops"].values()) == 4 * 2
  assert pages_card["init_from"] == str(shipped) and pages_card["expert"]["read_pages"]
  assert sft_summary["start_step"] == sft_cfg.steps  # resumed: nothing trained again
  pages_md = (pages_dir / "warm_start" / "model_card.md").read_text()
  assert f"from `{shipped}`" in pages_md and "the page it found per hop" in pages_md
  # The relabelling round.
  r0 = pages_dir / "warm_start" / "dagger0"
  assert len((r0 / "questions.jsonl").read_text().splitlines()) == 3
  episodes = long_dagger.episodes(r0 / "episodes")
  train_ids = {q.id for q in build_synthwiki(TINY_LONG).train}
  assert len(episodes) == 3 * 2 and {t.qid for t in episodes} <= train_ids
  stats = json.loads((r0 / "relabel.json").read_text())
  assert stats["policy_episodes"] == 6
  assert stats["act"]["calls"] == sum(c.kind == "act" for t in episodes for c in t.calls)
  fixed = read_trajectories(r0 / "corrections.jsonl")
  assert len(fixed) == stats["episodes"] and sum(len(t.calls) for t in fixed) == (
    stats["corrections"]
  )  # fmt: skip
  assert stats["corrections"] == stats["act"]["differ"] + stats["read"]["differ"]
  round_summary = json.loads((r0 / "sft" / "sft_summary.json").read_text())
  assert round_summary["init"] == str(pages_dir / "warm_start" / "sft" / "model")
  assert round_summary["data"]["trajectories"] == len(trajs) + 2 * len(fixed)  # repeated twice
  dagger_card = json.loads((pages_dir / "warm_start" / "warm_start.json").read_text())
  assert dagger_card["dagger"]["rounds"] == 1 and dagger_card["dagger"]["relabel"] == [stats]
  assert (
    "round(s) of expert relabelling" in (pages_dir / "warm_start" / "model_card.md").read_text()
  )


def test_limit_counters_add_up_over_the_lives_of_a_resumed_run():
  # Life 1 logs steps 1-3 (counter 2, 5, 7) and is killed after its step-2 checkpoint; life 2
  # restores step 2, logs steps 3-4 from 0 again (1, 4); life 3 resumes after step 4's checkpoint.
  key = "rollout/turn_limit_trajectories"
  rows = [
    {"step": 1, key: 2}, {"step": 2, key: 5}, {"step": 3, key: 7}, {"step": 3, "eval/x": 1.0},
    {"step": 3, key: 1}, {"step": 4, key: 4}, {"step": 5, key: 2}, {"step": 6, key: 3},
  ]  # fmt: skip
  assert report.run_total(rows, key) == 7 + 4 + 3
  assert report.run_total(rows[:3], key) == 7  # one life: its last value
  assert report.run_total([], key) == 0.0


def test_the_warm_start_card_names_the_worlds_chain_lengths():
  """The card's world line is read from the world's config, not written for the default one."""
  assert lws._hop_range(dataclasses.asdict(lh.LONG_WORLD)) == "4-12"
  assert lws._hop_range(dataclasses.asdict(lh.LONGER_WORLD)) == "4-16"
  assert lws._hop_range({"questions_per_hop": (0, 5, 0, 3)}) == "2-4"
