"""A chat reply's text, as the engine streams it, turned into OpenAI's message fields: `content`,
`reasoning_content` and `tool_calls`, whole or as stream deltas.

`reply_parser` picks the parsers for one request from the chat template (which reasoning markup and which
call format the model was trained on, server/reasoning.py, server/tool_calls.py, server/harmony.py), the
prompt's end (a template may leave the reply inside a think block) and the request (its tools and
tool_choice, and whether decoding is constrained: a constrained reply is read as what its grammar makes it,
from its first token, so no reasoning is looked for there).
"""

from __future__ import annotations

from typing import Any

from vegaserve.server.harmony import HarmonyParser
from vegaserve.server.reasoning import OPEN, ThinkParser
from vegaserve.server.protocol import NamedToolChoice, ToolChoice
from vegaserve.server.tool_calls import (
    ArrayCallParser, CallDelta, HermesParser, Increment, JsonCallParser, NamedCallParser, Parser, PlainParser,
    ToolCall, assemble, tool_format, tool_names,
)  # fmt: skip


class _Chain:
    """Reasoning first, then the tool parser over what is content."""

    def __init__(self, think: ThinkParser, tools: Parser) -> None:
        self.think, self.tools = think, tools

    def feed(self, text: str) -> Increment:
        reasoning, content = self.think.feed(text)
        out = Increment(reasoning=reasoning)
        if content:
            out += self.tools.feed(content)
        return out

    def finish(self) -> Increment:
        reasoning, content = self.think.finish()
        out = Increment(reasoning=reasoning)
        if content:
            out += self.tools.feed(content)
        out += self.tools.finish()
        return out


def reply_parser(template_source: str, prompt_tail: str, tools: list[dict[str, Any]] | None,
                 tool_choice: ToolChoice | None, constrained_by: str | None, split_reasoning: bool = True) -> Parser:
    """`constrained_by`: the field whose grammar constrains decoding ("tool_choice" for required or a named
    function), None when decoding is free. `split_reasoning` False (reasoning_format "none"): a `<think>`
    block stays in the content."""
    if constrained_by == "tool_choice":
        if isinstance(tool_choice, NamedToolChoice):
            return NamedCallParser(tool_choice.function.name)
        return ArrayCallParser()
    if constrained_by is not None:
        return PlainParser()
    offered = bool(tools) and tool_choice != "none"
    fmt = tool_format(template_source)
    if fmt == "harmony":
        return HarmonyParser()
    names = tool_names(tools)
    calls: Parser = PlainParser()
    if offered:
        calls = HermesParser(names) if fmt == "hermes" else JsonCallParser(names)
    if OPEN in template_source and split_reasoning:
        return _Chain(ThinkParser.after(prompt_tail), calls)
    return calls


class ChatReply:
    """One reply's parser and everything it produced so far."""

    def __init__(self, parser: Parser) -> None:
        self.parser = parser
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.deltas: list[CallDelta] = []

    def feed(self, text: str) -> Increment:
        return self._keep(self.parser.feed(text) if text else Increment())

    def finish(self) -> Increment:
        return self._keep(self.parser.finish())

    def _keep(self, inc: Increment) -> Increment:
        self.reasoning.append(inc.reasoning)
        self.content.append(inc.content)
        self.deltas += inc.calls
        return inc

    @property
    def calls(self) -> list[ToolCall]:
        return assemble(self.deltas)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """A reply that made calls and stopped on its own ends with "tool_calls", as OpenAI's do."""
        return "tool_calls" if engine_reason == "stop" and self.deltas else engine_reason

    def message_fields(self) -> dict[str, Any]:
        """content (None when the reply is only calls), reasoning_content (None without reasoning) and
        tool_calls (None without calls), as OpenAI's message has them."""
        content = "".join(self.content)
        reasoning = "".join(self.reasoning)
        calls = self.calls
        return {
            "content": content if content or not calls else None,
            "reasoning_content": reasoning or None,
            "tool_calls": [call_json(c) for c in calls] or None,
        }


def call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def delta_json(d: CallDelta) -> dict[str, Any]:
    """One streamed call delta: the first of a call has id, type and name; the rest only arguments."""
    if d.id is not None:
        return {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}}
    return {"index": d.index, "function": {"arguments": d.arguments}}
