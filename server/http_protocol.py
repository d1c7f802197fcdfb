"""uvicorn's h11 protocol with a deadline on each request's line and headers.

uvicorn closes a keep-alive connection that sends nothing for `timeout_keep_alive`, but a client that sends
its headers a byte every few seconds resets that timer with each byte and holds the connection forever (the
ASGI app never sees it, so no middleware can). Here each request's headers must be complete within
`header_timeout_s` of the connection opening or of the previous response ending; the body has its own
deadline in server/middleware.py.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("vegaserve.server")


class _HeaderDeadline(H11Protocol):
    header_timeout_s = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are complete: its cycle began
            self._disarm()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm()  # before a pipelined request, which super() handles at once, disarms it again
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _headers_late(self) -> None:
        self._header_timer = None
        waiting = self.cycle is None or self.cycle.response_complete
        if waiting and not self.transport.is_closing():
            peer = "%s:%d" % self.client if self.client else "a client"
            log.info("closed the connection of %s: its request headers did not arrive within %g s", peer,
                     self.header_timeout_s)
            self.transport.close()


def h11_with_header_deadline(timeout_s: float) -> type[H11Protocol]:
    """The protocol class to give uvicorn.Config(http=...)."""
    return type("H11WithHeaderDeadline", (_HeaderDeadline,), {"header_timeout_s": timeout_s})
