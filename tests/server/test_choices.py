"""OpenAI's `n`: n choices of one prompt, each its own engine request (server/generation.py Choices), whole
and streamed, on chat and completions. Against the fake engine, whose reply is a fixed function of the
prompt, so each choice must carry the reply an n=1 request gets. (A client that leaves ends every choice:
tests/server/test_generation.py.)"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from vegaserve.server.app import create_app

MESSAGES = [{"role": "user", "content": "abc"}]
ROUTES = [("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "abc"})]


def _text(route: str, choice: dict) -> str:
    return choice["message"]["content"] if route.endswith("chat/completions") else choice["text"]


def _events(response) -> list[dict]:
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("route,body", ROUTES)
def test_n_choices_each_carry_the_reply_of_one_and_usage_counts_the_prompt_once(client, engine, route, body):
    one = client.post(route, json=body).json()
    many = client.post(route, json={**body, "n": 3, "seed": 5}).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert {_text(route, c) for c in many["choices"]} == {_text(route, one["choices"][0])}
    assert all(c["finish_reason"] == one["choices"][0]["finish_reason"] for c in many["choices"])
    assert many["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert many["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"] > 0
    reqs = engine.requests[1:]
    assert [r.request_id for r in reqs] == [many["id"], f"{many['id']}-1", f"{many['id']}-2"]
    assert [r.params.seed for r in reqs] == [5, 6, 7]  # sampled choices differ, and repeat with the seed
    assert all(r.prompt_token_ids == engine.requests[0].prompt_token_ids for r in reqs)


def test_without_a_seed_no_choice_gets_one(client, engine):
    client.post("/v1/completions", json={"prompt": "abc", "n": 2})
    assert [r.params.seed for r in engine.requests] == [None, None]


@pytest.mark.parametrize("route,body", ROUTES)
def test_a_stream_of_n_choices_gives_each_its_whole_reply_by_index(fake, route, body):
    engine = fake.FakeEngine(token_delay_s=0.001)  # the choices' outputs interleave
    with TestClient(create_app(engine)) as client:
        whole = client.post(route, json={**body, "n": 2}).json()
        response = client.post(route, json={**body, "n": 2, "stream": True, "stream_options": {"include_usage": True}})
    events = _events(response)
    texts, finishes, indices = ["", ""], [[], []], []
    for event in events[:-1]:
        (choice,) = event["choices"]
        i = choice["index"]
        indices.append(i)
        delta = choice.get("delta", {})
        texts[i] += (delta.get("content") or "") if "delta" in choice else choice["text"]
        if choice["finish_reason"] is not None:
            finishes[i].append(choice["finish_reason"])
    assert texts == [_text(route, c) for c in whole["choices"]] and texts[0]
    assert finishes == [[whole["choices"][0]["finish_reason"]]] * 2
    assert set(indices) == {0, 1} and indices != sorted(indices)  # interleaved as the engine gave them
    if route.endswith("chat/completions"):  # each choice opens with its role chunk
        roles = [e["choices"][0]["index"] for e in events if e["choices"] and e["choices"][0]["delta"].get("role")]
        assert roles == [0, 1]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]


@pytest.mark.parametrize("n", [0, 129])
def test_n_out_of_range_is_a_400_naming_it(client, n):
    response = client.post("/v1/chat/completions", json={"messages": MESSAGES, "n": n})
    assert response.status_code == 400
    assert f"n must be between 1 and 128, got {n}" in response.json()["error"]["message"]
