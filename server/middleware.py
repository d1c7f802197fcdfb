"""ASGI middleware in front of every route: the drain gate, the API key check and the body size limit.

All are plain ASGI (not Starlette's BaseHTTPMiddleware) so they do not buffer or re-wrap streaming
responses, and a client disconnect still reaches the route's `receive`.
"""

from __future__ import annotations

import hmac
import threading

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


class Drain:
    """Requests in flight, and whether new ones are still taken; shared by the event loop that counts and
    the thread that waits (serve_cmd's shutdown).

    A request counts from its first byte in until its last byte out, so a stream is in flight until it
    ends. Once `close()` is called, new requests are refused with a 503 while those in flight finish.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._active = 0
        self._closed = False

    @property
    def active(self) -> int:
        return self._active

    def close(self) -> None:
        with self._changed:
            self._closed = True

    def enter(self) -> bool:
        """Counts a new request in; False once closed (then the request is not counted)."""
        with self._changed:
            if self._closed:
                return False
            self._active += 1
            return True

    def leave(self) -> None:
        with self._changed:
            self._active -= 1
            self._changed.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Blocks until no request is in flight or `timeout` seconds passed; True when idle."""
        with self._changed:
            return self._changed.wait_for(lambda: self._active == 0, timeout)


class DrainMiddleware:
    """Counts requests through `drain`, and answers 503 to new ones once it is closed."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self.drain.enter():
            err = ApiError(503, "the server is shutting down; retry on another instance",
                           type="service_unavailable_error", code="shutting_down")
            # Connection: close, so a keep-alive client does not send its next request to us either.
            response = err.response()
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()
