"""The reply parsers (server/reasoning.py, server/harmony.py, server/tool_calls.py) on crafted replies: each
split is the same whatever the increments the text arrives in, and a streamed call assembles to the whole one."""

from __future__ import annotations

import json
import random

import pytest

from vegaserve.server.harmony import HarmonyParser
from vegaserve.server.reasoning import ThinkParser
from vegaserve.server.tool_calls import (
    ArrayCallParser, HermesParser, Increment, JsonCallParser, NamedCallParser, assemble, required_schema, tool_format,
)  # fmt: skip


def _splits(text: str, seed: int = 0) -> list[list[str]]:
    """The text whole, one character at a time, and in random pieces."""
    rng = random.Random(seed)
    ways = [[text], list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        ways.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return ways


def _run(make, pieces: list[str]) -> Increment:
    parser = make()
    out = Increment()
    for piece in pieces:
        got = parser.feed(piece)
        out += Increment(*got) if isinstance(got, tuple) else got
    got = parser.finish()
    out += Increment(*got) if isinstance(got, tuple) else got
    return out


def _same_in_every_split(make, text: str) -> Increment:
    results = [_run(make, pieces) for pieces in _splits(text)]
    first = results[0]
    for r in results[1:]:
        assert (r.reasoning, r.content) == (first.reasoning, first.content)
        assert [(c.name, c.arguments) for c in assemble(r.calls)] == [(c.name, c.arguments) for c in assemble(first.calls)]
    return first


@pytest.mark.parametrize(
    "reply, in_reasoning, reasoning, content",
    [
        ("<think>\nStep one.\nStep two.\n</think>\n\nParis.", False, "Step one.\nStep two.", "Paris."),
        ("Step one.\n</think>\n\nParis.", True, "Step one.", "Paris."),  # the template opened the block
        ("Paris, no thinking.", False, "", "Paris, no thinking."),
        ("  <thin is not a tag", False, "", "  <thin is not a tag"),
        ("<think>cut off by max_tokens </thi", False, "cut off by max_tokens </thi", ""),
        ("<think></think>Paris.", False, "", "Paris."),
        ("The tag <think> later is text.", False, "", "The tag <think> later is text."),
    ],
)
def test_think_parser_splits_reasoning_from_content_in_any_increments(reply, in_reasoning, reasoning, content):
    out = _same_in_every_split(lambda: ThinkParser(in_reasoning), reply)
    assert (out.reasoning, out.content) == (reasoning, content)


def test_think_parser_starts_inside_the_block_only_when_the_prompt_left_it_open():
    assert ThinkParser.after("<|im_start|>assistant\n<think>\n").in_reasoning
    assert not ThinkParser.after("<|im_start|>assistant\n<think>\n\n</think>\n\n").in_reasoning
    assert not ThinkParser.after("<|im_start|>assistant\n").in_reasoning


def test_harmony_analysis_is_reasoning_and_final_is_content():
    reply = ("<|channel|>analysis<|message|>User asks the capital. Easy.<|end|>"
             "<|start|>assistant<|channel|>final<|message|>The capital is Paris <|not a marker.")
    out = _same_in_every_split(HarmonyParser, reply)
    assert out.reasoning == "User asks the capital. Easy."
    assert out.content == "The capital is Paris <|not a marker."
    assert out.calls == []


@pytest.mark.parametrize("header", [
    "<|channel|>commentary to=functions.get_weather <|constrain|>json",
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json",
])
def test_harmony_commentary_to_a_function_is_a_tool_call(header):
    reply = f"<|channel|>analysis<|message|>Need the weather.<|end|>{header}<|message|>{{\"city\": \"Paris\"}}"
    out = _same_in_every_split(HarmonyParser, reply)
    assert out.reasoning == "Need the weather." and out.content == ""
    [call] = assemble(out.calls)
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert call.id.startswith("call_")


def test_harmony_text_without_the_format_is_content():
    out = _same_in_every_split(HarmonyParser, "plain words, no channels")
    assert (out.reasoning, out.content) == ("", "plain words, no channels")


def test_hermes_blocks_are_calls_and_the_text_around_them_content():
    reply = ('Checking both.<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
             '<tool_call>\n{"name": "time", "arguments": {"zone": "CET"}}\n</tool_call>')
    out = _same_in_every_split(lambda: HermesParser(frozenset({"weather", "time"})), reply)
    assert out.content == "Checking both."
    calls = assemble(out.calls)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("weather", {"city": "Paris"}), ("time", {"zone": "CET"})]
    assert len({c.id for c in calls}) == 2


def test_hermes_block_that_is_no_call_stays_text():
    reply = "<tool_call>not json</tool_call> and <tool_call>\n{\"name\": \"unknown\", \"arguments\": {}}</tool_call>"
    out = _same_in_every_split(lambda: HermesParser(frozenset({"weather"})), reply)
    assert out.calls == [] and out.content == reply


@pytest.mark.parametrize("reply, calls", [
    ('{"name": "weather", "parameters": {"city": "Paris"}}', [("weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "weather", "parameters": {"city": "Oslo"}}', [("weather", {"city": "Oslo"})]),
    ('{"name": "weather", "parameters": {"city": "A"}}; {"name": "time", "parameters": {}}',
     [("weather", {"city": "A"}), ("time", {})]),
    ('{"name": "Paris", "population": 2}', []),  # JSON that names no tool is an answer
    ("It is sunny.", []),
])
def test_llama_json_calls_and_plain_answers(reply, calls):
    out = _same_in_every_split(lambda: JsonCallParser(frozenset({"weather", "time"})), reply)
    assert [(c.name, json.loads(c.arguments)) for c in assemble(out.calls)] == calls
    assert out.content == ("" if calls else reply)


def test_required_array_gives_each_call_when_its_object_closes():
    reply = '[{"name": "weather", "parameters": {"city": "}{[\\" tricky"}}, {"name": "time", "parameters": {}}]'
    parser = ArrayCallParser()
    first = parser.feed(reply[: reply.index("}, {") + 1])
    assert [d.name for d in first.calls if d.name] == ["weather"]
    out = _same_in_every_split(ArrayCallParser, reply)
    assert [(c.name, json.loads(c.arguments)) for c in assemble(out.calls)] == [
        ("weather", {"city": '}{[" tricky'}), ("time", {})]


def test_named_call_streams_its_arguments_as_generated():
    parser = NamedCallParser("weather")
    head = parser.feed('{"city"')
    assert head.calls[0].name == "weather" and head.calls[0].arguments == "" and head.calls[1].arguments == '{"city"'
    assert parser.feed(': "Paris"}').calls[0].arguments == ': "Paris"}'
    out = _same_in_every_split(lambda: NamedCallParser("weather"), '{"city": "Paris"}')
    assert [(c.name, c.arguments) for c in assemble(out.calls)] == [("weather", '{"city": "Paris"}')]


def test_required_schema_lists_every_tool_and_limits_to_one_call_without_parallel_calls():
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("a", "b")]
    schema = required_schema(tools, parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [i["properties"]["name"]["const"] for i in schema["items"]["anyOf"]] == ["a", "b"]
    assert "maxItems" not in required_schema(tools, parallel=True)


def test_tool_format_follows_the_template():
    assert tool_format("...<|channel|>analysis...") == "harmony"
    assert tool_format("{{- '<tool_call>' }}") == "hermes"
    assert tool_format("{{ messages }}") == "json"


def test_harmony_reply_of_the_gpt_oss_test_model_parses_token_by_token():
    """The markers are control tokens of gpt-oss's vocabulary: the reply is encoded with the tiny test model's
    tokenizer and detokenized one token at a time, as the engine streams it."""
    from pathlib import Path

    from vegaserve.engine.detokenizer import IncrementalDetokenizer
    from vegaserve.engine.gguf_file import GGUFFile
    from vegaserve.engine.tokenizer import Tokenizer

    gguf = GGUFFile(Path(__file__).resolve().parents[1] / "data" / "moe" / "gpt-oss-f32.gguf")
    tok = Tokenizer.from_metadata(gguf.metadata)
    assert "<|channel|>" in gguf.metadata["tokenizer.chat_template"]
    reply = ("<|channel|>analysis<|message|>the name is in the<|end|><|start|>assistant<|channel|>commentary "
             'to=functions.lookup <|constrain|>json<|message|>{"name": "as"}')
    ids = tok.encode(reply, add_special_tokens=False, parse_special=True)
    assert tok.encode("<|channel|>", add_special_tokens=False, parse_special=True) == [315]  # one control token
    detok = IncrementalDetokenizer(tok)
    parser = HarmonyParser()
    out = Increment()
    for i in ids:
        out += parser.feed(detok.push(i))
    out += parser.feed(detok.flush())
    out += parser.finish()
    assert out.reasoning == "the name is in the" and out.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in assemble(out.calls)] == [("lookup", {"name": "as"})]
