"""Server-sent event responses written with backpressure, and cut off when the client stops reading."""
from __future__ import annotations

import logging
import math
from typing import AsyncIterator, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger("minillm.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response whose writes wait for the client, for at most write_timeout_s each.

    uvicorn's send() waits while the socket's write buffer is full, so the body generator is not
    pulled ahead of the client and nothing piles up (the engine side keeps one output per
    request). A client that reads nothing for write_timeout_s is cut off: the generator is closed,
    which aborts its requests, and the connection is dropped. on_close runs however it ends.
    """

    def __init__(self, content: AsyncIterator[str], write_timeout_s: float,
                 on_close: Callable[[], None] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.write_timeout_s = write_timeout_s
        self.on_close = on_close

    async def stream_response(self, send: Send) -> None:
        """Send the head and every chunk, each within the write timeout; close the body generator after."""
        try:
            with anyio.CancelScope() as scope:
                await self._send(scope, send, {"type": "http.response.start", "status": self.status_code,
                                               "headers": self.raw_headers})
                async for chunk in self.body_iterator:
                    body = chunk if isinstance(chunk, bytes) else chunk.encode(self.charset)
                    await self._send(scope, send, {"type": "http.response.body", "body": body, "more_body": True})
                await self._send(scope, send, {"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()   # aborts whatever the stream's requests still have running
        if scope.cancelled_caught:
            logger.warning("cut off a stream whose client read nothing for %.1f s", self.write_timeout_s)

    async def _send(self, scope: anyio.CancelScope, send: Send, message: dict) -> None:
        scope.deadline = anyio.current_time() + self.write_timeout_s
        await send(message)
        scope.deadline = math.inf   # waiting for the next chunk is not the client's fault

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.on_close is not None:
                self.on_close()
