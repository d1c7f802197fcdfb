"""ASGI middleware in front of every route: the API key check and the request body size limit.

Both are plain ASGI (not Starlette's BaseHTTPMiddleware) so they do not buffer or re-wrap streaming
responses, and a client disconnect still reaches the route's `receive`.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vegaserve.server.errors import ApiError

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024

# Probes and scrapers carry no key: load balancers and Prometheus must reach these without secrets.
OPEN_PATHS = frozenset({"/health", "/metrics"})


class ApiKeyMiddleware:
    """Requires `Authorization: Bearer <api_key>` on every path outside OPEN_PATHS."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        auth = Headers(scope=scope).get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if not auth:
            err = ApiError(401, "missing API key: send it as 'Authorization: Bearer <key>'", code="invalid_api_key")
        elif scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
            # compare_digest: the time taken must not reveal how much of a guessed key was right.
            err = ApiError(401, "incorrect API key", code="invalid_api_key")
        else:
            await self.app(scope, receive, send)
            return
        await err.response()(scope, receive, send)


class BodySizeLimitMiddleware:
    """Refuses request bodies over `max_bytes` with a 413, before they are held in memory.

    A declared Content-Length is checked up front; a chunked body is counted as it arrives and the read
    fails inside the route, whose error handler answers with the same 413.
    """

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> ApiError:
        return ApiError(413, f"request body is larger than the limit of {self.max_bytes} bytes", code="body_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, counting_receive, send)
