"""The OpenAI facade over the driver: shapes, exact tokens, bad requests, engine failures, and the
official `openai` client against it."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from flax import nnx

from asearcher_jax.model import transformer
from asearcher_jax.serving.driver import Driver
from asearcher_jax.serving.engine import Engine, EngineConfig
from asearcher_jax.serving.openai_api import OpenAIServer, OpenAIServerConfig
from asearcher_jax.serving.types import SamplingParams
from tests.model.test_model import small_cfg

FULL_VOCAB = 151936  # the Qwen embedding size: every id the tokenizer produces is valid
MAX_SEQ_LEN = 64
T = 60  # seconds: bound on every await below


@pytest.fixture(scope="module")
def driver(tokenizer):
  """One driver for the module, so the engine compiles once (drivers serve any event loop)."""
  model = transformer.Transformer(small_cfg(vocab_size=FULL_VOCAB), rngs=nnx.Rngs(4))
  engine = Engine.from_model(
    model,
    tokenizer,
    EngineConfig(max_slots=4, max_seq_len=MAX_SEQ_LEN, prefill_buckets=(16, 32)),
  )
  d = Driver(engine)
  yield d
  d.close()


@pytest.fixture
async def api(driver):
  server = OpenAIServer(driver, OpenAIServerConfig(port=0, max_body_bytes=64 << 10))
  port = await asyncio.wait_for(server.start(), T)
  yield server, f"http://127.0.0.1:{port}"
  await asyncio.wait_for(server.stop(), T)


async def post(url: str, body, *, raw: bool = False) -> tuple[int, dict]:
  async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=T)) as s:
    kw = {"data": body} if raw else {"json": body}
    async with s.post(url, **kw) as r:
      return r.status, await r.json(content_type=None)


PROMPT = [9, 3, 88, 31, 2, 40, 76, 61]


async def test_token_prompt_returns_exact_tokens_logprobs_and_versions(api, driver, tokenizer):
  _, url = api
  status, out = await post(
    f"{url}/v1/completions",
    {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0, "stop_token_ids": []},
  )
  assert status == 200, out
  ref = await asyncio.wait_for(
    driver.generate(PROMPT, SamplingParams(temperature=0.0), 8, stop_token_ids=()), T
  )
  assert out["object"] == "text_completion" and len(out["choices"]) == 1
  (choice,) = out["choices"]
  ext = choice["asearcher"]
  assert ext["token_ids"] == ref.tokens and ext["versions"] == [0] * 8
  assert ext["logprobs"] == pytest.approx(ref.logprobs, abs=1e-5)
  assert ext["prompt_token_ids"] == PROMPT
  assert choice["finish_reason"] == "length" and choice["index"] == 0
  assert choice["text"] == tokenizer.decode(ref.tokens)
  lp = choice["logprobs"]
  assert lp["token_logprobs"] == pytest.approx(ref.logprobs, abs=1e-5)
  assert "".join(lp["tokens"]) == choice["text"] and len(lp["text_offset"]) == 8
  assert out["usage"] == {"prompt_tokens": 8, "completion_tokens": 8, "total_tokens": 16}


async def test_prompt_lists_n_seeds_and_stop_strings(api, tokenizer):
  _, url = api
  body = {"prompt": ["Hello there", [5, 17, 42]], "n": 2, "max_tokens": 6, "seed": 7}
  status, a = await post(f"{url}/v1/completions", body)
  assert status == 200, a
  _, b = await post(f"{url}/v1/completions", body)
  assert [c["index"] for c in a["choices"]] == [0, 1, 2, 3]
  prompts = [c["asearcher"]["prompt_token_ids"] for c in a["choices"]]
  assert prompts == [tokenizer.encode("Hello there")] * 2 + [[5, 17, 42]] * 2
  tokens = [c["asearcher"]["token_ids"] for c in a["choices"]]
  assert tokens == [c["asearcher"]["token_ids"] for c in b["choices"]]  # seeded: reproducible
  assert tokens[0] != tokens[1]  # choice j samples with seed + j
  assert a["usage"]["prompt_tokens"] == len(prompts[0]) + 3  # each prompt counted once

  # A stop string ends the text before it; the extension keeps the tokens verbatim.
  _, greedy = await post(
    f"{url}/v1/completions",
    {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "stop_token_ids": []},
  )
  full_ids = greedy["choices"][0]["asearcher"]["token_ids"]
  full = greedy["choices"][0]["text"]
  stop = next(
    s for i in range(2, 8) if (s := tokenizer.decode(full_ids[i : i + 1]).strip()) and s in full
  )
  _, cut = await post(
    f"{url}/v1/completions",
    {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "stop": [stop], "stop_token_ids": []},
  )
  (c,) = cut["choices"]
  assert c["finish_reason"] == "stop"
  assert c["text"] == full[: full.find(stop)]
  ids = c["asearcher"]["token_ids"]
  assert ids == full_ids[: len(ids)] and stop in tokenizer.decode(ids)


async def test_chat_completion_applies_the_template(api, tokenizer):
  _, url = api
  messages = [{"role": "user", "content": "What is 2+2?"}]
  status, out = await post(
    f"{url}/v1/chat/completions",
    {"messages": messages, "max_tokens": 5, "temperature": 0, "logprobs": True},
  )
  assert status == 200, out
  assert out["object"] == "chat.completion"
  (c,) = out["choices"]
  assert c["asearcher"]["prompt_token_ids"] == tokenizer.encode_chat(messages)
  assert c["message"]["role"] == "assistant"
  ids = c["asearcher"]["token_ids"]
  kept = ids[:-1] if c["finish_reason"] == "stop" else ids
  assert c["message"]["content"] == tokenizer.decode(kept)
  content = c["logprobs"]["content"]
  assert [e["logprob"] for e in content] == pytest.approx(c["asearcher"]["logprobs"][: len(kept)])
  assert b"".join(bytes(e["bytes"]) for e in content).decode(
    "utf-8", "replace"
  ) == tokenizer.decode(kept)


@pytest.mark.parametrize(
  "body, fragment",
  [
    ("{not json", "malformed JSON"),
    ("[1, 2]", "JSON object"),
    ({"prompt": 5}, "'prompt'"),
    ({"prompt": []}, "'prompt'"),
    ({"prompt": [1, "a"]}, "'prompt'"),
    ({"prompt": "hi", "temperature": "hot"}, "'temperature'"),
    ({"prompt": "hi", "temperature": -0.5}, "'temperature'"),
    ({"prompt": "hi", "n": 0}, "'n'"),
    ({"prompt": "hi", "max_tokens": 0}, "'max_tokens'"),
    ({"prompt": "hi", "top_p": 0}, "'top_p'"),
    ({"prompt": "hi", "stream": "yes"}, "'stream'"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "logprobs": 6}, "'logprobs' must be an integer in [0, 5]"),
    ({"prompt": "hi", "frobnicate": 1}, "unsupported fields: frobnicate"),
    ({"prompt": [FULL_VOCAB + 5]}, "token ids"),
    ({"prompt": list(range(1, 80))}, "does not fit the context (max_seq_len=64)"),
    ({"prompt": "hi", "n": 300}, "too many generations"),
  ],
)
async def test_bad_completion_requests_are_400_with_an_openai_error(api, body, fragment):
  _, url = api
  raw = isinstance(body, str)
  status, out = await post(f"{url}/v1/completions", body, raw=raw)
  assert status == 400, out
  assert out["error"]["type"] == "invalid_request_error"
  assert fragment in out["error"]["message"]


async def test_bad_chat_requests_oversized_bodies_and_health(api):
  server, url = api
  for body in (
    {"messages": []},
    {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},  # without logprobs
    {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
  ):
    status, out = await post(f"{url}/v1/chat/completions", body)
    assert status == 400 and out["error"]["message"], (body, out)
  status, out = await post(f"{url}/v1/completions", json.dumps({"prompt": "x" * 100_000}), raw=True)
  assert status == 413 and "error" in out
  async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=T)) as s:
    async with s.get(f"{url}/health") as r:
      health = await r.json()
    async with s.get(f"{url}/v1/models") as r:
      models = await r.json()
    async with s.get(f"{url}/v1/completions") as r:  # aiohttp's own statuses are JSON too
      assert r.status == 405 and "GET /v1/completions" in (await r.json())["error"]["message"]
    async with s.post(f"{url}/v1/nowhere", json={}) as r:
      assert r.status == 404 and (await r.json())["error"]["code"] == 404
  assert health["status"] == "ok" and health["requests"]["bad_request"] >= 5
  assert models["data"][0]["id"] == server.config.model_name
  assert models["data"][0]["max_model_len"] == MAX_SEQ_LEN


async def test_engine_failure_is_a_500_with_the_reason_and_serving_goes_on(api, driver):
  _, url = api
  engine = driver.engine
  real = engine.generate

  def broken(*args, **kwargs):
    engine.generate = real  # fail one step only
    raise RuntimeError("injected device failure")

  engine.generate = broken
  try:
    status, out = await post(f"{url}/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
  finally:
    engine.generate = real
  assert status == 500 and "injected device failure" in out["error"]["message"]
  assert out["error"]["type"] == "engine_error"
  status, out = await post(f"{url}/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
  assert status == 200 and len(out["choices"][0]["asearcher"]["token_ids"]) == 4


async def test_official_openai_client(api, tokenizer):
  _, url = api
  client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=T, max_retries=0)
  try:
    comp = await client.completions.create(
      model="asearcher-policy",
      prompt="The capital of France is",
      max_tokens=6,
      logprobs=0,
      stop=["\n\n"],
      n=2,
      seed=3,
    )
    assert len(comp.choices) == 2 and comp.usage.completion_tokens >= 2
    for choice in comp.choices:
      ext = choice.model_extra["asearcher"]
      ids = ext["token_ids"]
      assert 1 <= len(ids) <= 6 and choice.finish_reason in ("stop", "length")
      kept = ids[:-1] if ids[-1] in tokenizer.stop_token_ids else ids
      text = tokenizer.decode(kept)
      assert choice.text == text[: text.find("\n\n")] if "\n\n" in text else choice.text == text
      assert choice.logprobs.token_logprobs == pytest.approx(ext["logprobs"][: len(kept)])
    chat = await client.chat.completions.create(
      model="asearcher-policy",
      messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
      max_tokens=5,
      temperature=0,
      logprobs=True,
    )
    (choice,) = chat.choices
    ext = choice.model_extra["asearcher"]
    kept = ext["token_ids"][:-1] if choice.finish_reason == "stop" else ext["token_ids"]
    assert choice.message.content == tokenizer.decode(kept)
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(
      ext["logprobs"][: len(kept)]
    )
    models = await client.models.list()
    assert [m.id for m in models.data] == ["asearcher-policy"]
    with pytest.raises(openai.BadRequestError, match="does not fit the context"):
      await client.completions.create(
        model="asearcher-policy", prompt=list(range(1, 90)), max_tokens=2
      )
  finally:
    await client.close()


async def test_streaming_with_the_official_client_concatenates_to_the_same_text(api, tokenizer):
  """Completions and chat, streamed and not, for the same seed: the deltas concatenate to the
  non-streaming text; the last chunk of a choice has its finish_reason and the extension; with
  include_usage a last chunk carries the usage."""
  _, url = api
  client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=T, max_retries=0)
  try:
    kw = {"model": "asearcher-policy", "prompt": "Once upon a time", "max_tokens": 12, "seed": 5,
          "n": 2, "temperature": 1.0}  # fmt: skip
    whole = await client.completions.create(**kw)
    stream = await client.completions.create(
      **kw, stream=True, stream_options={"include_usage": True}
    )
    texts, finish, ext, chunks, usage = ["", ""], [None, None], [None, None], 0, None
    async for ch in stream:
      chunks += 1
      if ch.usage is not None:
        usage = ch.usage
      for c in ch.choices:
        texts[c.index] += c.text
        if c.finish_reason is not None:
          finish[c.index] = c.finish_reason
          ext[c.index] = c.model_extra["asearcher"]
    assert chunks > 3  # streamed, not one answer in one event
    for i in range(2):
      assert texts[i] == whole.choices[i].text and finish[i] == whole.choices[i].finish_reason
      assert ext[i]["token_ids"] == whole.choices[i].model_extra["asearcher"]["token_ids"]
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert texts[0] != texts[1]  # seed + i per choice, streamed too

    messages = [{"role": "user", "content": "Tell me a story."}]
    chat = await client.chat.completions.create(
      model="asearcher-policy", messages=messages, max_tokens=10, seed=11, temperature=1.0
    )
    pieces, roles, last = [], [], None
    async for ch in await client.chat.completions.create(
      model="asearcher-policy", messages=messages, max_tokens=10, seed=11, temperature=1.0,
      stream=True,
    ):  # fmt: skip
      for c in ch.choices:
        roles += [c.delta.role] if c.delta.role else []
        pieces.append(c.delta.content or "")
        last = c
    assert roles == ["assistant"]
    assert "".join(pieces) == chat.choices[0].message.content
    assert last.finish_reason == chat.choices[0].finish_reason
    assert (
      last.model_extra["asearcher"]["token_ids"]
      == (chat.choices[0].model_extra["asearcher"]["token_ids"])
    )
  finally:
    await client.close()


@pytest.mark.slow
async def test_top_logprobs_with_the_official_client(api, tokenizer):
  """logprobs=3 (completions) and top_logprobs=3 (chat), greedy: the chosen token's logprob is
  the extension's, its alternatives are sorted and none is above it (it is the argmax)."""
  _, url = api
  client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=T, max_retries=0)
  try:
    comp = await client.completions.create(
      model="asearcher-policy", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3
    )
    (choice,) = comp.choices
    ext = choice.model_extra["asearcher"]
    lp = choice.logprobs
    assert lp.token_logprobs == pytest.approx(ext["logprobs"][: len(lp.tokens)], abs=1e-6)
    assert len(lp.top_logprobs) == len(lp.tokens) >= 1
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
      values = list(top.values())
      assert 1 <= len(top) <= 3 and values == sorted(values, reverse=True)
      assert all(v <= chosen + 1e-6 for v in values)
      assert top.get(token) == pytest.approx(chosen, abs=1e-6)  # greedy: it is the best
    chat = await client.chat.completions.create(
      model="asearcher-policy", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
      temperature=0, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    (choice,) = chat.choices
    ext = choice.model_extra["asearcher"]
    content = choice.logprobs.content
    assert [e.logprob for e in content] == pytest.approx(ext["logprobs"][: len(content)], abs=1e-6)
    for e, token_id in zip(content, ext["token_ids"], strict=False):
      alts = [a.logprob for a in e.top_logprobs]
      assert len(alts) == 3 and alts == sorted(alts, reverse=True)
      assert alts[0] == pytest.approx(e.logprob, abs=1e-6) and e.top_logprobs[0].token == e.token
      assert tokenizer.decode([token_id]) == e.token
    # Sampled (temperature 1, every token drawn): the chosen logprob still equals the extension's
    # and the alternatives are the most likely tokens of the same distribution.
    sampled = await client.completions.create(
      model="asearcher-policy", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=2, logprobs=2
    )
    lp = sampled.choices[0].logprobs
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
      assert max(top.values()) >= chosen - 1e-6 and len(top) <= 2
  finally:
    await client.close()


async def test_unknown_model_is_404_and_the_served_name_is_configurable(driver):
  server = OpenAIServer(driver, OpenAIServerConfig(port=0, model_name="my-policy"))
  port = await asyncio.wait_for(server.start(), T)
  client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=T,
                              max_retries=0)  # fmt: skip
  try:
    with pytest.raises(openai.NotFoundError, match="gpt-4") as e:
      await client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
      await client.chat.completions.create(
        model="asearcher-policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2
      )
    ok = await client.completions.create(model="my-policy", prompt="hi", max_tokens=2)
    assert ok.model == "my-policy"
    assert [m.id for m in (await client.models.list()).data] == ["my-policy"]
    status, out = await post(f"http://127.0.0.1:{port}/v1/completions",
                             {"prompt": "hi", "max_tokens": 2})  # fmt: skip
    assert status == 200, out  # no model named: the served one (as vLLM)
  finally:
    await client.close()
    await asyncio.wait_for(server.stop(), T)


async def test_max_tokens_beyond_the_context_is_clipped_or_refused(api, driver):
  _, url = api
  prompt = list(range(1, 41))  # 40 of the 64 tokens
  status, out = await post(f"{url}/v1/completions",
                           {"prompt": prompt, "max_tokens": 100, "stop_token_ids": []})  # fmt: skip
  assert status == 200, out
  ext = out["choices"][0]["asearcher"]
  assert ext["max_new_tokens"] == MAX_SEQ_LEN - 40 and len(ext["token_ids"]) == MAX_SEQ_LEN - 40
  refusing = OpenAIServer(driver, OpenAIServerConfig(port=0, max_tokens_beyond_context="refuse"))
  port = await asyncio.wait_for(refusing.start(), T)
  try:
    status, out = await post(f"http://127.0.0.1:{port}/v1/completions",
                             {"prompt": prompt, "max_tokens": 100})  # fmt: skip
    assert status == 400 and out["error"]["param"] == "max_tokens"
    assert out["error"]["message"].startswith("This model's maximum context length is 64 tokens. "
                                              "However, you requested 140 tokens")  # fmt: skip
    status, out = await post(f"http://127.0.0.1:{port}/v1/completions",
                             {"prompt": prompt, "max_tokens": 24})  # fmt: skip
    assert status == 200, out
  finally:
    await asyncio.wait_for(refusing.stop(), T)


async def test_top_logprobs_on_every_admission_path(driver):
  """The first token comes from a prefill (fresh slot) or a suffix prefill (an agent's next turn
  onto its parked prefix), the rest from decode steps: each reports its alternatives, greedy
  alternatives start with the chosen token at its logprob, and a request not asking gets None."""
  greedy = SamplingParams(temperature=0.0, top_logprobs=3)
  first = await asyncio.wait_for(driver.generate(PROMPT, greedy, 5, stop_token_ids=()), T)
  hits = driver.stats()["prefix_hits"]
  turn = PROMPT + first.tokens + [7, 8, 9]  # extends the parked prompt + tokens[:-1]
  second = await asyncio.wait_for(driver.generate(turn, greedy, 5, stop_token_ids=()), T)
  assert driver.stats()["prefix_hits"] == hits + 1
  for res in (first, second):
    assert len(res.top_logprobs) == len(res.tokens) == 5
    for token, lp, top in zip(res.tokens, res.logprobs, res.top_logprobs, strict=True):
      assert len(top) == 3 and top[0][0] == token and top[0][1] == pytest.approx(lp, abs=1e-5)
      assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
  plain = await asyncio.wait_for(
    driver.generate(PROMPT, SamplingParams(temperature=0.0), 3, stop_token_ids=()), T
  )
  assert plain.top_logprobs is None and plain.tokens == first.tokens[:3]
