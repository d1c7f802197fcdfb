"""server/completions.py: legacy completions with text or token-id prompts, echo, and legacy logprobs."""

from __future__ import annotations

import json

import pytest


def sse_chunks(text: str) -> list[dict]:
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_text_prompt_gets_the_tokenizer_special_tokens(client, engine):
    client.post("/v1/completions", json={"prompt": "abc"})
    assert engine.requests[0].prompt_token_ids == engine.tokenizer.encode("abc", add_special_tokens=True)


@pytest.mark.parametrize("prompt", [[104, 105, 106], [[104, 105, 106]]])
def test_token_id_prompt_goes_to_the_engine_unchanged(client, engine, fake, prompt):
    body = client.post("/v1/completions", json={"prompt": prompt}).json()
    assert engine.requests[0].prompt_token_ids == [104, 105, 106]
    assert body["choices"][0]["text"] == engine.tokenizer.decode(fake.answer([104, 105, 106]))


def test_one_element_string_list_is_the_string(client, engine):
    client.post("/v1/completions", json={"prompt": ["abc"]})
    assert engine.requests[0].prompt_token_ids == engine.tokenizer.encode("abc")


def test_default_max_tokens_is_the_legacy_16(client, engine):
    client.post("/v1/completions", json={"prompt": "abc"})
    assert engine.requests[0].params.max_tokens == 16


@pytest.mark.parametrize("prompt,word", [([1, 10**6], "vocabulary"), (["a", "b"], "one prompt"), ([], "empty")])
def test_bad_prompts_are_400s_that_say_why(client, prompt, word):
    response = client.post("/v1/completions", json={"prompt": prompt})
    assert response.status_code == 400
    assert word in response.json()["error"]["message"]


def test_suffix_is_refused(client):
    response = client.post("/v1/completions", json={"prompt": "a", "suffix": "b"})
    assert response.status_code == 400 and "suffix" in response.json()["error"]["message"]


def test_echo_puts_the_prompt_text_first(client, engine, fake):
    text = client.post("/v1/completions", json={"prompt": "abc", "echo": True}).json()["choices"][0]["text"]
    reply = fake.answer(engine.requests[0].prompt_token_ids)
    assert text == "abc" + engine.tokenizer.decode(reply)


def test_echo_with_logprobs_lists_prompt_then_generated_tokens(client, engine, fake):
    prompt = [fake.SPECIALS["<|user|>"], 104, 105, 106]  # a multi-character token moves the offsets by 8
    body = client.post("/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 2}).json()
    assert engine.requests[0].params.prompt_logprobs == 2
    choice = body["choices"][0]
    reply = fake.answer(prompt)
    lp = choice["logprobs"]
    all_ids = prompt + reply
    assert lp["tokens"] == [engine.tokenizer.token_bytes(t).decode() for t in all_ids]
    # The first prompt token has nothing before it, so no logprob.
    assert lp["token_logprobs"] == [None] + [fake.fake_logprob(t) for t in all_ids[1:]]
    assert lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1] == {chr(tid): v for tid, v in fake.fake_top(all_ids[1], 2)}
    # Each offset points at its token inside the returned text.
    assert [choice["text"][o:o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"])] == lp["tokens"]


def test_generated_token_offsets_point_into_the_text_after_an_echoed_text_prompt(client, engine):
    # The tokenizer adds BOS to a text prompt; the echoed text is the prompt as sent, without "<s>".
    body = client.post("/v1/completions", json={"prompt": "abc", "echo": True, "logprobs": 0}).json()
    choice, n_prompt = body["choices"][0], len(engine.requests[0].prompt_token_ids)
    assert choice["text"].startswith("abc")
    generated = list(zip(choice["logprobs"]["text_offset"], choice["logprobs"]["tokens"]))[n_prompt:]
    assert generated and [choice["text"][o:o + len(t)] for o, t in generated] == [t for _, t in generated]


def test_logprobs_without_echo_cover_only_generated_tokens(client, engine, fake):
    body = client.post("/v1/completions", json={"prompt": [104, 105], "logprobs": 0}).json()
    assert engine.requests[0].params.prompt_logprobs is None
    lp = body["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [fake.fake_logprob(t) for t in fake.answer([104, 105])]
    assert lp["text_offset"] == list(range(len(lp["tokens"])))


def test_logprobs_over_five_are_refused_as_in_the_legacy_api(client):
    response = client.post("/v1/completions", json={"prompt": "a", "logprobs": 6})
    assert response.status_code == 400 and "logprobs" in response.json()["error"]["message"]


def test_stream_matches_the_whole_response(client):
    request = {"prompt": [104, 105, 106], "echo": True, "logprobs": 1}
    whole = client.post("/v1/completions", json=request).json()["choices"][0]
    chunks = sse_chunks(client.post("/v1/completions", json={**request, "stream": True}).text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks for x in c["choices"][0]["logprobs"][key]] == whole["logprobs"][key]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]


def test_stream_usage_chunk_has_the_counts_and_no_choices(client, engine, fake):
    chunks = sse_chunks(client.post("/v1/completions", json={
        "prompt": "abcd", "stream": True, "stream_options": {"include_usage": True}}).text)
    prompt = engine.requests[0].prompt_token_ids
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": len(prompt), "completion_tokens": len(fake.answer(prompt)),
        "total_tokens": len(prompt) + len(fake.answer(prompt)),
    }
