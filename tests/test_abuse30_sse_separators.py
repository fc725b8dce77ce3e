"""Stream events carry U+2028, U+2029 and U+0085 as JSON escapes: a client that splits the stream
with str.splitlines (httpx's iter_lines) read them as line ends and cut the event's JSON there."""
from __future__ import annotations

import asyncio
import json

import pytest

from minillm.server.serving import sse
from minillm.server.streaming import EventStreamResponse, FinalEvent


def sent_bodies(*chunks) -> list[bytes]:
    bodies = []

    async def send(message):
        bodies.append(message["body"])

    async def run():
        for chunk in chunks:
            await EventStreamResponse._send_event(send, chunk)

    asyncio.run(run())
    return bodies


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\x85"])
def test_a_line_separator_in_a_token_is_sent_escaped_and_reads_back_the_same(char):
    event = {"choices": [{"delta": {"content": f"a{char}b \u00e9\u4e2d\U0001F600"}}]}
    [body] = sent_bodies(sse(event))
    text = body.decode()
    assert char not in text
    [line] = [ln for ln in text.splitlines() if ln]          # one line, as str.splitlines cuts it
    assert json.loads(line.removeprefix("data: ")) == event


def test_events_without_them_are_sent_as_they_are():
    plain = sse({"choices": [{"delta": {"content": "caf\u00e9 \u2027 \u202a"}}]})
    assert sent_bodies(plain, FinalEvent(plain), plain.encode()) == [plain.encode()] * 3
