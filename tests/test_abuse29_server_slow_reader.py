"""A stream's client that reads, however slowly, is not taken for one that reads nothing.

The HTTP protocol drops a connection whose client stopped reading (minillm/server/http.py). It used to
drop any connection whose write buffer had not drained to its low-water mark within the stream
timeout: a client reading steadily at under 1.6 KB/s (48 KiB in 30 s) was cut off mid-stream, logged as
one that "read nothing". The protocol's deadline logic runs here over a fake clock and transport.
"""
from __future__ import annotations

import pytest

from minillm.server.http import _Deadlines

TIMEOUT_S = 30.0
HIGH_WATER = 64 * 1024        # asyncio's default: writes pause above it, resume at a quarter of it


class FakeClock:
    """An event loop's time() and call_later(), run by hand."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[FakeTimer] = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback) -> "FakeTimer":
        timer = FakeTimer(self.now + delay, callback)
        self.timers.append(timer)
        return timer

    def advance(self, seconds: float) -> None:
        """Move the clock on, running every timer that falls due on the way, in order."""
        end = self.now + seconds
        while True:
            due = [t for t in self.timers if not t.cancelled and t.when <= end]
            if not due:
                break
            timer = min(due, key=lambda t: t.when)
            self.timers.remove(timer)
            self.now = max(self.now, timer.when)
            timer.callback()
        self.now = end


class FakeTimer:
    def __init__(self, when: float, callback) -> None:
        self.when, self.callback, self.cancelled = when, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class FakeTransport:
    """A transport whose write buffer the test fills and the client drains."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.num_buffered = 0
        self.aborted_at: float | None = None

    @property
    def aborted(self) -> bool:
        return self.aborted_at is not None

    def get_write_buffer_size(self) -> int:
        return self.num_buffered

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted_at = self.clock.now

    def close(self) -> None:
        self.aborted_at = self.clock.now


class Base:
    """What _Deadlines expects of uvicorn's protocol below it."""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        pass

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        pass


class Protocol(_Deadlines, Base):
    header_timeout_s = 1e9          # the header deadline is not under test
    write_timeout_s = TIMEOUT_S


def connection() -> tuple[Protocol, FakeTransport, FakeClock]:
    """A connection whose writes have just paused, its buffer past the high-water mark."""
    clock = FakeClock()
    protocol, transport = Protocol(), FakeTransport(clock)
    protocol.loop = clock
    protocol.connection_made(transport)
    transport.num_buffered = HIGH_WATER + 1
    protocol.pause_writing()
    return protocol, transport, clock


def test_a_client_that_keeps_reading_slowly_is_not_cut_off():
    protocol, transport, clock = connection()
    for _ in range(int(3 * TIMEOUT_S)):      # 500 bytes a second: the buffer never drains to low water
        clock.advance(1.0)
        transport.num_buffered -= 500
        assert not transport.aborted, f"cut off at {clock.now:.0f} s while reading"
    assert transport.num_buffered > HIGH_WATER // 4


@pytest.mark.parametrize("read_for_s", [0.0, 10.0, 44.0])
def test_a_client_that_stops_reading_is_cut_off_a_timeout_after_its_last_read(read_for_s):
    protocol, transport, clock = connection()
    while clock.now < read_for_s:
        clock.advance(1.0)
        transport.num_buffered -= 500
    last_read = clock.now
    clock.advance(TIMEOUT_S * 0.99)
    assert not transport.aborted
    clock.advance(TIMEOUT_S * 0.5)           # the check runs at least this often
    assert transport.aborted
    assert TIMEOUT_S <= transport.aborted_at - last_read <= TIMEOUT_S * 1.25 + 1.0
    assert not [t for t in clock.timers if not t.cancelled and t.when < 1e8]    # nothing left to check


def test_writes_that_resume_end_the_watch():
    protocol, transport, clock = connection()
    clock.advance(TIMEOUT_S / 2)
    transport.num_buffered = 0
    protocol.resume_writing()
    clock.advance(10 * TIMEOUT_S)
    assert not transport.aborted and not [t for t in clock.timers if not t.cancelled and t.when < 1e8]
