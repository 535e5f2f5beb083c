"""Off-policy corrections under staleness: held-out Avg@4 and trainer-sampler agreement for
eta (max staleness) = 0, 4 and 16 under decoupled PPO (the default), token-level truncated IS
and IcePop masking, over 3 seeds. No arguments; ~20 minutes on 2 busy CPU cores. The last line
is one JSON object ("summary": per eta and correction, over the seeds; "runs": each run).

Workload (a CPU-sized stand-in for the quickstart's RL stage, whose episodes take minutes each):
  policy    a random 2-layer model (hidden 64, vocabulary 101), sampled at temperature 1 by the
            in-process engine (fixed-slot cache, float32); every sampled token and behaviour
            logprob is the engine's.
  task      a prompt of 6 random tokens; the reward is the fraction of the 8 generated tokens
            that are multiples of 4 (chance 0.25; a prompt-dependent target, the parity of the
            prompt's first token, did not move from chance in 60 steps of this model). Groups
            of n = 4 samples, B = 4 groups per step, GRPO advantages (reward minus the group
            mean), 30 steps, AdamW at 3e-3 (mid-curve: 1e-2 for 60 steps saturates at 1.0).
  staleness every group of step v is sampled by the weights of version v - s, s drawn uniformly
            from [0, eta] (the spread an async run with bound eta holds): the real engine swaps
            to the stored weights of that version before sampling it, the real learner trains.
  held-out  32 prompts never trained on, 4 samples each at temperature 1 with the final weights:
            Avg@4 = the mean reward over the 4 samples, averaged over the prompts (the same
            prompts and seeds for every run; "avg4_init" is the initial policies' mean).
  agreement the learner's per-step `ppo/agree_*` (tokens of the version being trained, from its
            proximal pass): mean |logp_engine - logp_learner| weighted by tokens, the max, the k3
            KL and the fraction of ratios outside [0.5, 2].
Corrections: decoupled (mask w > 5), tis_token (c = min(w, 2)), icepop (mask outside [0.5, 5]).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax
from flax import nnx

from asearcher_jax.model import steps, transformer
from asearcher_jax.model.config import ModelConfig
from asearcher_jax.rl.learner import Learner, PPOConfig
from asearcher_jax.rl.losses import OffPolicyConfig
from asearcher_jax.rl.replay import Group
from asearcher_jax.serving.driver import Driver, DriverConfig
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.serving.types import SamplingParams
from asearcher_jax.tokenizer import Tokenizer

VOCAB = 101
PROMPT_LEN = 6
GEN = 8
N = 4  # samples per group
B = 4  # groups per step
STEPS = 30
HELD_OUT = 32
ETAS = (0, 4, 16)
SEEDS = (0, 1, 2)  # model init, prompts and staleness draws; one seed's spread is ~0.03 Avg@4
CORRECTIONS = {
  "decoupled": OffPolicyConfig(),
  "tis_token": OffPolicyConfig(kind="tis_token", cap=2.0),
  "icepop": OffPolicyConfig(kind="icepop", cap=5.0, floor=0.5),
}
REQUEST_TIMEOUT_S = 120.0


def reward(prompt: list[int], tokens: list[int]) -> float:
  del prompt  # the same target after every prompt
  return float(np.mean([t % 4 == 0 for t in tokens]))


def prompts_of(rng: np.random.Generator, n: int) -> list[list[int]]:
  return [list(map(int, rng.integers(1, VOCAB, PROMPT_LEN))) for _ in range(n)]


async def sample(driver: Driver, prompts: list[list[int]], seed: int) -> list:
  calls = [
    driver.generate(p, SamplingParams(temperature=1.0, seed=seed + i), GEN, stop_token_ids=())
    for i, p in enumerate(prompts)
  ]
  return await asyncio.wait_for(asyncio.gather(*calls), REQUEST_TIMEOUT_S)


async def avg_at_4(driver: Driver, held_out: list[list[int]]) -> float:
  prompts = [p for p in held_out for _ in range(4)]
  results = await sample(driver, prompts, seed=10**6)
  return float(np.mean([reward(p, r.tokens) for p, r in zip(prompts, results, strict=True)]))


def group_of(prompt: list[int], results: list, gid: str, version: int) -> Group:
  rewards = np.array([reward(prompt, r.tokens) for r in results])
  trajs = [
    [{
      "tokens": np.asarray(prompt + r.tokens, np.int32),
      "loss_mask": np.asarray([0] * len(prompt) + [1] * len(r.tokens), np.int32),
      "logprobs": np.asarray([0.0] * len(prompt) + list(r.logprobs), np.float32),
      "versions": np.asarray([-1] * len(prompt) + list(r.versions), np.int32),
    }]
    for r in results
  ]  # fmt: skip
  return Group(group_id=gid, trajectories=trajs, advantages=list(rewards - rewards.mean()),
               created_version=version)  # fmt: skip


async def run(
  driver: Driver, init, eta: int, correction: OffPolicyConfig, held_out, seed: int
) -> dict:
  graphdef, params = init
  learner = Learner(
    graphdef, jax.tree.map(lambda x: x.copy(), params),
    ppo=PPOConfig(row_len=32, temperature=1.0, off_policy=correction),
    optimizer=steps.OptimizerConfig(learning_rate=3e-3, weight_decay=0.0),
  )  # fmt: skip
  history = {0: jax.tree.map(lambda x: x.copy(), params)}
  rng = np.random.default_rng(seed)  # the same prompts and staleness draws for every correction
  t0 = time.perf_counter()
  per_step, rewards = [], []
  for v in range(STEPS):
    lags = rng.integers(0, eta + 1, B)
    prompts = prompts_of(rng, B)
    groups = []
    for version in sorted({max(0, v - int(s)) for s in lags}):
      # Nothing is in flight between groups: a reset to an older version recomputes nothing.
      driver.update_params(history[version], version, recompute=True)
      mine = [i for i in range(B) if max(0, v - int(lags[i])) == version]
      results = await sample(driver, [prompts[i] for i in mine for _ in range(N)], seed=v * 100)
      for j, i in enumerate(mine):
        groups.append(group_of(prompts[i], results[j * N : (j + 1) * N], f"{v}/{i}", version))
        rewards.extend(reward(prompts[i], r.tokens) for r in results[j * N : (j + 1) * N])
    per_step.append(learner.train_step(groups))
    history[learner.version] = learner.params_copy()
    history.pop(learner.version - eta - 1, None)
  driver.update_params(history[learner.version], learner.version, recompute=True)
  avg4 = await avg_at_4(driver, held_out)
  toks = np.array([m.get("ppo/agree_tokens", 0.0) for m in per_step])
  mean_of = lambda k: float(  # noqa: E731
    np.dot([m.get(k, 0.0) for m in per_step], toks) / max(toks.sum(), 1.0)
  )
  return {
    "eta": eta,
    "correction": correction.kind,
    "seed": seed,
    "avg4_heldout": round(avg4, 4),
    "train_reward_last10": round(float(np.mean(rewards[-10 * B * N :])), 4),
    "agreement": {
      "tag": "fixed.float32",
      "tokens": int(toks.sum()),
      "abs_mean": mean_of("ppo/agree_abs_mean"),
      "abs_max": float(max(m.get("ppo/agree_abs_max", 0.0) for m in per_step)),
      "kl_k3": mean_of("ppo/agree_kl_k3"),
      "out_frac": mean_of("ppo/agree_out_frac"),
    },
    "imp_weight_max": float(max(m["ppo/imp_weight_max"] for m in per_step)),
    "masked_frac_mean": float(np.mean([m["ppo/cap_masked_frac"] for m in per_step])),
    "staleness_max": float(max(m.get("staleness/token_max", 0.0) for m in per_step)),
    "wall_s": round(time.perf_counter() - t0, 1),
  }


def summary(runs: list[dict]) -> list[dict]:
  """Per (eta, correction): Avg@4 mean and per seed, the agreement over all seeds' steps."""
  out = []
  for eta in ETAS:
    for name in CORRECTIONS:
      rs = [r for r in runs if r["eta"] == eta and r["correction"] == CORRECTIONS[name].kind]
      toks = sum(r["agreement"]["tokens"] for r in rs)
      out.append({
        "eta": eta, "correction": name,
        "avg4_heldout": round(float(np.mean([r["avg4_heldout"] for r in rs])), 4),
        "avg4_per_seed": [r["avg4_heldout"] for r in rs],
        "train_reward_last10": round(float(np.mean([r["train_reward_last10"] for r in rs])), 4),
        "masked_frac_mean": float(np.mean([r["masked_frac_mean"] for r in rs])),
        "imp_weight_max": max(r["imp_weight_max"] for r in rs),
        "agreement": {
          "tag": "fixed.float32", "tokens": toks,
          "abs_mean": sum(r["agreement"]["abs_mean"] * r["agreement"]["tokens"] for r in rs)
          / max(toks, 1),
          "abs_max": max(r["agreement"]["abs_max"] for r in rs),
          "kl_k3": sum(r["agreement"]["kl_k3"] * r["agreement"]["tokens"] for r in rs)
          / max(toks, 1),
          "out_frac": sum(r["agreement"]["out_frac"] * r["agreement"]["tokens"] for r in rs)
          / max(toks, 1),
        },
      })  # fmt: skip
  return out


async def main() -> dict:
  cfg = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, rope_theta=10000.0)  # fmt: skip
  tokenizer = Tokenizer.qwen2()
  held_out = prompts_of(np.random.default_rng(12345), HELD_OUT)
  t0 = time.perf_counter()
  runs, avg4_init = [], []
  for seed in SEEDS:
    model = transformer.Transformer(cfg, rngs=nnx.Rngs(seed))
    init = nnx.split(model)
    engine = Engine.from_model(
      model, tokenizer,
      EngineConfig(max_slots=16, max_seq_len=32, prefill_buckets=(8,), decode_rows=(16,)),
    )  # fmt: skip
    driver = Driver(engine, DriverConfig(request_timeout_s=REQUEST_TIMEOUT_S))
    try:
      avg4_init.append(await avg_at_4(driver, held_out))
      for eta in ETAS:
        for name, correction in CORRECTIONS.items():
          r = await run(driver, init, eta, correction, held_out, seed)
          print(f"seed={seed} eta={eta} {name}: {json.dumps(r)}", flush=True)
          runs.append(r)
    finally:
      driver.close()
  return {
    "benchmark": "off_policy",
    "steps": STEPS, "groups_per_step": B, "samples_per_group": N, "heldout_prompts": HELD_OUT,
    "seeds": list(SEEDS), "avg4_init": round(float(np.mean(avg4_init)), 4),
    "summary": summary(runs), "runs": runs, "wall_s": round(time.perf_counter() - t0, 1),
  }  # fmt: skip


if __name__ == "__main__":
  print(json.dumps(asyncio.run(main())))
