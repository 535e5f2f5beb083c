"""The quickstart's stage display (order, ETA from measured speed), report helpers, and the RL
question pool."""

from __future__ import annotations

import io
import json

import pytest

from asearcher_jax.apps import quickstart as pipeline
from asearcher_jax.apps import quickstart_report as report
from asearcher_jax.apps.stages import PRIOR_S, StageTracker
from asearcher_jax.apps.world import WorldFiles
from asearcher_jax.data.qa import load_qa_file
from asearcher_jax.errors import AsearcherError


def test_stages_run_in_order_and_eta_rescales_by_measured_speed(monkeypatch):
  now = [0.0]
  monkeypatch.setattr("asearcher_jax.apps.stages.time.perf_counter", lambda: now[0])
  out = io.StringIO()
  tracker = StageTracker([("a", 5.0), ("b", 20.0)], stream=out, rich=False)
  with pytest.raises(ValueError, match="out of order"), tracker.stage("b"):
    pass
  with tracker.stage("a"):
    now[0] = 10.0  # took 10 s for an estimate of 5: slower than estimated
  assert tracker.timings() == {"a": 10.0}
  speed = (10.0 + PRIOR_S) / (5.0 + PRIOR_S)  # measured 2x, shrunk towards 1 by the prior
  assert tracker.eta_s() == pytest.approx(20.0 * speed)  # b's 20 s estimate, rescaled
  with tracker.stage("b") as st:
    st.update(0.5)
    assert tracker.eta_s(st) == pytest.approx(10.0 * speed)
  lines = out.getvalue().splitlines()
  assert lines[0].startswith("[quickstart [1/2] a]") and "ETA" in lines[0]
  assert any("[2/2] b" in x and "50%" in x for x in lines)
  rss = tracker.peak_rss()  # the process's peak so far, recorded as each stage ended
  assert list(rss) == ["a", "b"] and 0 < rss["a"] <= rss["b"]


def test_metrics_curves_windows_and_plots(tmp_path):
  log = tmp_path / "metrics.jsonl"
  rows = [{"step": s, "time": 0.0, "rollout/tool_calls": float(s), "rollout/reward": 0.1 * s}
          for s in range(1, 9)]  # fmt: skip
  rows.append({"step": 8, "time": 1.0, "rollout/tool_calls": 10.0})  # a resumed step wins
  log.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  got = report.read_metrics(log)
  assert [r["step"] for r in got] == list(range(1, 9))
  curves = report.curves(got)
  assert curves["rollout/tool_calls"][-1] == (8, 10.0)
  assert report.window_mean(curves["rollout/tool_calls"], first=True) == 1.5  # steps 1-2
  assert report.window_mean(curves["rollout/tool_calls"], first=False) == 8.5  # steps 7-8
  paths = report.write_plots(curves, tmp_path / "plots")
  assert [p.name for p in paths] == ["training.png"]  # one figure, no per-curve duplicates
  assert paths[0].read_bytes()[:4] == b"\x89PNG"


def test_rl_pool_heldout_excludes_training_and_evaluated_questions(tmp_path):
  def write(name: str, n: int) -> None:
    rows = [{"id": f"{name}-{i}", "question": f"{name} question {i}?", "answer": str(i),
             "kind": "chain", "hops": 1 + i % 2} for i in range(n)]  # fmt: skip
    (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

  write("train", 5)
  write("test", 7)
  files = WorldFiles(
    root=tmp_path, corpus=tmp_path / "c", train=tmp_path / "train.jsonl",
    test=tmp_path / "test.jsonl", tokenizer=tmp_path / "t", index=tmp_path / "i", digest="",
  )  # fmt: skip
  evaluated = {e.question for e in load_qa_file(files.test, name="t")[:3]}  # what evaluate reads
  pool = pipeline.rl_pool(files, "heldout", 3)
  assert [i.question for i in pool] == [f"test question {i}?" for i in range(3, 7)]
  assert not evaluated & {i.question for i in pool}
  assert len(pipeline.rl_pool(files, "train", 3)) == 5  # the whole train split
  with pytest.raises(AsearcherError, match="beyond the evaluated"):
    pipeline.rl_pool(files, "heldout", 7)
  with pytest.raises(AsearcherError, match="beyond the evaluated"):
    pipeline.rl_pool(files, "heldout", None)
  with pytest.raises(AsearcherError, match="'heldout' or 'train'"):
    pipeline.rl_pool(files, "test", 3)
  # Only some kinds of questions (here the 1-hop chains: test-4, test-6).
  one_hop = pipeline.rl_pool(files, "heldout", 3, kinds=("chain-1",))
  assert [i.id for i in one_hop] == ["test-4", "test-6"]
  with pytest.raises(AsearcherError, match=r"no RL question of kinds.*chain-2"):
    pipeline.rl_pool(files, "heldout", 3, kinds=("chain-9",))


def test_ship_copies_the_model_and_points_its_card_at_the_copy(tmp_path):
  from asearcher_jax.apps.warm_start import ship

  out, model, dest = tmp_path / "run", tmp_path / "run" / "sft" / "model", tmp_path / "assets"
  model.mkdir(parents=True)
  for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
    (model / name).write_text(name)
  (model / "optimizer_state.bin").write_text("not shipped")
  (out / "warm_start.json").write_text("{}")
  (out / "model_card.md").write_text(
    f"""asearcher train --gin_param='commands.train.model_dir="{model}"'\n"""
  )
  ship(model, out, dest)
  assert sorted(p.name for p in dest.iterdir()) == [
    "config.json", "model.safetensors", "model_card.md", "tokenizer.json",
    "tokenizer_config.json", "warm_start.json",
  ]  # fmt: skip
  card = (dest / "model_card.md").read_text()
  assert f'model_dir="{dest}"' in card and str(model) not in card


def test_the_evaluation_samples_at_its_own_temperature_or_the_rl_one():
  assert pipeline.QuickstartEval().eval_temperature(1.0) == 1.0
  assert pipeline.QuickstartEval(temperature=0.6).eval_temperature(1.0) == 0.6
  assert pipeline.QuickstartEval(temperature=0.0).eval_temperature(1.0) == 0.0  # greedy
  with pytest.raises(AsearcherError, match=r"QuickstartEval\.temperature must be >= 0"):
    pipeline.QuickstartEval(temperature=-0.1)


def test_hop_credit_rewards_the_hops_of_a_chain_searched_right():
  import numpy as np

  from asearcher_jax.agent.trajectory import LLMCall, Trajectory
  from asearcher_jax.synthwiki.questions import SynthQuestion

  chain = SynthQuestion(
    id="q1", question="?", answer="1200", kind="chain", hops=3, start="Ana", start_type="person",
    relations=("mentor", "born_in", "population"), bridges=("Bo", "Kel", "1200"),
  )  # fmt: skip

  def episode(qid, *actions, pred="Zed"):
    calls = [
      LLMCall(index=i, kind="act", input_ids=np.zeros(2, np.int32), output_ids=np.ones(1, np.int32),
              logprobs=np.zeros(1, np.float32), versions=np.zeros(1, np.int32), stop_reason="stop",
              max_new_tokens=8, text=a, action=a)
      for i, a in enumerate(actions)
    ]  # fmt: skip
    return Trajectory(agent="t", question="?", qid=qid, answers=["1200"], pred_answer=pred,
                      calls=calls)  # fmt: skip

  score = pipeline.hop_credit_scorer([chain], 0.5)
  two_right = episode("q1", "<search> Ana trained by </search>", "<search> Bo born in </search>",
                      "<search> Kel trained by </search>", "<answer> Zed </answer>")  # fmt: skip
  solved = episode("q1", "<search> Ana trained by </search>", "<search> Bo born in </search>",
                   "<search> Kel population </search>", "<answer>1200</answer>", pred="1200")  # fmt: skip
  unknown = episode("q9", "<answer>1200</answer>", pred="1200")  # not a world question
  assert score([two_right, solved, unknown]) == pytest.approx([0.5 * 2 / 3, 1.0, 0.5])
  assert pipeline.SynthWikiRL().hop_credit == 0.0  # the ASearcher reward by default
  with pytest.raises(AsearcherError, match=r"SynthWikiRL\.hop_credit must be in \[0, 1\)"):
    pipeline.SynthWikiRL(hop_credit=1.0)
  with pytest.raises(AsearcherError, match="prefix_hops"):
    pipeline.SynthWikiRL(hop_credit=0.3, prefix_hops=(1, 2))
