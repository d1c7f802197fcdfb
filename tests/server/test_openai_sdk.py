"""The real `openai` client against the app served by uvicorn on a localhost port: end to end over HTTP."""

from __future__ import annotations

import httpx
import openai
import pytest

from vegaserve.server.app import create_app

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def sdk(live) -> openai.OpenAI:
    server, _ = live
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=10)


@pytest.fixture(scope="module")
def http(live):
    server, _ = live
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        yield client


def test_chat_streaming_and_not_give_the_same_text_and_usage(sdk, live):
    _, engine = live
    whole = sdk.chat.completions.create(model="fake-model", messages=MESSAGES, temperature=0)
    stream = sdk.chat.completions.create(
        model="fake-model", messages=MESSAGES, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == streamed != ""
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason == "stop"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage
    prompt = engine.requests[-1].prompt_token_ids
    assert whole.usage.prompt_tokens == len(prompt)
    assert whole.usage.completion_tokens == len(engine.tokenizer.encode(streamed, add_special_tokens=False))
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


def test_chat_logprobs_parse_in_the_sdk_types(sdk):
    r = sdk.chat.completions.create(model="fake-model", messages=MESSAGES, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob for e in content)


def test_completion_with_token_ids_echo_and_logprobs(sdk, live):
    _, engine = live
    prompt = engine.tokenizer.encode("xyz", add_special_tokens=False)
    r = sdk.completions.create(model="fake-model", prompt=prompt, echo=True, logprobs=1, max_tokens=5)
    choice = r.choices[0]
    assert engine.requests[-1].prompt_token_ids == prompt
    assert choice.text.startswith("xyz") and len(choice.text) > 3
    assert choice.logprobs.tokens[:3] == ["x", "y", "z"]
    assert choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.tokens) == len(prompt) + r.usage.completion_tokens


def test_completion_stream_matches_non_stream(sdk):
    whole = sdk.completions.create(model="fake-model", prompt="hello there", max_tokens=8)
    parts = list(sdk.completions.create(model="fake-model", prompt="hello there", max_tokens=8, stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text


def test_models_list_names_the_served_model(sdk):
    assert [m.id for m in sdk.models.list()] == ["fake-model"]


def test_tokenize_detokenize_round_trip_over_http(http):
    text = "round trip: ünïcode ✓"
    tokens = http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": tokens}).json()["content"] == text


@pytest.mark.parametrize("kwargs,error_type,words", [
    ({"temperature": "hot"}, openai.BadRequestError, ["temperature"]),
    ({"temperature": -1}, openai.BadRequestError, ["temperature"]),
    ({"max_tokens": 0}, openai.BadRequestError, ["max_tokens"]),
    ({"top_p": 1.5}, openai.BadRequestError, ["top_p"]),
    ({"n": 129}, openai.BadRequestError, ["n must be between 1 and 128"]),
    ({"model": "gpt-4o"}, openai.NotFoundError, ["gpt-4o"]),
    ({"messages": [{"role": "user", "content": "x" * 200}]}, openai.BadRequestError, ["context", "128"]),
])
def test_bad_requests_raise_the_sdk_error_with_our_message_and_the_server_carries_on(sdk, kwargs, error_type, words):
    request = {"model": "fake-model", "messages": MESSAGES, **kwargs}
    with pytest.raises(error_type) as info:
        sdk.chat.completions.create(**request)
    message = info.value.body["message"]  # the SDK unwraps the envelope's "error" object
    assert all(word in message for word in words), message
    assert sdk.chat.completions.create(model="fake-model", messages=MESSAGES).choices[0].message.content


def test_missing_messages_is_a_400(sdk):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="fake-model", messages=openai.NOT_GIVEN)
    assert "messages" in info.value.body["message"]


@pytest.mark.parametrize("raw,word", [(b'{"messages": [', "JSON"), (b'{"messages": "\xc3\x28"}', "UTF-8")])
def test_malformed_bodies_over_http_are_400_envelopes(http, raw, word):
    response = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400 and word in response.json()["error"]["message"]
    assert http.get("/health").json() == {"status": "ok"}


def test_metrics_show_the_sdk_traffic(sdk, http):
    def generated() -> float:
        for line in http.get("/metrics").text.splitlines():
            if line.startswith('vllm:generation_tokens_total{model_name="fake-model"}'):
                return float(line.split()[-1])
        raise AssertionError("vllm:generation_tokens_total missing")

    before = generated()
    r = sdk.chat.completions.create(model="fake-model", messages=MESSAGES)
    assert generated() - before == r.usage.completion_tokens


def test_api_key_gives_401_without_or_with_a_wrong_key_and_200_with_the_right_one(fake, serve):
    with serve(create_app(fake.FakeEngine(), api_key="k3y")) as server:
        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=10)

        with pytest.raises(openai.AuthenticationError) as info:
            client("wrong").chat.completions.create(model="fake-model", messages=MESSAGES)
        assert info.value.body["code"] == "invalid_api_key"
        no_key = httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": MESSAGES})
        assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
        assert client("k3y").chat.completions.create(model="fake-model", messages=MESSAGES).choices
        assert httpx.get(f"{server.base_url}/health").status_code == 200
