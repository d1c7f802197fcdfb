"""Every failure leaves the server in OpenAI's envelope: `{"error": {"message", "type", "param", "code"}}`.

Clients (the OpenAI SDKs above all) read `error.message` and branch on the status code, so each kind of
failure gets the status OpenAI would give it: a request we cannot serve is a 400 (never FastAPI's 422), an
unknown model a 404, a dead engine a 503, and a bug of ours a 500 whose message says nothing internal.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vegaserve.engine.request import ContextLengthError, EngineDeadError, EngineError, InvalidRequestError

logger = logging.getLogger("vegaserve.server")

_MAX_LISTED_PROBLEMS = 3  # enough to fix a request; a long list of union branches helps nobody


class ClientDisconnected(Exception):
    """The client went away before the response was ready; nobody reads what we answer. The message says
    when ("while sending its body", ...) for the one log line it gets."""


class ServerShuttingDown(EngineDeadError):
    """The drain timed out with this request still running (server/serve_cmd.py): it ends with a 503, or
    with an error event where a stream already started."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down and stopped this request; retry on another instance")


class ApiError(Exception):
    """A failure with its HTTP status and envelope fields; raised anywhere in a route."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.close = close  # answer with Connection: close (a request body left unread, a server going away)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.close:
            headers["Connection"] = "close"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def from_engine_error(exc: EngineError) -> ApiError:
    # Order matters: ContextLengthError is an InvalidRequestError with its own code, and ServerShuttingDown
    # an EngineDeadError with its own.
    if isinstance(exc, ServerShuttingDown):
        return ApiError(503, str(exc), type="service_unavailable_error", code="shutting_down", close=True)
    if isinstance(exc, ContextLengthError):
        return ApiError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, str(exc))
    if isinstance(exc, EngineDeadError):
        return ApiError(503, str(exc) or "the engine has stopped", type="service_unavailable_error")
    # The engine's own errors carry a message meant for the client (see engine/request.py).
    return ApiError(500, str(exc), type="server_error")


def _describe(errors: list[Any]) -> tuple[str, str | None]:
    """A message naming each bad field and what is wrong with it, and the first field as `param`."""
    problems = []
    for err in errors[:_MAX_LISTED_PROBLEMS]:
        where = ".".join(str(part) for part in err.get("loc", ()) if part != "body") or "body"
        what = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        problems.append(f"{where}: {what}")
    if len(errors) > _MAX_LISTED_PROBLEMS:
        problems.append(f"and {len(errors) - _MAX_LISTED_PROBLEMS} more")
    first_loc = [part for part in errors[0].get("loc", ()) if part != "body"] if errors else []
    param = str(first_loc[0]) if first_loc else None
    return "; ".join(problems) or "invalid request", param


def from_validation_error(exc: ValidationError | RequestValidationError) -> ApiError:
    message, param = _describe(list(exc.errors()))
    return ApiError(400, message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def on_engine_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, EngineError)
        return from_engine_error(exc).response()

    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, (ValidationError, RequestValidationError))
        return from_validation_error(exc).response()

    async def on_client_gone(request: Request, exc: Exception) -> Response:
        # One line, not a traceback: a client that leaves is ordinary. The 499 (nginx's "client closed
        # request") reaches no one, and uvicorn writes no access line for a connection that is gone.
        when = str(exc) or ("while sending its body" if isinstance(exc, ClientDisconnect) else "before the response")
        logger.info("%s %s from %s: the client went away %s", request.method, request.url.path, _peer(request), when)
        return Response(status_code=499)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        # Starlette raises these for unknown routes (404) and wrong methods (405).
        assert isinstance(exc, StarletteHTTPException)
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            err = ApiError(404, f"no such route: {where}", code="not_found")
        elif exc.status_code == 405:
            err = ApiError(405, f"method not allowed: {where}", code="method_not_allowed")
        else:
            err = ApiError(exc.status_code, str(exc.detail))
        response = err.response()
        if exc.headers:
            response.headers.update(exc.headers)  # e.g. Allow: on a 405
        return response

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(EngineError, on_engine_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(ClientDisconnected, on_client_gone)
    app.add_exception_handler(ClientDisconnect, on_client_gone)  # Starlette's, from reading the body


def _peer(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "an unknown client"


class CatchAllMiddleware:
    """Turns an exception no handler took into a logged 500 in the envelope.

    Starlette's own catch-all sends its response and then re-raises, so the server logs the error a
    second time and test clients see an exception instead of the response; catching it here ends it.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise  # half a response is out; only the server can end the connection now
            err = ApiError(500, "internal server error", type="server_error")
            await err.response()(scope, receive, send)
