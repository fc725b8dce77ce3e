"""`minillm monitor` pointed at servers that misbehave: a stats stream that ends before its first
event (a proxy, another server) is said in the banner and retried with backoff, and the dashboard
recovers once the server sends stats; a URL on port 0 is a usage error."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_cli import run_main
from test_tui import make_stats
from test_tui_client import collect

import minillm.tui.client as client
from minillm.tui.app import MonitorApp
from minillm.tui.client import LiveSource, SourceProblem, SourceStatus, StatsFrame

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class EmptyStreamHandler(BaseHTTPRequestHandler):
    """/v1/stats/stream as a 200 event stream that ends at once (server.body: what it holds), until
    server.is_fixed says to send stats."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.server.num_requests += 1
        body = self.server.body
        if self.server.is_fixed.is_set():
            body = f"data: {json.dumps(make_stats(1).to_dict())}\n\n".encode()
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def empty_stream_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), EmptyStreamHandler)
    server.daemon_threads = True
    server.num_requests, server.body, server.is_fixed = 0, b"", threading.Event()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("body", [b"", b": keep-alive\n\n", b"event: stats\n\n"], ids=["empty", "comment", "no-data"])
async def test_a_stream_that_ends_without_stats_is_a_problem_retried_with_backoff(empty_stream_server, body):
    # It was reopened every interval without end (10 requests a second at --interval 0.1), the
    # title saying "live" over a blank dashboard and no banner.
    url, server = empty_stream_server
    server.body = body
    events = await collect(LiveSource(url, interval_s=0.1), 4, timeout=30)
    assert [type(e) for e in events] == [SourceStatus, SourceProblem] * 2
    assert "ended without a stats event" in events[1].message and url in events[1].message
    assert (events[1].retry_in_s, events[3].retry_in_s) == (client.BACKOFF_START_S, 2 * client.BACKOFF_START_S)
    assert server.num_requests == 2


async def test_the_banner_says_so_and_goes_once_the_server_sends_stats(empty_stream_server, monkeypatch):
    monkeypatch.setattr(client, "BACKOFF_START_S", 0.01)
    monkeypatch.setattr(client, "BACKOFF_MAX_S", 0.04)
    url, server = empty_stream_server
    app = MonitorApp(source=LiveSource(url, interval_s=0.1))
    async with app.run_test(size=(100, 30)) as pilot:
        deadline = time.monotonic() + 30
        while not app.banner.display:
            assert app.is_running and time.monotonic() < deadline
            await pilot.pause(0.01)
        assert "ended without a stats event" in app.banner.content.plain and app.stats is None
        server.is_fixed.set()
        while app.banner.display or app.frames_shown == 0:
            assert app.is_running and time.monotonic() < deadline
            await pilot.pause(0.01)
        assert app.stats == make_stats(1) and app.problem is None


async def test_a_stream_that_ends_after_its_stats_is_reopened_without_a_problem(empty_stream_server):
    url, server = empty_stream_server
    server.is_fixed.set()
    events = await collect(LiveSource(url, interval_s=0.1), 4, timeout=30)
    assert [type(e) for e in events] == [SourceStatus, StatsFrame, StatsFrame, StatsFrame]


@pytest.mark.parametrize("url", ["http://127.0.0.1:0", "127.0.0.1:00", "https://[::1]:0/v1"])
def test_a_url_on_port_0_is_a_usage_error(capsys, monkeypatch, url):
    # serve --port 0 binds a free port and prints it; a monitor given port 0 retried a connection
    # no server can take, for ever.
    monkeypatch.setattr("minillm.tui.app.run_monitor", lambda *a, **kw: pytest.fail("the monitor ran"))
    monkeypatch.setattr("minillm.cli.stream_not_a_terminal", lambda: None)
    status, out, err = run_main(capsys, "monitor", url)
    assert (status, out) == (2, "")
    assert "port 0 is no server's port" in err and "'URL'" in err and len(err.splitlines()) == 1
