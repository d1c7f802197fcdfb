"""JSON bodies in and out: a request body into one of the protocol models (or a 400 that says what is
wrong), and a model out as a response.

Routes parse their bodies here instead of letting FastAPI do it, because FastAPI answers 422 and
ignores bodies whose Content-Type is not JSON, while `curl -d` sends form-encoded headers and llama-server
users expect that to work.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from vegaserve.server.errors import ApiError, from_validation_error

M = TypeVar("M", bound=BaseModel)


def _refuse_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity, which are not JSON and would reach the sampler as numbers.
    raise ValueError(f"{name} is not valid JSON")


def decode_json(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    if not text.strip():
        raise ApiError(400, "request body is empty; expected a JSON object")
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None


def validate(model: type[M], data: Any) -> M:
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def parse_body(request: Request, model: type[M]) -> M:
    return validate(model, decode_json(await request.body()))


def json_response(model: BaseModel) -> Response:
    # Serialized by pydantic, not json.dumps: a non-finite float becomes null instead of failing the
    # whole response (json.dumps with allow_nan=False raises on it).
    return Response(model.model_dump_json(), media_type="application/json")
