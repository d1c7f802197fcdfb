"""Tool calls out of a reply's text, per model family, whole or as OpenAI's streamed deltas.

The formats (the chat template says which one a model was trained on, `tool_format`):

    hermes   <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>  (Qwen2.5/3/3.6, Hermes 2/3); text
             outside the tags is content, several calls are several blocks
    json     the whole reply is {"name": "f", "parameters": {...}} (Llama 3.x, after an optional
             <|python_tag|>), or a list of such objects, or several separated by ';'; the fallback for
             templates that name no format. Only names of the request's tools count, so an ordinary JSON
             answer is never taken for a call.
    harmony  gpt-oss's channels (server/harmony.py parses those itself)

With `tool_choice` "required" or a named function, decoding is constrained (engine/grammar.py) to a JSON
array of `{"name", "parameters"}` objects (`required_schema`) or to the named tool's arguments, whatever the
family, and `ArrayCallParser` / `NamedCallParser` read that.

Every parser takes the text as it is generated (`feed`, then `finish`) and gives `Increment`s; a non-streamed
reply goes through the same parser in one piece, so both modes assemble to the same calls. A call's first
delta carries its index, id, type and name with arguments ""; the arguments follow (OpenAI's order): in one
piece when its block closes, or as they are generated for a named call.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

from vegaserve.server.reasoning import held_prefix


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class CallDelta:
    """A piece of the call at `index`: the first one has id and name, the others arguments text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text


@dataclass
class Increment:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __iadd__(self, other: Increment) -> Increment:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


def assemble(deltas: list[CallDelta]) -> list[ToolCall]:
    """The calls that a run of deltas spells (what a client assembles from a stream)."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if d.index not in calls:
            calls[d.index] = ToolCall(d.id or "", d.name or "", "")
        calls[d.index].arguments += d.arguments
    return [calls[i] for i in sorted(calls)]


class Parser(Protocol):
    def feed(self, text: str) -> Increment: ...

    def finish(self) -> Increment: ...


class _Calls:
    """Numbers the calls of one reply and writes each one's deltas."""

    def __init__(self) -> None:
        self.count = 0

    def whole(self, name: str, arguments: str) -> list[CallDelta]:
        index, self.count = self.count, self.count + 1
        return [CallDelta(index, new_call_id(), name, ""), CallDelta(index, arguments=arguments)]


def _arguments_text(value: Any) -> str | None:
    """A call's arguments as the JSON object text OpenAI sends; None if they are no object."""
    if isinstance(value, str):  # some models write the object as a JSON string
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if value is None:
        value = {}
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _call_of(obj: Any, names: frozenset[str] | None, keys: tuple[str, ...]) -> tuple[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    text = _arguments_text(args)
    return None if text is None else (obj["name"], text)


class PlainParser:
    """No tools, no reasoning: every increment is content."""

    def feed(self, text: str) -> Increment:
        return Increment(content=text)

    def finish(self) -> Increment:
        return Increment()


class HermesParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, names: frozenset[str] | None = None) -> None:
        self.names = names
        self.calls = _Calls()
        self._held = ""
        self._inside = False

    def feed(self, text: str) -> Increment:
        text, self._held = self._held + text, ""
        out = Increment()
        while text:
            if not self._inside:
                start = text.find(self.OPEN)
                if start < 0:
                    keep = held_prefix(text, self.OPEN)
                    out.content += text[: len(text) - keep]
                    self._held = text[len(text) - keep:]
                    break
                out.content += text[:start]
                self._inside, text = True, text[start + len(self.OPEN):]
            else:
                end = text.find(self.CLOSE)
                if end < 0:
                    self._held = text
                    break
                out += self._block(text[:end])
                self._inside, text = False, text[end + len(self.CLOSE):]
        return out

    def _block(self, body: str) -> Increment:
        try:
            call = _call_of(json.loads(body), self.names, ("arguments", "parameters"))
        except json.JSONDecodeError:
            call = None
        if call is None:  # not a call after all: the model's text, as it wrote it
            return Increment(content=self.OPEN + body + self.CLOSE)
        return Increment(calls=self.calls.whole(*call))

    def finish(self) -> Increment:
        held, self._held = self._held, ""
        if not self._inside:
            return Increment(content=held)
        # an unclosed block (the model stopped at its end-of-turn, or max_tokens): a call if it parses
        self._inside = False
        out = self._block(held)
        if not out.calls:
            out.content = self.OPEN + held
        return out


class JsonCallParser:
    """A reply that is nothing but one or more JSON calls (Llama 3.x). Such a reply is held until it ends:
    only then can it be told from an answer that starts with '{'."""

    TAG = "<|python_tag|>"

    def __init__(self, names: frozenset[str] | None = None) -> None:
        self.names = names
        self.calls = _Calls()
        self._held = ""
        self._holding: bool | None = None  # None until the first non-whitespace character

    def feed(self, text: str) -> Increment:
        if self._holding is False:
            return Increment(content=text)
        self._held += text
        head = self._held.lstrip()
        if not head or (self.TAG.startswith(head) and head != self.TAG):
            return Increment()
        self._holding = head[0] in "{[" or head.startswith(self.TAG)
        if self._holding:
            return Increment()
        held, self._held = self._held, ""
        return Increment(content=held)

    def finish(self) -> Increment:
        held, self._held = self._held, ""
        calls = self._parse(held.strip().removeprefix(self.TAG).strip())
        if calls is None:
            return Increment(content=held)
        out = Increment()
        for name, args in calls:
            out.calls += self.calls.whole(name, args)
        return out

    def _parse(self, text: str) -> list[tuple[str, str]] | None:
        for candidate in (text, "[" + text.replace(";", ",") + "]" if ";" in text else None):
            if candidate is None:
                continue
            try:
                value = json.loads(candidate)
            except json.JSONDecodeError:
                continue
            items = value if isinstance(value, list) else [value]
            calls = [_call_of(v, self.names, ("parameters", "arguments")) for v in items]
            if items and all(c is not None for c in calls):
                return calls  # type: ignore[return-value]
        return None


class ArrayCallParser:
    """tool_choice "required": the reply is constrained to `required_schema`, a JSON array of
    {"name", "parameters"} objects; each call is sent when its object closes."""

    def __init__(self) -> None:
        self.calls = _Calls()
        self._buf = ""
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._start = -1  # where the element being read starts in _buf

    def feed(self, text: str) -> Increment:
        out = Increment()
        base = len(self._buf)
        self._buf += text
        for i, ch in enumerate(text, base):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
                if self._depth == 2 and ch == "{":
                    self._start = i
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 1 and ch == "}" and self._start >= 0:
                    out += self._element(self._buf[self._start : i + 1])
                    self._start = -1
        return out

    def _element(self, text: str) -> Increment:
        try:
            call = _call_of(json.loads(text), None, ("parameters", "arguments"))
        except json.JSONDecodeError:
            call = None
        return Increment(calls=self.calls.whole(*call)) if call else Increment()

    def finish(self) -> Increment:
        if self.calls.count:
            return Increment()
        # the grammar makes this unreachable unless decoding was cut short (max_tokens): show what came
        return Increment(content=self._buf)


class NamedCallParser:
    """tool_choice naming a function: the reply is constrained to its arguments object, streamed as they
    come."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._started = False

    def feed(self, text: str) -> Increment:
        if not text:
            return Increment()
        if not self._started:
            self._started = True
            return Increment(calls=[CallDelta(0, new_call_id(), self.name, ""), CallDelta(0, arguments=text)])
        return Increment(calls=[CallDelta(0, arguments=text)])

    def finish(self) -> Increment:
        if self._started:
            return Increment()
        return Increment(calls=[CallDelta(0, new_call_id(), self.name, "")])


def tool_format(template_source: str) -> str:
    """Which call format a chat template teaches: 'harmony', 'hermes' or 'json'."""
    if "<|channel|>" in template_source:
        return "harmony"
    if "<tool_call>" in template_source:
        return "hermes"
    return "json"


def tool_names(tools: list[dict[str, Any]] | None) -> frozenset[str]:
    return frozenset(t["function"]["name"] for t in tools or ())


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema a tool_choice "required" reply is constrained to: one call or more (one with
    parallel_tool_calls false), each naming one of the tools with arguments of its schema."""
    items = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "parameters": parameters_schema(t)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items},
                              "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's arguments schema; a function without one takes an object of anything."""
    params = tool["function"].get("parameters")
    return params if params else {"type": "object"}
