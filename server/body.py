"""JSON bodies in and out: a request body into one of the protocol models (or a 400 that says what is
wrong), and a model out as a response.

Routes parse their bodies here instead of letting FastAPI do it, because FastAPI answers 422 and
ignores bodies whose Content-Type is not JSON, while `curl -d` sends form-encoded headers and llama-server
users expect that to work. FastAPI then cannot see those bodies, so `openapi_body` declares each one in
the OpenAPI document for client generators and the fuzz tests.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from vegaserve.server.errors import ApiError, ClientDisconnected, from_validation_error

M = TypeVar("M", bound=BaseModel)


class _NotJson(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity, which are not JSON and would reach the sampler as numbers.
    raise _NotJson(f"{name} is not valid JSON")


def _lone_surrogate(data: Any) -> str | None:
    """The first string in `data` (keys included) that holds half a UTF-16 surrogate pair, if any.
    A loop, not recursion: the body may be nested as deep as the JSON parser allows."""
    pending = [data]
    while pending:
        value = pending.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return value
        elif isinstance(value, dict):
            pending.extend(value)
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return None


def decode_json(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    if not text.strip():
        raise ApiError(400, "request body is empty; expected a JSON object")
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except _NotJson as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except ValueError:
        # The only other ValueError json raises: an integer longer than Python converts (its message
        # tells the client to call sys.set_int_max_str_digits, which is ours to know, not theirs).
        limit = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
        raise ApiError(400, f"request body holds an integer of more than {limit} digits") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    # JSON lets an escape such as \ud800 stand alone, but no text can hold it: the tokenizer fails on it
    # (a 500 before this check). Valid UTF-8 bytes cannot carry one, so only an escape can bring it.
    if "\\u" in text and (bad := _lone_surrogate(data)) is not None:
        raise ApiError(400, f"request body holds a string with an unpaired UTF-16 surrogate: {ascii(bad)[:80]}")
    return data


def validate(model: type[M], data: Any) -> M:
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def read_body(request: Request) -> bytes:
    try:
        return await request.body()
    except ClientDisconnect:
        raise ClientDisconnected("while sending its body") from None


def parse_body(raw: bytes, model: type[M]) -> M:
    """The request body as `model`; CPU work that grows with the body, so the routes run it off the event
    loop (server/offload.py)."""
    return validate(model, decode_json(raw))


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra` declaring `model` as its required JSON body.

    The model's schema is written inline with its `$defs` substituted in place, since an operation's
    schema cannot carry definitions of its own (a `#/$defs/...` pointer would resolve against the whole
    document); the request models are not recursive, so this ends.
    """
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(value) for value in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


def json_response(model: BaseModel) -> Response:
    # Serialized by pydantic, not json.dumps: a non-finite float becomes null instead of failing the
    # whole response (json.dumps with allow_nan=False raises on it).
    return Response(model.model_dump_json(), media_type="application/json")
