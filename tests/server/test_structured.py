"""Request fields for constrained decoding and tools (server/structured.py) and the reply's assembly
(server/chat_reply.py), on their own: which field constrains the output, which requests are refused and how,
and which parsers a template and a request get."""

from __future__ import annotations

import json

import pytest

from vegaserve.engine.grammar import Grammars
from vegaserve.server.chat_reply import ChatReply, delta_json, reply_parser
from vegaserve.server.errors import ApiError
from vegaserve.server.protocol import NamedToolChoice
from vegaserve.server.protocol import SamplingFields as ConstraintFields
from vegaserve.server.structured import check_tools, compile_constraint, constraint, tool_constraint

TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"]}}},
]


class _Vocab:
    """Bytes as tokens, and one stop token."""

    vocab_size = 257
    stop_token_ids = frozenset({256})

    def token_bytes(self, i: int) -> bytes:
        return bytes([i]) if i < 256 else b"</s>"

    def is_special(self, i: int) -> bool:
        return i == 256


class _Engine:
    grammars = Grammars(_Vocab())


@pytest.mark.parametrize("fields, kind, field", [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}, "strict": True}}},
     "json_schema", "response_format"),
    ({"json_schema": {"type": "integer"}}, "json_schema", "json_schema"),
    ({"grammar": 'root ::= "a"'}, "grammar", "grammar"),
    ({"guided_json": '{"type": "integer"}'}, "json_schema", "guided_json"),
    ({"guided_regex": "[ab]+"}, "regex", "guided_regex"),
    ({"guided_choice": ["a", "b"]}, "choice", "guided_choice"),
])
def test_each_constraint_field_gives_its_guide(fields, kind, field):
    spec, named = constraint(ConstraintFields.model_validate(fields))
    assert (spec.kind, named) == (kind, field)


def test_text_format_and_no_field_constrain_nothing():
    assert constraint(ConstraintFields.model_validate({"response_format": {"type": "text"}})) is None
    assert constraint(ConstraintFields()) is None


def test_two_constraints_at_once_are_refused_naming_both():
    with pytest.raises(ApiError, match="response_format, grammar") as info:
        constraint(ConstraintFields.model_validate({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}))
    assert info.value.status == 400 and info.value.param == "grammar"


@pytest.mark.parametrize("fields, param, reason", [
    ({"json_schema": {"type": "florp"}}, "json_schema", "florp"),
    ({"grammar": "root ::= ("}, "grammar", "grammar"),
    ({"guided_regex": "a("}, "guided_regex", "regex"),
])
def test_a_constraint_that_does_not_compile_is_a_400_naming_its_field(fields, param, reason):
    with pytest.raises(ApiError, match=reason) as info:
        compile_constraint(_Engine(), constraint(ConstraintFields.model_validate(fields)))
    assert info.value.status == 400 and info.value.param == param


def test_tool_choice_must_name_an_offered_tool_and_required_needs_tools():
    with pytest.raises(ApiError, match="'nope'.*'weather', 'time'") as info:
        check_tools(TOOLS, NamedToolChoice.model_validate({"type": "function", "function": {"name": "nope"}}))
    assert info.value.param == "tool_choice"
    with pytest.raises(ApiError, match="no tools"):
        check_tools(None, "required")
    with pytest.raises(ApiError, match=r"tools\[0\]"):
        check_tools([{"type": "function", "function": {"parameters": {}}}], "auto")
    check_tools(TOOLS, "required")


def test_required_and_named_tool_choices_constrain_to_the_tools_schemas():
    spec, field = tool_constraint(TOOLS, "required", parallel=True)
    schema = json.loads(spec.text)
    assert field == "tool_choice" and schema["type"] == "array" and len(schema["items"]["anyOf"]) == 2
    spec, _ = tool_constraint(TOOLS, NamedToolChoice.model_validate({"function": {"name": "time"}}), parallel=True)
    assert json.loads(spec.text) == TOOLS[1]["function"]["parameters"]
    assert tool_constraint(TOOLS, "auto", parallel=True) is None


QWEN3 = "{%- if tools %}<tool_call>{%- endif %}<think>\n\n</think>"
HARMONY = "<|start|>assistant<|channel|>final<|message|>"


def _whole(parser, text: str) -> ChatReply:
    reply = ChatReply(parser)
    for ch in text:
        reply.feed(ch)
    reply.finish()
    return reply


def test_a_qwen3_reply_gives_reasoning_content_and_calls():
    parser = reply_parser(QWEN3, "<|im_start|>assistant\n", TOOLS, "auto", None)
    reply = _whole(parser, '<think>\nWeather first.\n</think>\n\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    fields = reply.message_fields()
    assert fields["reasoning_content"] == "Weather first." and fields["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in fields["tool_calls"]] == [
        ("weather", {"city": "Oslo"})]
    assert reply.finish_reason("stop") == "tool_calls" and reply.finish_reason("length") == "length"


def test_tool_choice_none_and_constrained_replies_are_not_read_for_calls():
    text = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert _whole(reply_parser(QWEN3, "", TOOLS, "none", None), text).message_fields()["tool_calls"] is None
    fields = _whole(reply_parser(QWEN3, "", TOOLS, "auto", "response_format"), "<think>x</think>").message_fields()
    assert fields == {"content": "<think>x</think>", "reasoning_content": None, "tool_calls": None}


def test_harmony_template_and_named_choice_parsers():
    reply = _whole(reply_parser(HARMONY, "", None, None, None),
                   "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Hi.")
    assert reply.message_fields() == {"content": "Hi.", "reasoning_content": "Hm.", "tool_calls": None}
    named = NamedToolChoice.model_validate({"function": {"name": "weather"}})
    reply = _whole(reply_parser(QWEN3, "", TOOLS, named, "tool_choice"), '{"city": "Rome"}')
    first, *rest = [delta_json(d) for d in reply.deltas]
    assert first["function"] == {"name": "weather", "arguments": ""} and first["id"].startswith("call_")
    assert "".join(d["function"]["arguments"] for d in rest) == '{"city": "Rome"}'
    assert all("id" not in d for d in rest)
