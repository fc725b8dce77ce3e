"""`minillm monitor` against a server whose stats stream fails while its snapshot endpoint answers: the
monitor polls the snapshot, says so in the title, and asks for the stream again after a doubling wait."""
from __future__ import annotations

import json
import threading
import time
from contextlib import aclosing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anyio
import pytest
from test_abuse41_monitor2 import check_doubled_wait
from test_tui import make_stats

import minillm.tui.client as client
from minillm.tui.app import MonitorApp
from minillm.tui.client import LiveSource, SourceProblem, SourceStatus, StatsFrame

pytestmark = pytest.mark.anyio

WAIT_S = 20.0      # generous: the conditions are met in well under a second on an idle machine


@pytest.fixture
def anyio_backend():
    return "asyncio"


class FailingStreamHandler(BaseHTTPRequestHandler):
    """/v1/stats/stream answers server.stream_status (200: three stats events, then the end) with
    server.stream_body; /v1/stats answers server.poll_status with a snapshot (or an error body)."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        server = self.server
        is_stream = self.path.startswith("/v1/stats/stream")
        with server.lock:
            server.paths.append("stream" if is_stream else "poll")
        if is_stream and server.stream_status == 200:
            events = "".join(f"data: {json.dumps(make_stats(k).to_dict())}\n\n" for k in range(3))
            return self._send(200, "text/event-stream", events.encode())
        if is_stream:
            return self._send(server.stream_status, "application/json", server.stream_body)
        if server.poll_status != 200:
            return self._send(server.poll_status, "application/json", b'{"detail": "the poll failed too"}')
        self._send(200, "application/json", json.dumps(make_stats(1).to_dict()).encode())

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass     # the monitor left


@pytest.fixture
def server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FailingStreamHandler)
    server.daemon_threads = True
    server.lock, server.paths = threading.Lock(), []
    server.stream_status, server.stream_body, server.poll_status = 500, b'{"detail": "stream broke"}', 200
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield server
    server.shutdown()
    server.server_close()


async def events_until(source: LiveSource, condition) -> list:
    """The source's events up to the first for which condition(events so far) holds."""
    events = []
    try:
        with anyio.fail_after(WAIT_S):
            async with aclosing(source.events(lambda: 64)) as source_events:
                async for event in source_events:
                    events.append(event)
                    if condition(events):
                        return events
    except TimeoutError:
        pytest.fail(f"timed out: {events[-6:]}")
    raise AssertionError("the source ended")


def num_frames(events: list) -> int:
    return sum(isinstance(e, StatsFrame) for e in events)


@pytest.mark.parametrize("status", [500, 502, 503, 400])
async def test_a_stream_that_answers_an_error_is_polled_instead(server, status):
    # The stream's 500 was a problem retried with backoff for ever, the dashboard blank, while
    # /v1/stats answered every time.
    server.stream_status = status
    source = LiveSource(server.url, interval_s=0.05, stream_retry_s=60.0)
    events = await events_until(source, lambda events: num_frames(events) >= 3)
    assert not [e for e in events if isinstance(e, SourceProblem)], events
    assert all(e.stats == make_stats(1) for e in events if isinstance(e, StatsFrame))
    statuses = [e.text for e in events if isinstance(e, SourceStatus)]
    assert statuses[-1] == f"live {server.url} (polling: the stream answered {status})"
    assert source.use_polling
    assert server.paths.count("stream") == 1       # not asked again before its wait is over


async def test_the_failing_stream_is_asked_for_again_with_a_doubling_wait(server):
    source = LiveSource(server.url, interval_s=0.05, stream_retry_s=0.05)
    seen = []

    def condition(events) -> bool:
        if isinstance(events[-1], StatsFrame):
            with server.lock:
                seen.append(server.paths.count("stream"))
            check_doubled_wait(source, seen[-1])
        return bool(seen) and seen[-1] >= 3

    events = await events_until(source, condition)
    assert not [e for e in events if isinstance(e, SourceProblem)]
    server.stream_status = 200
    events = await events_until(source, lambda events: isinstance(events[-1], StatsFrame)
                                and events[-1].stats == make_stats(2))
    assert [e.text for e in events if isinstance(e, SourceStatus)][-1] == f"live {server.url} (stream)"
    assert source.stream_retry_s == 0.05 and not source.use_polling


async def test_a_stream_error_is_the_problem_when_the_poll_fails_too(server, monkeypatch):
    monkeypatch.setattr(client, "BACKOFF_START_S", 0.01)
    server.stream_status, server.stream_body, server.poll_status = 503, b'{"detail": "loading the model"}', 503
    source = LiveSource(server.url, interval_s=0.05)
    events = await events_until(source, lambda events: isinstance(events[-1], SourceProblem))
    assert events[-1].message == f"{server.url} answered 503: loading the model"
    assert server.paths[:2] == ["stream", "poll"] and not source.use_polling


@pytest.mark.parametrize("status", [401, 403])
async def test_a_refused_key_is_not_polled_for(server, status):
    server.stream_status, server.stream_body = status, b'{"error": {"message": "Invalid API key"}}'
    source = LiveSource(server.url, interval_s=0.05)
    events = await events_until(source, lambda events: isinstance(events[-1], SourceProblem))
    assert "API key" in events[-1].message and "poll" not in server.paths


async def test_the_dashboard_shows_polled_stats_and_says_why_in_the_title(server):
    app = MonitorApp(source=LiveSource(server.url, interval_s=0.05, stream_retry_s=60.0))
    async with app.run_test(size=(120, 30)) as pilot:
        deadline = time.monotonic() + WAIT_S
        while app.frames_shown < 2:
            assert app.is_running and time.monotonic() < deadline, "timed out"
            await pilot.pause(0.01)
        assert app.stats == make_stats(1) and app.problem is None and not app.banner.display
        assert app.source_text.endswith("(polling: the stream answered 500)")


# ---- a real server whose stats streams are all taken ------------------------------------------------------

async def test_a_monitor_past_the_servers_stream_limit_polls_it(stories_path):
    # serve answers a stream past --max-stats-streams with a 503 that says "poll /v1/stats instead":
    # the monitor showed that 503 and asked again, for ever.
    from minillm.server.app import ServerOptions
    from minillm.server.limits import ServerLimits
    from test_server_helpers import running_server
    options = ServerOptions(limits=ServerLimits(max_stats_streams=1))
    with running_server(stories_path, options=options, max_model_len=64) as (url, _):
        first, second = LiveSource(url, interval_s=0.1), LiveSource(url, interval_s=0.1, stream_retry_s=60.0)
        with anyio.fail_after(WAIT_S):
            async with aclosing(first.events(lambda: 64)) as first_events:
                async for event in first_events:        # the first monitor holds the one place
                    if isinstance(event, StatsFrame):
                        break
                events = await events_until(second, lambda events: num_frames(events) >= 2)
    assert not [e for e in events if isinstance(e, SourceProblem)], events
    assert [e.text for e in events if isinstance(e, SourceStatus)][-1] == (
        f"live {url} (polling: the stream answered 503)")
    assert all(e.stats.max_model_len == 64 for e in events if isinstance(e, StatsFrame))
