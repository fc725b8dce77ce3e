"""`minillm monitor` against servers as users meet them: a stats stream that opens and then sends
nothing (a proxy that buffers, a stalled server) is polled instead, the title saying so, until the
stream sends stats again."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anyio
import pytest
from textual.geometry import Region
import test_abuse41_monitor2
from test_abuse41_monitor2 import check_doubled_wait, events_until, wait_until
from test_tui import make_stats

from minillm.tui.app import MonitorApp
from minillm.tui.client import (HTTPStatusProblem, LiveSource, SourceProblem, SourceStatus, StatsFrame,
                                describe_problem)

pytestmark = pytest.mark.anyio
fast_backoff = test_abuse41_monitor2.fast_backoff

POLLED = make_stats(7)       # what /v1/stats answers: told apart from the stream's make_stats(0..2)


@pytest.fixture
def anyio_backend():
    return "asyncio"


class FakeServerHandler(BaseHTTPRequestHandler):
    """/v1/stats/stream as server.stream says: "ok" (three stats events, then the end), "headers" (200
    and the event stream's headers, then nothing), "nothing" (not even headers), "then-silent" (two
    stats events, then nothing), "missing" (404), "redirect" (a 301 to server.redirect_to, as every path); /v1/stats answers POLLED, or server.poll_status with an error body ("stall": nothing). Both
    answer 401 to a request without server.api_key, where one is set."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        server = self.server
        is_stream = self.path.startswith("/v1/stats/stream")
        with server.lock:
            server.paths.append("stream" if is_stream else "poll")
        try:
            if server.stream == "redirect":
                self.send_response(301)
                self.send_header("location", server.redirect_to)
                self.send_header("content-length", "0")
                self.end_headers()
            elif server.api_key and self.headers.get("Authorization") != f"Bearer {server.api_key}":
                self._send(401, "application/json", b'{"error": {"message": "Unauthorized"}}')
            elif is_stream:
                self._stream(server.stream)
            elif server.poll_status == "stall":
                server.stopping.wait()
            elif server.poll_status != 200:
                self._send(server.poll_status, "application/json", b'{"detail": "Service Unavailable"}')
            else:
                self._send(200, "application/json", json.dumps(POLLED.to_dict()).encode())
        except (BrokenPipeError, ConnectionResetError):
            pass     # the monitor left

    def _stream(self, mode: str) -> None:
        if mode == "missing":         # a server from before /v1/stats/stream
            self._send(404, "application/json", b'{"detail": "Not Found"}')
            return
        if mode == "nothing":
            self.server.stopping.wait()
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        num_events = {"ok": 3, "headers": 0, "then-silent": 2}[mode]
        for k in range(num_events):
            self.wfile.write(f"data: {json.dumps(make_stats(k).to_dict())}\n\n".encode())
        self.wfile.flush()
        if mode != "ok":
            self.server.stopping.wait()      # open, and silent until the test ends

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def start_server(port: int = 0, stream: str = "headers") -> ThreadingHTTPServer:
    """A FakeServerHandler server on port (0: a free one), its stream as `stream` says."""
    server = ThreadingHTTPServer(("127.0.0.1", port), FakeServerHandler)
    server.daemon_threads = True
    server.lock, server.paths, server.stopping = threading.Lock(), [], threading.Event()
    server.stream, server.poll_status, server.api_key = stream, 200, None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    return server


def stop_server(server: ThreadingHTTPServer) -> None:
    server.stopping.set()
    server.shutdown()
    server.server_close()


@pytest.fixture
def server():
    server = start_server()
    yield server
    stop_server(server)


SILENT_TITLE = "(polling: the stream sent nothing for 0.3 s)"


# ---- a stream that opens and sends nothing -----------------------------------------------------------

@pytest.mark.parametrize("mode", ["headers", "nothing"])
async def test_a_silent_stream_is_polled_and_the_title_says_so(server, mode):
    # The stream was retried for ever, the dashboard blank under a banner, while /v1/stats answered.
    server.stream = mode
    app = MonitorApp(source=LiveSource(server.url, interval_s=0.1, silence_s=0.3, stream_retry_s=60.0))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, app, lambda: app.frames_shown >= 2)
        assert app.stats == POLLED and app.source_text == f"live {server.url} {SILENT_TITLE}"
        assert app.problem is None and not app.banner.display
        assert SILENT_TITLE in app.title_bar.content.plain


async def test_a_silent_stream_is_streamed_again_once_it_sends_stats(server):
    source = LiveSource(server.url, interval_s=0.1, silence_s=0.3, stream_retry_s=0.05)
    app = MonitorApp(source=source)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, app, lambda: app.source_text.endswith(SILENT_TITLE) and app.stats == POLLED)
        server.stream = "ok"
        await wait_until(pilot, app, lambda: app.source_text == f"live {server.url} (stream)")
        await wait_until(pilot, app, lambda: app.stats == make_stats(2))
        assert app.problem is None and not source.use_polling


async def test_a_stream_that_goes_silent_after_stats_is_polled_and_the_title_says_so(server):
    # The title said "(stream)" while the stream was given up for polling after its first events.
    server.stream = "then-silent"
    app = MonitorApp(source=LiveSource(server.url, interval_s=0.1, silence_s=0.3, stream_retry_s=60.0))
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, app, lambda: app.stats == make_stats(1))
        assert app.source_text == f"live {server.url} (stream)"
        await wait_until(pilot, app, lambda: app.stats == POLLED)
        assert app.source_text == f"live {server.url} {SILENT_TITLE}"
        assert app.problem is None and not app.banner.display


async def test_a_silent_stream_is_asked_for_again_with_a_doubling_wait(server):
    # Its headers reset the wait: a stream that opened and said nothing was asked for every 0.05 s.
    source = LiveSource(server.url, interval_s=0.05, silence_s=0.2, stream_retry_s=0.05)
    seen = []

    def condition(event, events) -> bool:
        if isinstance(event, StatsFrame):
            with server.lock:
                seen.append(server.paths.count("stream"))
            check_doubled_wait(source, seen[-1])
        return bool(seen) and seen[-1] >= 3

    events = await events_until(source, condition)
    assert not [e for e in events if isinstance(e, SourceProblem)], events


@pytest.mark.parametrize("mode", ["headers", "then-silent"])
async def test_a_silent_stream_is_the_problem_when_the_poll_fails_too(server, mode):
    server.stream, server.poll_status = mode, 503
    source = LiveSource(server.url, interval_s=0.1, silence_s=0.3)
    events = await events_until(source, lambda event, events: isinstance(event, SourceProblem))
    assert events[-1].message.startswith(f"no stats from {server.url} for 0.3 s: its stream is open")
    assert not source.use_polling and server.paths[-1] == "poll"


# ---- a terminal resized very small -------------------------------------------------------------------

class GivenEvents:
    """The given events, then nothing (the source stays open)."""

    def __init__(self, events: list) -> None:
        self._events = events

    async def events(self, cells):
        for event in self._events:
            yield event
        await anyio.sleep_forever()


def frames_then_problem() -> GivenEvents:
    problem = SourceProblem("cannot connect to http://127.0.0.1:8000: is `minillm serve` running there?", 4.0)
    return GivenEvents([StatsFrame(make_stats(k), {}) for k in range(3)] + [problem])


@pytest.mark.parametrize("size", [(100, 16), (60, 12), (40, 8)])
async def test_the_title_and_the_banner_stay_in_view_on_a_short_terminal(size):
    # The panels overflowed the screen, which scrolled to the focused grid: the title and the banner saying
    # why stats stopped went off the top.
    app = MonitorApp(source=frames_then_problem())
    async with app.run_test(size=size) as pilot:
        await wait_until(pilot, app, lambda: app.frames_shown == 3 and app.banner.display)
        for key in ["", "tab", "tab", "tab"]:    # focus moving down the panels scrolls them, not the screen
            if key:
                await pilot.press(key)
            await pilot.pause()
            assert app.screen.get_widget_at(0, 0)[0] is app.title_bar, key
            assert app.screen.get_widget_at(1, app.title_bar.outer_size.height)[0] is app.banner, key


def rendered(widget) -> str:
    """The widget's text as drawn on the screen, its rows joined by newlines."""
    return "\n".join(strip.text for strip in widget.render_lines(Region(0, 0, *widget.size)))


@pytest.mark.parametrize("width, shown", [
    (80, ["❚❚ PAUSED", "↻ counters reset", "stories260K · cpu · float32", "(polling: the stream sent nothing for 10 s)"]),
    (40, ["❚❚ PAUSED", "↻ counters reset"]),
])
async def test_the_titles_markers_are_drawn_on_a_narrow_terminal(width, shown):
    # PAUSED, the restart marker and why the stream is polled came at the end of a one-row title, cut
    # off under about 100 columns: pressing p changed nothing on an 80-column terminal.
    status = SourceStatus("live http://127.0.0.1:8000 (polling: the stream sent nothing for 10 s)")
    app = MonitorApp(source=GivenEvents([status, StatsFrame(make_stats(3), {}), StatsFrame(make_stats(1), {})]))
    async with app.run_test(size=(width, 24)) as pilot:
        await wait_until(pilot, app, lambda: app.frames_shown == 2 and app.num_restarts == 1)
        await pilot.press("p")
        await wait_until(pilot, app, lambda: app.paused)
        await pilot.pause()
        title = rendered(app.title_bar)
        assert all(text in " ".join(title.split()) for text in shown), title
        assert app.screen.get_widget_at(0, title.count("\n"))[0] is app.title_bar


@pytest.mark.parametrize("width", [40, 56])
async def test_the_kv_grid_and_the_batch_chart_keep_half_a_narrow_terminal(width):
    # The right-hand panels kept their 36 columns: at 40 the KV grid was 4 columns of border, no block drawn.
    app = MonitorApp(source=GivenEvents([StatsFrame(make_stats(k), {}) for k in range(3)]))
    async with app.run_test(size=(width, 30)) as pilot:
        await wait_until(pilot, app, lambda: app.frames_shown == 3)
        await pilot.pause()
        for panel in (app.grid, app.panels[3]):
            assert panel.outer_size.width >= width // 2, (panel.id, panel.outer_size)
        assert app.cells >= 16       # the grid asks for cells it can draw


# ---- a server behind an API key ----------------------------------------------------------------------

@pytest.mark.parametrize("api_key, said", [
    ("", "asks for an API key (401): pass --api-key KEY or set $OPENAI_API_KEY"),
    ("wrong", "refused the API key (401): pass the server's key with --api-key"),
])
async def test_a_401_says_whether_a_key_was_sent_when_the_key_given_is_empty(server, api_key, said):
    # --api-key "" (a script's unset variable) sends no key, but the banner said the server refused it.
    server.stream, server.api_key = "ok", "sekret"
    source = LiveSource(server.url, api_key=api_key, interval_s=0.1)
    events = await events_until(source, lambda event, events: isinstance(event, SourceProblem))
    assert events[-1].message == f"{server.url} {said}"
    assert "poll" not in server.paths      # a refused key is not polled for


async def test_the_key_reaches_both_the_stream_and_the_poll(server):
    server.stream, server.api_key = "headers", "sekret"
    source = LiveSource(server.url, api_key="sekret", interval_s=0.1, silence_s=0.3, stream_retry_s=60.0)
    events = await events_until(source, lambda event, events: isinstance(event, StatsFrame))
    assert events[-1].stats == POLLED and not [e for e in events if isinstance(e, SourceProblem)]


# ---- a server that restarts mid-session --------------------------------------------------------------

@pytest.mark.parametrize("mode", ["missing", "headers"])
async def test_a_restarted_server_is_asked_for_its_stream_at_once(server, fast_backoff, mode):
    # A monitor polling for want of a stream (an older server, a silent stream) went on polling the
    # server that replaced it, the title saying why the old one was polled, until the stream's wait
    # was over: up to 120 s.
    server.stream = mode
    source = LiveSource(server.url, interval_s=0.1, silence_s=0.3, stream_retry_s=60.0)
    app = MonitorApp(source=source)
    async with app.run_test(size=(120, 30)) as pilot:
        await wait_until(pilot, app, lambda: source.use_polling and app.stats == POLLED)
        port = server.server_address[1]
        stop_server(server)
        await wait_until(pilot, app, lambda: app.banner.display)
        assert app.problem.startswith(f"cannot connect to {server.url}")
        restarted = start_server(port, stream="ok")
        try:
            await wait_until(pilot, app, lambda: app.stats == make_stats(2) and not app.banner.display)
            assert app.source_text == f"live {server.url} (stream)" and not source.use_polling
        finally:
            stop_server(restarted)


# ---- a proxy in front of the server ------------------------------------------------------------------

NGINX_502 = ("<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>502 Bad Gateway</h1>"
             "</center>\r\n<hr><center>nginx/1.24.0</center>\r\n</body>\r\n</html>\r\n")


@pytest.mark.parametrize("body, shown", [
    (NGINX_502, "502 Bad Gateway"),
    ("<!DOCTYPE html><html><head>\n<TITLE>Service &amp; API down</TITLE>", "Service & API down"),
    ("upstream connect error\r\nor disconnect/reset before headers", "upstream connect error or disconnect/reset before headers"),
    ("<title>" * 20_000, "<title>" * 14 + "<t"),
])
def test_a_proxys_error_page_is_shown_by_its_title(body, shown):
    # The banner showed the page's markup, its line breaks escaped: '<html>\r\n<head><title>502 Bad Gat'.
    message = describe_problem(HTTPStatusProblem(502, "http://h:1/v1/stats/stream", body), "http://h:1")
    assert message == f"http://h:1 answered 502: {shown}"


@pytest.mark.parametrize("location, target", [
    ("https://monitor.example.com/v1/stats/stream?cells=64&interval=0.25", "https://monitor.example.com"),
    ("/llm/v1/stats/stream?cells=64&interval=0.25", "{url}/llm"),
    ("https://user:pw@monitor.example.com/llm/v1/stats", "https://user:***@monitor.example.com/llm"),
])
async def test_a_redirect_names_where_it_points(server, location, target):
    # A proxy's redirect (http to https, a path moved under a prefix) was shown as 'answered 301: <html>...'.
    server.stream, server.redirect_to = "redirect", location
    source = LiveSource(server.url, interval_s=0.1)
    events = await events_until(source, lambda event, events: isinstance(event, SourceProblem))
    assert events[-1].message == f"{server.url} redirects to {target.format(url=server.url)} (301): give that URL"


async def test_a_stream_whose_headers_come_without_its_first_event_is_polled_after_a_few_seconds(server):
    # A minillm server sends its first snapshot with its headers; a proxy that buffered it kept the
    # dashboard blank for the whole silence limit (10 s at the default interval) before polling.
    source = LiveSource(server.url)
    assert source.silence_s == 10.0
    events = await events_until(source, lambda event, events: isinstance(event, StatsFrame))
    assert events[-2].text == f"live {server.url} (polling: the stream sent nothing for 3 s)"
    assert events[-1].stats == POLLED


async def test_an_older_servers_stalled_poll_is_waited_for_once(server):
    # The poll that replaces a missing stream timed out inside the stream's handling, where a read
    # timeout means a silent stream: it was polled a second time, the banner waiting twice as long.
    server.stream, server.poll_status = "missing", "stall"
    source = LiveSource(server.url, interval_s=0.1, silence_s=0.3)
    events = await events_until(source, lambda event, events: isinstance(event, SourceProblem))
    assert events[-1].message == f"no answer from {server.url} (timed out)"
    with server.lock:
        assert server.paths[:2] == ["stream", "poll"] and server.paths[2:3] != ["poll"], server.paths
