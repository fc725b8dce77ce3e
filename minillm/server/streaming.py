"""Server-sent event responses written with backpressure, and cut off when the client stops reading."""
from __future__ import annotations

from typing import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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
                await send({"type": "http.response.body", "body": self.first.encode(), "more_body": True})
            async for chunk in self.body_iterator:
                body = chunk if isinstance(chunk, bytes) else chunk.encode()
                await send({"type": "http.response.body", "body": body, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()   # aborts whatever the stream's requests still have running

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.on_close is not None:
                self.on_close()
