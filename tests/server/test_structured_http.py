"""The chat route's structured output, tool and reasoning fields over HTTP, with the fake engine: its model
answers with the prompt's ordinary bytes reversed, so a reversed message scripts the reply. Bad constraints and
tool choices are 400s in OpenAI's envelope and the server keeps serving."""

from __future__ import annotations

import json

import pytest

from vegaserve.engine.chat_template import ChatTemplate

THINK_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}<|assistant|>"
                  "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}")
TOOL_TEMPLATE = THINK_TEMPLATE + "{# <tool_call> #}"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _scripted(reply: str) -> list[dict]:
    return [{"role": "user", "content": reply[::-1]}]


def _stream(client, body: dict) -> list[dict]:
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line)["choices"][0] for line in lines[:-1]]


@pytest.fixture
def think_engine(engine):
    engine.chat_template = ChatTemplate(TOOL_TEMPLATE)
    engine.max_model_len = 512  # room for a scripted reply as long as its prompt
    return engine


def test_think_template_splits_reasoning_from_content_whole_and_streamed(client, think_engine):
    body = {"messages": _scripted("<think>\nThe user wants a city.\n</think>\n\nParis."), "max_tokens": 100}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "The user wants a city." and message["content"] == "Paris."
    choices = _stream(client, body)
    reasoning = "".join(c["delta"].get("reasoning_content") or "" for c in choices)
    content = "".join(c["delta"].get("content") or "" for c in choices)
    assert (reasoning, content) == ("The user wants a city.", "Paris.")
    first_content = next(i for i, c in enumerate(choices) if c["delta"].get("content"))
    assert all(not c["delta"].get("reasoning_content") for c in choices[first_content:])
    assert choices[-1]["finish_reason"] == "stop"


def test_reasoning_format_none_leaves_the_think_block_in_content_whole_and_streamed(client, think_engine):
    text = "<think>\nThe user wants a city.\n</think>\n\nParis."
    body = {"messages": _scripted(text), "max_tokens": 100, "reasoning_format": "none"}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message.get("reasoning_content") is None and message["content"] == text
    choices = _stream(client, body)
    assert "".join(c["delta"].get("content") or "" for c in choices) == text
    assert not any(c["delta"].get("reasoning_content") for c in choices)
    bad = client.post("/v1/chat/completions", json={**body, "reasoning_format": "hidden"})
    assert bad.status_code == 400 and "reasoning_format" in bad.text


def test_chat_template_kwargs_reach_the_template(client, think_engine):
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                              "chat_template_kwargs": {"enable_thinking": False}})
    prompt = think_engine.tokenizer.decode(think_engine.requests[-1].prompt_token_ids)
    assert prompt.endswith("<|assistant|><think></think>")
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert think_engine.tokenizer.decode(think_engine.requests[-1].prompt_token_ids).endswith("<|assistant|>")


def test_hermes_calls_in_auto_mode_whole_and_streamed(client, think_engine):
    reply = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    body = {"messages": _scripted(reply), "tools": [WEATHER], "max_tokens": 120}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    choices = _stream(client, body)
    deltas = [d for c in choices for d in c["delta"].get("tool_calls") or ()]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and deltas[0]["index"] == 0
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Oslo"}'
    assert choices[-1]["finish_reason"] == "tool_calls"
    # tool_choice "none": the same reply is text
    none = client.post("/v1/chat/completions", json={**body, "tool_choice": "none"}).json()["choices"][0]
    assert none["message"]["content"] == reply and "tool_calls" not in none["message"]


@pytest.mark.parametrize("extra, param, says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "florp"}}}},
     "response_format", "florp"),
    ({"json_schema": {"properties": {"a": {"$ref": "#/nowhere"}}}}, "json_schema", "nowhere"),
    ({"grammar": 'root ::= "a" |'}, "grammar", "grammar"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "regex"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "get_time"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "give one"),
    ({"response_format": {"type": "json_schema"}}, None, "json_schema"),
])
def test_bad_constraints_and_tool_choices_are_400_and_the_server_keeps_serving(client, extra, param, says):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **extra})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and says in error["message"]
    if param is not None:
        assert error["param"] == param
    ok = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ih"}]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "hi"


def test_constraints_reach_the_engine_as_a_guide(client, engine):
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                              "response_format": {"type": "json_object"}})
    assert engine.requests[-1].params.guide.kind == "json_object"
    client.post("/v1/completions", json={"prompt": "x", "grammar": 'root ::= "a"'})
    assert engine.requests[-1].params.guide.kind == "grammar"
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                                              "tool_choice": "required", "parallel_tool_calls": False})
    schema = json.loads(engine.requests[-1].params.guide.text)
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"] == {"const": "get_weather"}
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert engine.requests[-1].params.guide is None


def test_harmony_channels_split_whole_and_streamed(client, engine):
    engine.chat_template = ChatTemplate(THINK_TEMPLATE + "{# <|channel|>final<|message|> #}")
    engine.max_model_len = 512
    reply = ("<|channel|>analysis<|message|>Simple arithmetic.<|end|><|start|>assistant<|channel|>final<|message|>"
             "4")
    body = {"messages": _scripted(reply), "max_tokens": 200}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Simple arithmetic.", "4")
    choices = _stream(client, body)
    assert "".join(c["delta"].get("reasoning_content") or "" for c in choices) == "Simple arithmetic."
    assert "".join(c["delta"].get("content") or "" for c in choices) == "4"


def test_tool_call_arguments_sent_back_reach_the_template_as_an_object(client, engine):
    engine.chat_template = ChatTemplate(
        "{% for m in messages %}<|{{ m.role }}|>{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}"
        "{% endfor %}{{ m.content }}<|end|>{% endfor %}<|assistant|>")
    engine.max_model_len = 512
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert client.post("/v1/chat/completions", json={"messages": history, "max_tokens": 1}).status_code == 200
    prompt = engine.tokenizer.decode(engine.requests[-1].prompt_token_ids)
    assert '<|assistant|>{"city": "Oslo"}<|end|>' in prompt
