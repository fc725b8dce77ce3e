"""`minillm monitor` against servers that change or go quiet: a server polled for want of a stats
stream gets its stream back once it has one again; an error body of FastAPI's or OpenAI's shape shows
its message in the banner; a stream that stays open but sends no stats event (only keep-alive
comments) and whose /v1/stats fails too is said in the banner within a bounded time and reopened."""
from __future__ import annotations

import json
import threading
import time
from contextlib import aclosing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anyio
import pytest
from test_tui import make_stats

import minillm.tui.client as client
from minillm.tui.app import MonitorApp
from minillm.tui.client import HTTPStatusProblem, LiveSource, SourceProblem, SourceStatus, StatsFrame, describe_problem
from minillm.tui.help_screen import help_text

pytestmark = pytest.mark.anyio

WAIT_S = 20.0      # generous: the conditions are met in well under a second on an idle machine


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def fast_backoff(monkeypatch):
    monkeypatch.setattr(client, "BACKOFF_START_S", 0.01)
    monkeypatch.setattr(client, "BACKOFF_MAX_S", 0.04)


class ChangingHandler(BaseHTTPRequestHandler):
    """A server whose /v1/stats/stream is set by server.stream: "missing" (404), "error" (server.error_body
    with status 503, /v1/stats alike), "comments" (an open stream of keep-alive comments, after
    server.num_leading events), or "ok" (stats events, then the end); /v1/stats answers a snapshot, or 503
    where server.poll_status is 503."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        server = self.server
        is_stream = self.path.startswith("/v1/stats/stream")
        with server.lock:
            server.paths.append("stream" if is_stream else "poll")
        try:
            if server.stream == "error":
                return self._send(503, "application/json", server.error_body)
            if not is_stream and server.poll_status != 200:
                return self._send(server.poll_status, "application/json", b'{"detail":"Service Unavailable"}')
            if not is_stream:
                return self._send(200, "application/json", json.dumps(make_stats(1).to_dict()).encode())
            if server.stream == "missing":
                return self._send(404, "application/json", b'{"detail":"Not Found"}')
            if server.stream == "ok":
                events = "".join(f"data: {json.dumps(make_stats(k).to_dict())}\n\n" for k in range(3))
                return self._send(200, "text/event-stream", events.encode())
            self._keep_alive_only()
        except (BrokenPipeError, ConnectionResetError):
            pass    # the monitor left

    def _keep_alive_only(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for k in range(self.server.num_leading):
            self.wfile.write(f"data: {json.dumps(make_stats(k).to_dict())}\n\n".encode())
        while not self.server.stopping.is_set():
            self.wfile.write(b": keep-alive\n\n")
            self.wfile.flush()
            self.server.stopping.wait(0.02)     # the fake server's pace, not a wait of the test's

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), ChangingHandler)
    server.daemon_threads = True
    server.lock, server.paths, server.stopping = threading.Lock(), [], threading.Event()
    server.stream, server.error_body, server.num_leading, server.poll_status = "missing", b"", 0, 200
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield server
    server.stopping.set()
    server.shutdown()
    server.server_close()


async def wait_until(pilot, app, condition) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert app.is_running and time.monotonic() < deadline, "timed out"
        await pilot.pause(0.01)


async def events_until(source: LiveSource, condition, on_event=lambda event: None) -> list:
    """The source's events up to the first for which condition(event, events so far) holds."""
    events = []
    try:
        with anyio.fail_after(WAIT_S):    # a source that yields nothing more is a failure, not a hang
            async with aclosing(source.events(lambda: 64)) as source_events:
                async for event in source_events:
                    events.append(event)
                    on_event(event)
                    if condition(event, events):
                        return events
    except TimeoutError:
        pytest.fail(f"timed out: {events[-6:]}")
    raise AssertionError("the source ended")


# ---- 1. a polled server gets its stream back ------------------------------------------------------

async def test_a_server_that_gains_its_stream_is_streamed_again(server):
    # One 404 on the stream meant polling for good: a server restarted or upgraded behind the URL
    # was polled for ever (and the title said "stream" all along).
    app = MonitorApp(source=LiveSource(server.url, interval_s=0.1, stream_retry_s=0.05))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, app, lambda: app.source_text.endswith("(polling)") and app.frames_shown >= 2)
        assert app.stats == make_stats(1)
        server.stream = "ok"
        await wait_until(pilot, app, lambda: app.source_text.endswith("(stream)"))
        await wait_until(pilot, app, lambda: app.stats == make_stats(2))
        assert app.problem is None and not app.banner.display
    assert server.paths[0] == "stream" and server.paths[1] == "poll"


async def test_the_stream_is_asked_for_again_with_a_doubling_wait(server):
    source = LiveSource(server.url, interval_s=0.1, stream_retry_s=0.05)
    num_404 = []

    def check(event) -> None:
        if isinstance(event, StatsFrame):
            with server.lock:
                num_404.append(server.paths.count("stream"))
            # Every stream try that answered 404 doubled the wait before the next one.
            check_doubled_wait(source, num_404[-1])

    await events_until(source, lambda e, events: len(num_404) > 1 and num_404[-1] >= 3, check)
    server.stream = "ok"
    events = await events_until(source, lambda e, events: isinstance(e, StatsFrame) and e.stats == make_stats(2))
    assert [e.text for e in events if isinstance(e, SourceStatus)][-1].endswith("(stream)")
    assert source.stream_retry_s == 0.05 and not source.use_polling   # the stream is back: the wait starts over


def check_doubled_wait(source: LiveSource, num_tries: int) -> None:
    """The wait before the stream is asked for again doubled for each of the num_tries stream requests
    the server saw; the last may still be in flight (the polled stats go on meanwhile), seen by the
    server before its failure doubled the wait."""
    waits = [min(source.stream_retry_start_s * 2 ** k, client.STREAM_RETRY_MAX_S) for k in (num_tries, num_tries - 1)]
    assert source.stream_retry_s in [pytest.approx(wait) for wait in waits], (source.stream_retry_s, num_tries)


# ---- 2. an error body's message, not its JSON -----------------------------------------------------

@pytest.mark.parametrize("body, message", [
    ('{"detail": "Engine is starting"}', "Engine is starting"),
    ('{"error": {"message": "Engine is starting", "type": "x"}}', "Engine is starting"),
    ('{"error": "Engine is starting"}', "Engine is starting"),
    ('{"detail": [{"loc": ["query", "cells"], "msg": "Input should be a valid integer", "type": "int_parsing"}]}',
     "cells: Input should be a valid integer"),
    ("<html>Bad Gateway</html>", "<html>Bad Gateway</html>"),
])
def test_an_error_body_is_shown_by_its_message(body, message):
    shown = describe_problem(HTTPStatusProblem(503, "http://h:1/v1/stats/stream", body), "http://h:1")
    assert shown == f"http://h:1 answered 503: {message}"


async def test_the_banner_shows_fastapis_detail(server, fast_backoff):
    server.stream, server.error_body = "error", b'{"detail": "Service Unavailable: loading the model"}'
    app = MonitorApp(source=LiveSource(server.url, interval_s=0.1))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, app, lambda: app.banner.display)
        assert app.problem == f"{server.url} answered 503: Service Unavailable: loading the model"
        assert "{" not in app.banner.content.plain


# ---- 3, 4. an open stream without stats events ----------------------------------------------------

@pytest.mark.parametrize("num_leading", [0, 2], ids=["none", "after-two-events"])
async def test_a_stream_of_keep_alives_only_is_a_problem_and_is_reopened(server, fast_backoff, num_leading):
    # Comments kept the read timeout from firing: the dashboard stayed blank (or frozen), no banner.
    # (Where /v1/stats answers, the monitor polls it instead: tests/test_abuse43_monitor.py.)
    server.stream, server.num_leading, server.poll_status = "comments", num_leading, 503
    source = LiveSource(server.url, interval_s=0.1, silence_s=0.3)
    started = time.monotonic()
    events = await events_until(source, lambda e, events: sum(isinstance(x, SourceProblem) for x in events) == 2)
    problems = [e for e in events if isinstance(e, SourceProblem)]
    assert all(p.message.startswith(f"no stats from {server.url} for 0.3 s") for p in problems), problems
    assert "keep-alive" in problems[0].message
    assert sum(isinstance(e, StatsFrame) for e in events) == 2 * num_leading
    assert server.paths.count("stream") == 2           # reopened after the first
    assert time.monotonic() - started < WAIT_S


async def test_the_banner_says_the_stream_is_silent_and_goes_once_stats_come(server, fast_backoff):
    server.stream, server.poll_status = "comments", 503
    app = MonitorApp(source=LiveSource(server.url, interval_s=0.1, silence_s=0.3))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, app, lambda: app.banner.display)
        assert "no stats from" in app.banner.content.plain and app.stats is None
        server.stream = "ok"
        await wait_until(pilot, app, lambda: not app.banner.display and app.stats is not None)
        assert app.problem is None


@pytest.mark.parametrize("interval_s, silence_s", [(0.1, 10.0), (0.25, 10.0), (5.0, 15.0), (20.0, 50.0), (60.0, 90.0)])
async def test_the_silence_allowed_is_bounded_and_outlasts_the_interval(interval_s, silence_s):
    # It was max(10 s, 20 x interval): 20 minutes at --interval 60 before a dead stream was reported.
    source = LiveSource("http://127.0.0.1:8000", interval_s=interval_s)
    async with source._client() as http:
        assert source.silence_s == silence_s and http.timeout.read == silence_s
    assert silence_s > interval_s        # a server that sends every interval is never reported


def test_the_help_says_how_long_a_silent_stream_is_allowed():
    plain = " ".join(help_text().plain.split())
    assert f"no snapshot for {client.SILENCE_RULE}" in plain
    assert client.SILENCE_RULE == "3 intervals (10 s at least, the interval + 30 s at most)"


def test_the_interval_option_says_how_long_a_silent_stream_is_allowed(capsys):
    from test_cli import run_main
    status, out, _ = run_main(capsys, "monitor", "--help")
    assert status == 0
    assert "3 intervals (10 s at least, the interval + 30 s at most)" in " ".join(out.split())
