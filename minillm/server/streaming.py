"""Server-sent event responses written with backpressure, and cut off when the client stops reading."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
T = TypeVar("T")
_SCOPE_KEY = "minillm.hang_up"


class ClientGone(Exception):
    """The client hung up while HangUpWatch.run() waited."""


class FinalEvent(str):
    """The last event of a stream: sent with the end of the body in one write."""

    __slots__ = ()


class HangUpWatch:
    """Notices a request's client hanging up, with one listener task for the request's whole life.

    run(awaitable) awaits in the caller's own task and cancels it if the client leaves meanwhile:
    a wait costs no task of its own, where each used to start (and cancel) a listener and a worker.
    """

    def __init__(self, receive: Receive) -> None:
        self.hung_up = False        # http.disconnect arrived (also the case once the response is complete)
        self._target: asyncio.Task | None = None
        self._fired = False         # the listener cancelled _target
        self._listener = asyncio.ensure_future(self._listen(receive))

    @classmethod
    def of(cls, scope: Scope, receive: Receive) -> "HangUpWatch":
        """The request's watch, made on first use."""
        watch = scope.get(_SCOPE_KEY)
        if watch is None:
            watch = scope[_SCOPE_KEY] = cls(receive)
        return watch

    async def _listen(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.hung_up = True
        if self._target is not None:
            self._fired = True
            self._target.cancel()

    async def run(self, awaitable: Awaitable[T]) -> T:
        """awaitable's result; ClientGone (the awaitable cancelled) if the client hangs up first."""
        if self.hung_up:
            close = getattr(awaitable, "close", None)
            if close is not None:
                close()             # never started: no "never awaited" warning
            raise ClientGone
        task = asyncio.current_task()
        self._target, self._fired = task, False
        try:
            result = await awaitable
        except asyncio.CancelledError:
            if not self._fired or _uncancel(task):
                raise               # cancelled from elsewhere (shutdown) too: that goes on
            raise ClientGone from None
        except BaseException:
            if self._fired:
                _uncancel(task)     # our cancel became another error: it is no longer pending
            raise
        finally:
            self._target = None
        if self._fired:
            _uncancel(task)         # the awaitable swallowed our cancel: it is no longer pending
        return result


# U+2028, U+2029 and U+0085 as UTF-8, and as JSON escapes. An event's JSON may carry them raw (it is
# valid JSON and valid SSE), but a client that splits the stream with str.splitlines (httpx's
# iter_lines, for one) cuts the event there. They can stand only inside JSON strings (everything else
# in an event is ASCII), where the escape reads back as the same character.
_LINE_SEPARATORS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))


def escape_line_separators(body: bytes) -> bytes:
    """An event's bytes with the Unicode line separators inside its JSON strings written as escapes."""
    for raw, escaped in _LINE_SEPARATORS:
        body = body.replace(raw, escaped)
    return body


def _uncancel(task: Any) -> int:
    """task.uncancel() where there is one (3.11+): the cancel requests still pending."""
    uncancel = getattr(task, "uncancel", None)
    return uncancel() if uncancel is not None else 0


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response whose writes wait for the client; the body generator is closed
    however the response ends (which aborts the stream's requests), and on_close runs after.

    uvicorn's send() waits while the socket's write buffer is full, so the body generator is not
    pulled ahead of the client and nothing piles up (the engine side keeps one output per
    request). A client that reads nothing for the server's stream timeout is cut off by the HTTP
    protocol (minillm/server/http.py drops a connection whose writes stay blocked that long); the
    app then sees the disconnect and the stream is cancelled. Each write costs nothing more than
    the send itself: a deadline re-armed per chunk cost a timer a token.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None] | None = None,
                 first: str | None = None) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close
        self.first = first      # an event already taken from content (to fail with a status code before it)

    async def stream_response(self, send: Send) -> None:
        """Send the head and every chunk; close the body generator after, however it ends."""
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if self.first is not None:
                if await self._send_event(send, self.first):
                    return
            async for chunk in self.body_iterator:
                if await self._send_event(send, chunk):
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()   # aborts whatever the stream's requests still have running

    @staticmethod
    async def _send_event(send: Send, chunk: str | bytes) -> bool:
        """Send one chunk; True when it was the FinalEvent, sent with the end of the body (one write, not two)."""
        body = chunk if isinstance(chunk, bytes) else chunk.encode()
        if b"\xe2\x80\xa8" in body or b"\xe2\x80\xa9" in body or b"\xc2\x85" in body:
            body = escape_line_separators(body)
        final = isinstance(chunk, FinalEvent)
        await send({"type": "http.response.body", "body": body, "more_body": not final})
        return final

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream until the body ends or the client hangs up (the request's HangUpWatch: no task group,
        no listener task of its own)."""
        try:
            await HangUpWatch.of(scope, receive).run(self.stream_response(send))
        except ClientGone:
            pass
        finally:
            if self.on_close is not None:
                self.on_close()
