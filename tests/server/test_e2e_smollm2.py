"""The real engine behind the real HTTP server, driven by the real `openai` SDK (the issue's acceptance)."""

from __future__ import annotations

import httpx
import openai
import pytest

from vegaserve.engine.async_engine import AsyncEngine
from vegaserve.server.app import create_app

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def live_smollm2(smollm2_core, serve):
    engine = AsyncEngine(smollm2_core)
    with serve(create_app(engine, api_key="sk-test")) as server:
        yield server, engine
    engine.shutdown()


@pytest.fixture(scope="module")
def sdk(live_smollm2):
    server, _ = live_smollm2
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="sk-test", max_retries=0)


def test_chat_answers_and_streaming_yields_the_same_text_and_usage(sdk, smollm2_core):
    r = sdk.chat.completions.create(model=smollm2_core.model_name, messages=QUESTION, temperature=0, max_tokens=40)
    text = r.choices[0].message.content
    assert "Paris" in text
    prompt_ids = smollm2_core.tokenizer.encode(
        smollm2_core.chat_template.render(QUESTION, add_generation_prompt=True), add_special_tokens=False
    )
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    streamed, usage = "", None
    for chunk in sdk.chat.completions.create(
        model=smollm2_core.model_name, messages=QUESTION, temperature=0, max_tokens=40, stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            streamed += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert streamed == text
    assert usage.completion_tokens == r.usage.completion_tokens and usage.prompt_tokens == r.usage.prompt_tokens


def test_completion_with_echo_returns_prompt_logprobs(sdk, smollm2_core):
    r = sdk.completions.create(model=smollm2_core.model_name, prompt="The capital of France is", max_tokens=3, temperature=0, echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text.startswith("The capital of France is")
    n_prompt = r.usage.prompt_tokens
    assert len(c.logprobs.tokens) == n_prompt + 3
    assert c.logprobs.token_logprobs[0] is None and all(x <= 0 for x in c.logprobs.token_logprobs[1:])


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b'{"messages": [', 400, "JSON"),
        (b'{"model": "x"}', 400, "messages"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', 400, "temperature"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -1}', 400, "temperature"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', 400, "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}', 400, "top_p"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}', 404, "gpt-9"),
        (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "UTF-8"),
    ],
)
def test_bad_input_gets_4xx_envelope_and_server_keeps_serving(live_smollm2, sdk, body, status, needle):
    server, _ = live_smollm2
    r = httpx.post(server.base_url + "/v1/chat/completions", content=body,
                   headers={"Authorization": "Bearer sk-test", "Content-Type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert needle.lower() in err["message"].lower()
    ok = sdk.chat.completions.create(model="", messages=QUESTION, max_tokens=2)
    assert ok.choices[0].message.content is not None


def test_prompt_longer_than_context_is_400(live_smollm2, smollm2_core):
    server, _ = live_smollm2
    long_prompt = "hello " * (smollm2_core.max_model_len + 10)
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": long_prompt, "max_tokens": 1},
                   headers={"Authorization": "Bearer sk-test"}, timeout=60)
    assert r.status_code == 400 and str(smollm2_core.max_model_len) in r.json()["error"]["message"]


def test_api_key_is_required(live_smollm2):
    server, _ = live_smollm2
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": QUESTION})
    assert r.status_code == 401 and "error" in r.json()
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_tokenize_detokenize_round_trip(live_smollm2, smollm2_core):
    server, _ = live_smollm2
    h = {"Authorization": "Bearer sk-test"}
    toks = httpx.post(server.base_url + "/tokenize", json={"content": "Hello world"}, headers=h).json()["tokens"]
    assert toks == smollm2_core.tokenizer.encode("Hello world", add_special_tokens=False)
    assert httpx.post(server.base_url + "/detokenize", json={"tokens": toks}, headers=h).json()["content"] == "Hello world"


def test_n_sampled_choices_differ_repeat_with_their_seed_and_each_keeps_to_the_schema(sdk, smollm2_core):
    """The SDK's `n`: three choices drawn at temperature 1.5 with a seed, each held to a JSON schema by its own
    matcher; the seed makes the three repeat and its per-choice offsets (s + i) make them differ."""
    import json

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    messages = [{"role": "user", "content": "Name a city you would like to visit."}]
    ask = dict(model=smollm2_core.model_name, messages=messages, n=3, temperature=1.5, seed=7, max_tokens=30,
               response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    first, again = sdk.chat.completions.create(**ask), sdk.chat.completions.create(**ask)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) >= 2, texts
    for text in texts:
        assert set(json.loads(text)) == {"city"}
