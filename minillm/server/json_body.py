"""JSON request bodies parsed off the event loop when they are large.

FastAPI parses a route's JSON body with `await request.json()` on the event loop, where json's C
scanner took 12 ms per MB of token ids and 6-11 ms per MB of chat messages (2 ms per MB of plain
text): a 10 MB body held up every stream and /health for 0.1-0.2 s. Here a body past
LARGE_BODY_BYTES (64 KiB: under 1 ms of parsing, against 50-150 us for the hop to a thread) is
parsed on a worker thread, and with a call into Python for every object and number it reads. A
thread alone is not enough: the C scanner holds the GIL from the body's first byte to its last, so
on a thread it stalled the loop just as long; a call into Python is where the GIL passes back to
the loop once the thread has held it for the switch interval (5 ms). With 10 MB bodies of ids or
messages the longest wait of /health fell from 120-220 ms to 30-100 ms, the parse itself taking
up to 4x as long (a Python call per number). Strings get no such call: a body of a million short strings in one list
still holds the GIL throughout (about 12 ms per MB).

FastAPI does everything else as before: which content types it parses, and the errors for bodies
that do not parse (the exceptions are json.loads's own, raised on the thread).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Callable, Coroutine

from fastapi import Request, Response
from fastapi.routing import APIRoute



# A body past this many bytes is parsed on a worker thread here, and read as a request (validated,
# its messages or token ids walked) in the server's preprocessing pool (serving.is_large_body).
LARGE_BODY_BYTES = 64 * 1024


# The json decoder's hooks: each returns what the C scanner would have made, from Python.
def _object_as_is(obj: dict) -> dict:
    return obj


def _int_from_python(text: str) -> int:
    return int(text)


def _float_from_python(text: str) -> float:
    return float(text)


def loads_yielding(body: bytes) -> Any:
    """json.loads(body), calling into Python for each object and number (so that, on a thread, it
    lets the event loop run between them); the same value, and the same errors, as json.loads."""
    return json.loads(body, object_hook=_object_as_is, parse_int=_int_from_python,
                      parse_float=_float_from_python)


async def parse_body(body: bytes) -> Any:
    """body parsed as JSON: on a worker thread with loads_yielding past LARGE_BODY_BYTES, here below
    it (a thread hop costs more than a small body's parse); json.loads's value and errors."""
    if len(body) > LARGE_BODY_BYTES:
        return await asyncio.to_thread(loads_yielding, body)
    return json.loads(body)


class JSONBodyRequest(Request):
    """A Request whose json() parses a large body on a worker thread (parse_body)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = await parse_body(await self.body())
        return self._json


class JSONBodyRoute(APIRoute):
    """An APIRoute whose handler reads the request as a JSONBodyRequest."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(JSONBodyRequest(request.scope, request.receive))

        return handle
