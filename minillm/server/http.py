"""uvicorn's HTTP/1.1 protocols with deadlines for slow clients, and the server's uvicorn settings.

The server speaks HTTP/1.1 through httptools where it is installed (as uvicorn's "auto" does, and
vLLM's server): a streamed event then costs about 10 us less of the event loop than through h11,
pure Python. Both protocols carry the deadlines below.

uvicorn times out an idle keep-alive connection but not one that is slow to send its headers: a
client trickling a header byte a second would hold its connection for ever. Here the headers of
each request must be in within header_timeout_s of the connection opening or of the previous
response; otherwise the connection is closed.

Nor does it drop a client that stops reading: the response waits (uvicorn's send() blocks while
the socket's buffer is full) and the connection, with its buffered output, stays. Here a
connection whose writes are blocked and whose client has read none of its buffer for
write_timeout_s is aborted, its buffer discarded; the app sees the client as gone (and the
stream's requests are aborted). A client that reads, however slowly, is served.

A process has a limit on open files, and every connection takes one: the server raises its soft limit
towards the hard one (raise_open_files_limit, as vLLM does). At the hard limit asyncio's accept loop
tried every connection of the backlog (2048) on every pass, logging a traceback and arming a retry
for each: tens of thousands of tries and log lines a second. A ListeningSocket lets one refused
accept a pass through (asyncio then pauses accepting for a second), and AcceptErrorLog reports it once
per ACCEPT_ERROR_LOG_S. Those connections wait in the backlog until others close.

An HTTP/1.0 client has no chunked encoding: through httptools, a response it gets without a length
(an event stream) ends where the connection closes (close_delimited_send), as h11 sends it.

Bytes that do not parse as HTTP (a bad request line or header, invalid chunked encoding, headers
too large) get uvicorn's 400, here an OpenAI-style JSON error body instead of its plain text, and
after the responses already due on the connection rather than written over them; then the
connection closes (the parser cannot find where a next request would start).
"""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
import socket
import sys
import time
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:   # httptools not installed: h11 serves alone
    HttpToolsProtocol = None

from minillm.server.errors import error_body
from minillm.server.limits import ServerLimits

logger = logging.getLogger("minillm.server")

# h11 refuses a request line plus headers larger than this (uvicorn's default, made explicit).
MAX_HEADER_BYTES = 16 * 1024
# The soft open-files limit the server asks for (vLLM's set_ulimit target), within the hard limit.
OPEN_FILES_TARGET = 65535
# The message asyncio's accept loop gives its exception handler when no file descriptor is left.
ACCEPT_OUT_OF_RESOURCE = "socket.accept() out of system resource"
ACCEPT_ERROR_LOG_S = 10.0        # at most one report of refused accepts per this many seconds
# Under asyncio's one-second pause after a refused accept: the first accept of each pass is tried.
ACCEPT_REFUSAL_GAP_S = 0.5
# Looks a blocked write buffer gets per stream timeout, to see whether its client read any of it.
WRITE_CHECKS_PER_TIMEOUT = 4


class HeadersTooLarge(ValueError):
    """A request line and headers past MAX_HEADER_BYTES (raised in httptools' callbacks)."""


class _Deadlines:
    """The header and write deadlines, for either of uvicorn's HTTP/1.1 protocols (mixed in before it)."""

    header_timeout_s: float = 10.0
    write_timeout_s: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._pending_400: bytes | None = None     # a 400 that waits for the responses due before it
        super().connection_made(transport)
        self._arm_header_timer()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not HTTP, as JSON: now, or once the responses to the
        requests parsed before them have gone out (uvicorn wrote it over them and closed)."""
        why = sys.exc_info()[1]      # the parser's error, which uvicorn is handling (None: msg says it)
        if isinstance(getattr(why, "__context__", None), HeadersTooLarge):
            why = why.__context__    # raised in a parser callback, which httptools reports as its own error
        message = f"Invalid HTTP request: {why}" if why is not None and str(why) else msg
        self._pending_400 = json.dumps(error_body(400, message, code="invalid_http_request"), separators=(",", ":")).encode()
        cycle = self.cycle
        is_response_due = cycle is not None and not cycle.response_complete and (
            cycle.response_started or not cycle.more_body)
        if is_response_due or getattr(self, "pipeline", None):   # httptools queues parsed requests
            self.flow.pause_reading()
            return
        self._write_pending_400()

    def _write_pending_400(self) -> None:
        body, self._pending_400 = self._pending_400, None
        if self.transport.is_closing():
            return
        head = [b"HTTP/1.1 400 Bad Request\r\n"]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n\r\n", body]
        self.transport.write(b"".join(head))
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self._cancel_write_timer()
        super().connection_lost(exc)
        # uvicorn cancels its keep-alive timer only for a clean close: a client that reset the
        # connection left its protocol, transport and request state alive in the timer until it
        # fired (timeout_keep_alive_s), so a client churning connections held thousands at once.
        self._unset_keepalive_if_required()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._last_read_at = self.loop.time()
            self._num_unread = self.transport.get_write_buffer_size()
            self._write_timer = self.loop.call_later(self._write_check_s(self.write_timeout_s),
                                                     self._check_client_reads)

    def resume_writing(self) -> None:
        self._cancel_write_timer()
        super().resume_writing()

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_check_s(self, remaining_s: float) -> float:
        """Seconds to the next look at a blocked write buffer: a quarter of the timeout at most, so a
        client that read a little is dropped at most that late once it reads no more."""
        return min(remaining_s, self.write_timeout_s / WRITE_CHECKS_PER_TIMEOUT)

    def _check_client_reads(self) -> None:
        """While writes are blocked nothing is added to the buffer, so a smaller buffer means the client
        read some of it; one that has read nothing for write_timeout_s is dropped. (Waiting for the
        buffer to drain to its low-water mark instead dropped a client reading steadily but slowly.)"""
        self._write_timer = None
        now, num_unread = self.loop.time(), self.transport.get_write_buffer_size()
        if num_unread < self._num_unread:
            self._last_read_at = now
        self._num_unread = num_unread
        remaining_s = self._last_read_at + self.write_timeout_s - now
        if remaining_s > 0:
            self._write_timer = self.loop.call_later(self._write_check_s(remaining_s), self._check_client_reads)
            return
        logger.warning("dropping a connection whose client read nothing for %.1f s", self.write_timeout_s)
        self.transport.abort()   # close() would wait for the client to take the buffered output

    def on_response_complete(self) -> None:
        if self._pending_400 is not None and not getattr(self, "pipeline", None):
            self._write_pending_400()      # the last response due before the bad bytes is out
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


class TimedH11Protocol(_Deadlines, H11Protocol):
    """H11Protocol (pure Python) that drops a client slow to send its headers, or that stops reading,
    and refuses headers past MAX_HEADER_BYTES that came whole in one read (h11's own limit holds
    only headers still incomplete)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        next_event = self.conn.next_event

        def next_event_within_limit():
            event = next_event()
            if isinstance(event, h11.Request) and len(event.target) + sum(
                    len(name) + len(value) + 4 for name, value in event.headers) > MAX_HEADER_BYTES:
                raise h11.RemoteProtocolError(f"the request line and headers exceed {MAX_HEADER_BYTES} bytes")
            return event

        self.conn.next_event = next_event_within_limit

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:
            self._disarm_header_timer()   # a request's headers are in: it is the app's now


def close_delimited_send(cycle: Any) -> Any:
    """cycle.send for an HTTP/1.0 request on the httptools protocol: a response that gives no length
    (an event stream) has its body written as it comes and ends where the connection closes, as h11
    frames it (RFC 9112 section 6.3). uvicorn's httptools cycle sent such a client Transfer-Encoding:
    chunked, which HTTP/1.0 does not have: its chunk sizes landed in the stream's text."""
    send = cycle.send
    is_close_delimited = False

    async def send_close_delimited(message: dict) -> None:
        nonlocal is_close_delimited
        if message["type"] == "http.response.start" and not cycle.response_started:
            names = {name.lower() for name, _ in [*cycle.default_headers, *message.get("headers", [])]}
            is_close_delimited = (b"content-length" not in names and b"transfer-encoding" not in names
                                  and cycle.scope["method"] != "HEAD" and message["status"] not in (204, 304))
            if is_close_delimited:
                cycle.chunked_encoding = False       # no transfer-encoding header goes out
        elif is_close_delimited and message["type"] == "http.response.body" and not cycle.response_complete:
            if cycle.flow.write_paused and not cycle.disconnected:
                await cycle.flow.drain()
            if cycle.disconnected:
                return
            cycle.transport.write(message.get("body", b""))
            if not message.get("more_body", False):
                cycle.response_complete = True
                cycle.message_event.set()
                cycle.transport.close()               # the close ends the body
                cycle.on_response()
            return
        await send(message)

    return send_close_delimited


if HttpToolsProtocol is not None:
    class TimedHttpToolsProtocol(_Deadlines, HttpToolsProtocol):
        """HttpToolsProtocol (a C parser, and a response body written without a state machine: about 10 us
        less a streamed event than h11) with the same deadlines, and h11's limit on the size of a
        request's headers (exceeded: 400 and the connection closed, as h11 answers)."""

        max_header_bytes: int = MAX_HEADER_BYTES

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._is_in_headers, self._num_header_bytes = True, 0
            super().connection_made(transport)

        def data_received(self, data: bytes) -> None:
            if self._is_in_headers:
                self._num_header_bytes += len(data)
            super().data_received(data)
            # Still no end of headers after this many bytes (a body that came with them does not count).
            if self._is_in_headers and self._num_header_bytes > self.max_header_bytes \
                    and not self.transport.is_closing():
                logger.warning("refusing a request whose headers exceed %d bytes", self.max_header_bytes)
                self.send_400_response(f"Invalid HTTP request: {self._too_large()}")

        # Headers that arrive whole in one read are counted as they are parsed: data_received's count
        # sees them end in the same read, and took them whatever their size.
        def on_message_begin(self) -> None:
            self._num_parsed_header_bytes = 0
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._count_header_bytes(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_header_bytes(len(name) + len(value) + 4)     # ": " and CRLF
            super().on_header(name, value)

        def _count_header_bytes(self, num_bytes: int) -> None:
            self._num_parsed_header_bytes += num_bytes
            if self._num_parsed_header_bytes > self.max_header_bytes:
                raise HeadersTooLarge(self._too_large())

        def _too_large(self) -> str:
            return f"the request line and headers exceed {self.max_header_bytes} bytes"

        def on_headers_complete(self) -> None:
            self._is_in_headers = False
            self._disarm_header_timer()   # a request's headers are in: it is the app's now
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._is_in_headers, self._num_header_bytes = True, 0   # the next request's headers come next

        def _start_asgi_task(self, cycle: Any, app: Any) -> None:
            self._served_cycle = cycle      # the request whose response is going out
            if cycle.scope["http_version"] == "1.0":
                cycle.send = close_delimited_send(cycle)
            super()._start_asgi_task(cycle, app)

        def connection_lost(self, exc: Exception | None) -> None:
            """uvicorn tells only self.cycle, the last request parsed, that the client is gone: with
            requests pipelined behind a response, that is one waiting its turn, and the request served
            (a stream) went on writing to the closed socket to its end. Tell the served one too."""
            served = getattr(self, "_served_cycle", None)
            super().connection_lost(exc)
            if served is not None and served is not self.cycle and not served.response_complete:
                served.disconnected = True
                served.message_event.set()      # its receive() answers http.disconnect
            self.pipeline.clear()               # never to be served
else:
    TimedHttpToolsProtocol = None


def raise_open_files_limit(target: int = OPEN_FILES_TARGET) -> int:
    """Raise the soft limit on open files (one per connection) to target, or to the hard limit if that
    is lower; the soft limit now. A service manager's default of 1024 held the server to as many
    connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:
            logger.warning("the open-files limit is %d (each connection takes one) and could not be raised: %s; "
                           "raise it with ulimit -n", soft, exc)
    return soft


class ListeningSocket(socket.socket):
    """A listening socket whose accept() is refused for want of file descriptors at most once per
    ACCEPT_REFUSAL_GAP_S; the other tries of the same pass of asyncio's accept loop find nothing to
    accept (BlockingIOError), which ends the pass. asyncio pauses accepting for a second after the one
    refusal, so no pass spins."""

    _refused_at = float("-inf")

    def accept(self) -> tuple[socket.socket, Any]:
        try:
            return super().accept()
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                raise
            now = time.monotonic()
            if now - self._refused_at < ACCEPT_REFUSAL_GAP_S:
                raise BlockingIOError(errno.EAGAIN, "accepting is paused") from None
            self._refused_at = now
            raise


class AcceptErrorLog:
    """An event loop's exception handler: accepts refused for want of file descriptors reported once
    per interval_s with their count (asyncio logged each with a traceback, for every connection of
    the backlog on every try); anything else as the loop's default handler reports it."""

    def __init__(self, interval_s: float = ACCEPT_ERROR_LOG_S) -> None:
        self.interval_s = interval_s
        self.num_refused = 0                  # refused accepts (each a pause of accepting) since the last report
        self.reported_at = float("-inf")

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        args = getattr(context.get("handle"), "_args", None) or ()
        if any(isinstance(arg, ListeningSocket) and arg.fileno() == -1 for arg in args):
            return      # asyncio's retry of accepting on a socket the stopping server has closed since
        if context.get("message") != ACCEPT_OUT_OF_RESOURCE:
            loop.default_exception_handler(context)
            return
        self.num_refused += 1
        now = time.monotonic()
        if now - self.reported_at < self.interval_s:
            return
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        logger.error("out of file descriptors (%s; the limit is %d open files): new connections wait in the "
                     "backlog until others close (accepting paused %d times since the last report, at most every "
                     "%.0f s); raise the limit with ulimit -n", context.get("exception"), limit, self.num_refused,
                     self.interval_s)
        self.num_refused, self.reported_at = 0, now


def timed_protocol(limits: ServerLimits, http: str = "auto") -> type:
    """The protocol class uvicorn builds per connection, with the limits' deadlines: httptools where it
    is installed (http="auto"; as uvicorn's own "auto" picks), else h11."""
    if http not in ("auto", "httptools", "h11"):
        raise ValueError(f"http must be auto, httptools or h11, got {http!r}")
    base = TimedHttpToolsProtocol if http != "h11" else TimedH11Protocol
    if base is None:
        if http == "httptools":
            raise ValueError("http='httptools' needs the httptools package")
        base = TimedH11Protocol
    return type(base.__name__, (base,), {"header_timeout_s": limits.header_timeout_s,
                                         "write_timeout_s": limits.stream_timeout_s})


def uvicorn_settings(limits: ServerLimits, http: str = "auto") -> dict[str, Any]:
    """uvicorn's settings for the server's timeouts: keep-alive, request headers, stalled writes, header size."""
    return {"http": timed_protocol(limits, http), "timeout_keep_alive": limits.timeout_keep_alive_s,
            "h11_max_incomplete_event_size": MAX_HEADER_BYTES}


def uvicorn_config(app: Any, limits: ServerLimits, http: str = "auto", **kwargs: Any) -> uvicorn.Config:
    """uvicorn's Config of app with the server's timeouts (uvicorn_settings)."""
    return uvicorn.Config(app, **uvicorn_settings(limits, http), **kwargs)
