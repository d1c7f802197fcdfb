"""ASGI middleware in front of every route: the drain gate, the API key check, the body size limit and the
upload deadline.

All are plain ASGI (not Starlette's BaseHTTPMiddleware) so they do not buffer or re-wrap streaming
responses, and a client disconnect still reaches the route's `receive`.
"""

from __future__ import annotations

import asyncio
import hmac
import threading
import time

import anyio
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
    ends. Once `close()` is called, new requests are refused with a 503 while those in flight finish; `cut()`
    then ends those still running (server/generation.py waits on `cut_event()` beside the engine).
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._active = 0
        self._closed = False
        self._cut = False
        self._cut_events: dict[asyncio.Event, asyncio.AbstractEventLoop] = {}

    @property
    def active(self) -> int:
        return self._active

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._changed:
            self._closed = True

    def cut(self) -> None:
        """Sets every cut event, from any thread: the requests waiting on them end now."""
        with self._changed:
            self._cut = True
            events = list(self._cut_events.items())
        for event, loop in events:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that loop has closed; nothing waits on it any more
                pass

    def cut_event(self) -> asyncio.Event:
        """An event of the running loop, set by `cut()`; give it back with `forget`."""
        event = asyncio.Event()
        with self._changed:
            if self._cut:
                event.set()
            else:
                self._cut_events[event] = asyncio.get_running_loop()
        return event

    def forget(self, event: asyncio.Event) -> None:
        with self._changed:
            self._cut_events.pop(event, None)

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
            # Connection: close, so a keep-alive client does not send its next request to us either.
            err = ApiError(503, "the server is shutting down; retry on another instance",
                           type="service_unavailable_error", code="shutting_down", close=True)
            await err.response()(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()


class UploadDeadlineMiddleware:
    """A request's body must arrive within `timeout_s` of its headers: a client sending a byte every few
    seconds would otherwise hold its connection, its memory and a drain, forever. Past the deadline the read
    fails with a 408; once the drain closes, a body still arriving is not waited for (a 503), so a half-sent
    request cannot hold shutdown for the whole drain timeout. Both answers close the connection, whose rest
    of the body is never read. Reads after the body (disconnect watches) pass through untouched.
    """

    POLL_S = 0.25  # how soon a waiting read notices the drain closing

    def __init__(self, app: ASGIApp, timeout_s: float, drain: Drain) -> None:
        self.app = app
        self.timeout_s = timeout_s
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = time.monotonic() + self.timeout_s
        body_done = False

        async def guarded_receive() -> Message:
            nonlocal body_done
            while not body_done:
                if self.drain.closed:
                    raise ApiError(503, "the server is shutting down; the request body was not finished",
                                   type="service_unavailable_error", code="shutting_down", close=True)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ApiError(408, f"the request body did not arrive within {self.timeout_s:g} s",
                                   code="request_timeout", close=True)
                with anyio.move_on_after(min(left, self.POLL_S)):
                    message = await receive()
                    body_done = message["type"] != "http.request" or not message.get("more_body", False)
                    return message
            return await receive()

        await self.app(scope, guarded_receive, send)
