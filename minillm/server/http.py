"""uvicorn's HTTP/1.1 protocol with a deadline for request headers, and the server's uvicorn settings.

uvicorn times out an idle keep-alive connection but not one that is slow to send its headers: a
client trickling a header byte a second would hold its connection for ever. Here the headers of
each request must be in within header_timeout_s of the connection opening or of the previous
response; otherwise the connection is closed.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from minillm.server.limits import ServerLimits

logger = logging.getLogger("minillm.server")

# h11 refuses a request line plus headers larger than this (uvicorn's default, made explicit).
MAX_HEADER_BYTES = 16 * 1024


class HeaderTimeoutH11Protocol(H11Protocol):
    """H11Protocol that closes a connection whose next request's headers do not arrive in time."""

    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:
            self._disarm_header_timer()   # a request's headers are in: it is the app's now

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm_header_timer()       # before super(): it may start a pipelined request at once
        super().on_response_complete()

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            logger.debug("closing a connection whose request headers took over %.1f s", self.header_timeout_s)
            self.transport.close()


def header_timeout_protocol(header_timeout_s: float) -> type[HeaderTimeoutH11Protocol]:
    """A HeaderTimeoutH11Protocol class with the given deadline (uvicorn builds one per connection)."""
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout_s": header_timeout_s})


def uvicorn_config(app: Any, limits: ServerLimits, **kwargs: Any) -> uvicorn.Config:
    """uvicorn settings with the server's timeouts: keep-alive, request headers, header size."""
    return uvicorn.Config(app, http=header_timeout_protocol(limits.header_timeout_s),
                          timeout_keep_alive=limits.timeout_keep_alive_s,
                          h11_max_incomplete_event_size=MAX_HEADER_BYTES, **kwargs)
