"""server/chat.py (with preprocess.py): what chat requests become in the engine, and the responses."""

from __future__ import annotations

import json

import pytest

from vegaserve.engine.request import ContextLengthError

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


def sse_events(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]


def test_prompt_is_the_rendered_template_tokenized_without_adding_bos(client, engine):
    client.post("/v1/chat/completions", json={"messages": MESSAGES})
    rendered = engine.chat_template.render(MESSAGES, add_generation_prompt=True)
    ids = engine.requests[0].prompt_token_ids
    assert ids == engine.tokenizer.encode(rendered, add_special_tokens=False, parse_special=True)
    # The template's own <s> is the only BOS: encoding did not add a second one.
    assert ids.count(engine.tokenizer.encode("", add_special_tokens=True)[0]) == 1


def test_reply_text_and_usage_come_from_the_engine(client, engine, fake):
    body = client.post("/v1/chat/completions", json={"messages": MESSAGES}).json()
    prompt = engine.requests[0].prompt_token_ids
    reply = fake.answer(prompt)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": engine.tokenizer.decode(reply)}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {
        "prompt_tokens": len(prompt), "completion_tokens": len(reply), "total_tokens": len(prompt) + len(reply)
    }


def test_list_of_text_parts_is_the_same_as_the_joined_string(client, engine):
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}]})
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "one\ntwo"}]})
    assert engine.requests[0].prompt_token_ids == engine.requests[1].prompt_token_ids


def test_developer_role_renders_as_system(client, engine):
    client.post("/v1/chat/completions", json={"messages": [{"role": "developer", "content": "x"}]})
    client.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "x"}]})
    assert engine.requests[0].prompt_token_ids == engine.requests[1].prompt_token_ids


def test_sampling_fields_reach_sampling_params(client, engine):
    client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "temperature": 0.3, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "seed": 11,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1, "stop": "xy",
        "logit_bias": {"65": -100}, "ignore_eos": True, "stop_token_ids": [257], "max_completion_tokens": 9,
    })
    p = engine.requests[0].params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.3, 0.9, 7, 0.05, 11)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert (p.stop, p.logit_bias, p.ignore_eos, p.stop_token_ids, p.max_tokens) == (("xy",), {65: -100.0}, True, (257,), 9)


def test_max_completion_tokens_wins_over_max_tokens(client, engine):
    client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, "max_completion_tokens": 3})
    assert engine.requests[0].params.max_tokens == 3


def test_no_max_tokens_means_up_to_the_context(client, engine):
    client.post("/v1/chat/completions", json={"messages": MESSAGES})
    request = engine.requests[0]
    assert request.params.max_tokens == engine.max_model_len - len(request.prompt_token_ids)


def test_max_tokens_cuts_the_reply_with_finish_reason_length(client, engine, fake):
    body = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}).json()
    reply = fake.answer(engine.requests[0].prompt_token_ids)[:2]
    assert body["choices"][0]["message"]["content"] == engine.tokenizer.decode(reply)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("over", [1, 10**12])
def test_max_tokens_beyond_the_context_is_clamped_to_the_room_left(client, engine, over):
    response = client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": engine.max_model_len + over, "ignore_eos": True})
    assert response.status_code == 200, response.text
    request = engine.requests[0]
    room = engine.max_model_len - len(request.prompt_token_ids)
    assert request.params.max_tokens == room
    assert response.json()["usage"]["completion_tokens"] == room


def test_max_tokens_within_the_room_is_kept_as_sent(client, engine):
    client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 7})
    assert engine.requests[0].params.max_tokens == 7


def test_prompt_that_fills_the_context_is_still_a_400_naming_both_numbers(client, engine):
    # Clamping cannot help a prompt that leaves no room at all; the client must shorten it.
    messages = [{"role": "user", "content": "x" * engine.max_model_len}]
    response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert response.status_code == 400
    error = response.json()["error"]
    prompt_len = len(engine.tokenizer.encode(engine.chat_template.render(messages), add_special_tokens=False))
    assert error["code"] == "context_length_exceeded"
    assert str(prompt_len) in error["message"] and str(engine.max_model_len) in error["message"]
    assert not engine.requests  # refused before reaching the engine


def test_logprobs_have_the_chat_shape_with_token_bytes(client, engine, fake):
    body = client.post("/v1/chat/completions", json={"messages": MESSAGES, "logprobs": True, "top_logprobs": 3}).json()
    reply = fake.answer(engine.requests[0].prompt_token_ids)
    content = body["choices"][0]["logprobs"]["content"]
    assert [e["bytes"] for e in content] == [list(engine.tokenizer.token_bytes(t)) for t in reply]
    assert [e["token"] for e in content] == [engine.tokenizer.token_bytes(t).decode() for t in reply]
    assert [e["logprob"] for e in content] == [fake.fake_logprob(t) for t in reply]
    top = content[0]["top_logprobs"]
    assert [(a["bytes"], a["logprob"]) for a in top] == [([tid], lp) for tid, lp in fake.fake_top(reply[0], 3)]


def test_logprobs_are_absent_unless_asked(client, engine):
    body = client.post("/v1/chat/completions", json={"messages": MESSAGES}).json()
    assert body["choices"][0]["logprobs"] is None
    assert engine.requests[0].params.logprobs is None


def test_stream_starts_with_the_role_and_ends_with_done(client, engine, fake):
    text = client.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True}).text
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == engine.tokenizer.decode(fake.answer(engine.requests[0].prompt_token_ids))
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("stop") == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert len({c["id"] for c in chunks}) == 1


def test_stream_usage_chunk_only_when_asked(client, engine):
    plain = sse_events(client.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True}).text)
    assert all(json.loads(e)["usage"] is None for e in plain[:-1])
    asked = sse_events(client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}).text)
    last = json.loads(asked[-2])
    prompt_len = len(engine.requests[-1].prompt_token_ids)
    assert last["choices"] == []
    assert last["usage"]["prompt_tokens"] == prompt_len
    n_content_chunks = sum(1 for e in asked[1:-2] if json.loads(e)["choices"][0]["delta"].get("content"))
    assert last["usage"]["completion_tokens"] == n_content_chunks  # one byte-token per chunk in the fake


def test_stream_refused_by_the_engine_is_an_http_error_not_an_event(client, engine):
    engine.fail_with = ContextLengthError("too long for the engine")
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "too long for the engine", "type": "invalid_request_error", "param": None,
        "code": "context_length_exceeded",
    }


@pytest.mark.parametrize("extra", [{"n": 0}, {"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}])
def test_unsupported_or_out_of_range_options_are_400s_naming_the_field(client, extra):
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES, **extra})
    assert response.status_code == 400
    name = next(iter(extra)) if "top_logprobs" not in extra else "top_logprobs"
    assert name in response.json()["error"]["message"]
