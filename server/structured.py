"""What a request asks its output to match, and which tools it offers: the request fields for constrained
decoding and tool calls (server/protocol.py), checked and turned into the engine's GuideSpec.

The constraint fields, one per request (two at once are a 400 naming both):

    response_format   OpenAI's {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name",
                      "schema", "strict"}} ({"type": "text"}: none)
    json_schema       llama-server's schema, bare
    grammar           llama-server's GBNF grammar
    guided_json, guided_regex, guided_choice, guided_grammar   vLLM's

plus the one `tools` + `tool_choice` imply: "required" constrains the reply to a JSON array of calls
(tool_calls.required_schema), a named function to that function's arguments; "auto" and "none" constrain
nothing ("none" also keeps the reply from being read for calls). A grammar that does not compile, a tool
choice naming no offered tool, or a malformed tool is a 400 with the field named; the grammar is compiled
here, on the server's worker thread, so the engine's own compile is a cache hit.
"""

from __future__ import annotations

import json
from typing import Any

from vegaserve.engine.request import GuideSpec, InvalidRequestError
from vegaserve.server.errors import ApiError
from vegaserve.server.protocol import NamedToolChoice, SamplingFields, ToolChoice
from vegaserve.server.tool_calls import parameters_schema, required_schema


def constraint(request: SamplingFields) -> tuple[GuideSpec, str] | None:
    """The request's own constraint and the field that gave it; None if it sets none."""
    given: list[tuple[GuideSpec, str]] = []
    rf = request.response_format
    if rf is not None and rf.type == "json_object":
        given.append((GuideSpec("json_object"), "response_format"))
    elif rf is not None and rf.type == "json_schema":
        given.append((GuideSpec.json_schema(rf.json_schema.schema_), "response_format"))  # type: ignore[union-attr]
    if request.json_schema is not None:
        given.append((GuideSpec.json_schema(request.json_schema), "json_schema"))
    if request.guided_json is not None:
        schema = request.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ApiError(400, f"guided_json is not JSON: {e}", param="guided_json") from None
        given.append((GuideSpec.json_schema(schema), "guided_json"))
    for field, kind in (("grammar", "grammar"), ("guided_grammar", "grammar"), ("guided_regex", "regex")):
        text = getattr(request, field)
        if text is not None:
            given.append((GuideSpec(kind, text), field))
    if request.guided_choice is not None:
        given.append((GuideSpec.choice(request.guided_choice), "guided_choice"))
    if len(given) > 1:
        names = ", ".join(field for _, field in given)
        raise ApiError(400, f"give one output constraint, not several: {names}", param=given[1][1])
    return given[0] if given else None


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: ToolChoice | None) -> None:
    """Each tool a function with a name (names unique) and, if given, an object schema for its parameters;
    a tool choice that needs tools names one that is offered."""
    names: list[str] = []
    for i, tool in enumerate(tools or ()):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not fn["name"]:
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           param=f"tools[{i}]")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                           param=f"tools[{i}].function.parameters")
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise ApiError(400, "tools: two functions have the same name", param="tools")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        offered = ", ".join(repr(n) for n in names) or "none"
        raise ApiError(400, f"tool_choice names function {tool_choice.function.name!r}, which is not among the "
                            f"tools (offered: {offered})", param="tool_choice")
    if tool_choice == "required" and not names:
        raise ApiError(400, "tool_choice is 'required' but no tools are given", param="tool_choice")


def tool_constraint(tools: list[dict[str, Any]] | None, tool_choice: ToolChoice | None,
                    parallel: bool) -> tuple[GuideSpec, str] | None:
    """The constraint tool_choice "required" or a named function puts on the reply."""
    if tool_choice == "required":
        return GuideSpec.json_schema(required_schema(tools or [], parallel)), "tool_choice"
    if isinstance(tool_choice, NamedToolChoice):
        tool = next(t for t in tools or () if t["function"]["name"] == tool_choice.function.name)
        return GuideSpec.json_schema(parameters_schema(tool)), "tool_choice"
    return None


def compile_constraint(engine: Any, constraint: tuple[GuideSpec, str] | None) -> GuideSpec | None:
    """Compile it now (a worker thread), so a bad schema, grammar or regex is a 400 naming its field."""
    if constraint is None:
        return None
    spec, field = constraint
    try:
        engine.grammars.compile(spec)
    except InvalidRequestError as e:
        raise ApiError(400, f"{field}: {e}", param=field) from None
    return spec
