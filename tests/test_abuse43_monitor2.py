"""`minillm monitor` polling a server whose stats stream is missing or silent: the stream is asked for
again while the polled stats go on, and takes over only once it sends its first snapshot."""
from __future__ import annotations

import json
import threading

import pytest
import test_abuse43_monitor
from test_abuse41_monitor2 import wait_until
from test_abuse43_monitor import POLLED, FakeServerHandler, start_server, stop_server
from test_tui import make_stats

import minillm.tui.client as client
from minillm.tui.app import MonitorApp
from minillm.tui.client import LiveSource

pytestmark = pytest.mark.anyio
anyio_backend = test_abuse43_monitor.anyio_backend


class HeldStreamHandler(FakeServerHandler):
    """As FakeServerHandler, and a "held" stream: its headers, then three stats events once the test
    sets server.release (a server whose first snapshot waits for a step)."""

    def _stream(self, mode: str) -> None:
        with self.server.lock:
            self.server.modes.append(mode)
        if mode != "held":
            return super()._stream(mode)
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        self.wfile.flush()
        self.server.release.wait()
        for k in range(3):
            self.wfile.write(f"data: {json.dumps(make_stats(k).to_dict())}\n\n".encode())
        self.wfile.flush()


@pytest.fixture
def server():
    server = start_server(stream="missing")
    server.RequestHandlerClass, server.release, server.modes = HeldStreamHandler, threading.Event(), []
    yield server
    server.release.set()
    stop_server(server)


@pytest.fixture
def slow_first_event(monkeypatch):
    """A stream's first event is waited for as long as any (60 s): a try that is not answered stays in flight."""
    monkeypatch.setattr(client, "FIRST_EVENT_S", 60.0)


def num_served(server, mode: str) -> int:
    """The stream requests the server answered as `mode` says."""
    with server.lock:
        return server.modes.count(mode)


@pytest.mark.parametrize("mode", ["nothing", "headers"])
async def test_polled_stats_go_on_while_the_stream_is_asked_for_again(server, slow_first_event, mode):
    # Each try of the stream froze the panels until it failed: up to 3 s for its first event, or the
    # silence limit where a proxy withheld even its headers, every 5 s at first.
    source = LiveSource(server.url, interval_s=0.05, silence_s=60.0, stream_retry_s=0.05)
    app = MonitorApp(source=source)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, app, lambda: source.use_polling and app.stats == POLLED)
        server.stream = mode      # the next try is not answered
        await wait_until(pilot, app, lambda: num_served(server, mode) == 1)
        received = app.frames_received
        # One poll may have been under way when the try reached the server: two more came after it.
        await wait_until(pilot, app, lambda: app.frames_received >= received + 3)
        assert num_served(server, mode) == 1        # the try is still in flight, not asked for again
        assert app.stats == POLLED and app.source_text == f"live {server.url} (polling)"
        assert app.problem is None and not app.banner.display


async def test_the_stream_takes_over_once_it_sends_its_first_snapshot(server, slow_first_event):
    source = LiveSource(server.url, interval_s=0.05, silence_s=60.0, stream_retry_s=0.05)
    app = MonitorApp(source=source)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, app, lambda: source.use_polling and app.stats == POLLED)
        server.stream = "held"
        await wait_until(pilot, app, lambda: num_served(server, "held") == 1)
        received = app.frames_received
        await wait_until(pilot, app, lambda: app.frames_received >= received + 3)
        assert app.stats == POLLED and app.source_text == f"live {server.url} (polling)"
        server.release.set()
        await wait_until(pilot, app, lambda: app.stats == make_stats(2))
        assert app.source_text == f"live {server.url} (stream)" and not source.use_polling
        assert app.problem is None and not app.banner.display
        assert source.stream_retry_s == 0.05        # the stream is back: a later loss waits the least
