"""The monitor's stats client against a small fake server: SSE, polling, auth, bad answers, retries."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

import minillm.tui.client as client
from test_tui import make_stats, write_recording
from minillm.tui.app import MonitorApp
from minillm.tui.client import LiveSource, SourceProblem, SourceStatus, StatsFormatError, StatsFrame, iter_sse_data, parse_stats
from minillm.tui.history import StatsHistory
from minillm.tui.recording import Recorder, ReplaySource, load_recording

pytestmark = pytest.mark.anyio

API_KEY = "secret"


@pytest.fixture
def anyio_backend():
    return "asyncio"


class FakeStatsHandler(BaseHTTPRequestHandler):
    """The first path segment picks a behaviour: ok, auth, missing, garbage, poll, error."""

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def do_GET(self) -> None:
        url = urlparse(self.path)
        mode, _, rest = url.path.lstrip("/").partition("/")
        cells = int(parse_qs(url.query).get("cells", ["64"])[0])
        self.server.seen_cells.append(cells)
        if mode == "missing" or (mode in ("poll", "router") and rest == "v1/stats/stream"):
            return self._send(404, "application/json", json.dumps({"error": {"message": "Not Found"}}))
        if mode == "auth" and self.headers.get("Authorization") != f"Bearer {API_KEY}":
            return self._send(401, "application/json", json.dumps({"error": {"message": "Invalid API key"}}))
        if mode == "router" and rest == "v1/stats":      # what `minillm router` answers
            from minillm.router import RouterStats
            stats = RouterStats().to_dict({"prefill": ["http://p:1"], "decode": ["http://d:2"]})
            return self._send(200, "application/json", json.dumps(stats))
        if rest == "v1/stats":
            return self._send(200, "application/json", json.dumps(make_stats(1).to_dict()))
        if mode == "garbage":
            return self._send(200, "text/event-stream", "data: <html>oops</html>\n\n")
        events = [make_stats(k).to_dict() for k in range(3)]
        if mode == "error":
            events[1] = {"error": {"message": "engine loop died", "code": "engine_dead"}}
        if mode == "nan":
            events[1]["kv_usage"] = float("nan")   # json.dumps writes NaN, which json.loads takes
        body = ": ping\n\n" + "".join(f"event: stats\ndata: {json.dumps(e)}\n\n" for e in events)
        self._send(200, "text/event-stream", body)

    def _send(self, status: int, content_type: str, body: str) -> None:
        data = body.encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass   # a client that read what it needed and left (the monitor's poll test does)


@pytest.fixture(scope="module")
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeStatsHandler)
    server.seen_cells = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", server
    server.shutdown()
    server.server_close()


@pytest.fixture
def fast_backoff(monkeypatch):
    monkeypatch.setattr(client, "BACKOFF_START_S", 0.01)
    monkeypatch.setattr(client, "BACKOFF_MAX_S", 0.04)


def closed_port_url() -> str:
    """A URL on 127.0.0.1 where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def collect(source, count: int, cells: int = 100, timeout: float = 5.0) -> list:
    """The first `count` events of a source."""
    events = []

    async def run() -> None:
        async with contextlib.aclosing(source.events(lambda: cells)) as stream:   # closed in this task
            async for event in stream:
                events.append(event)
                if len(events) >= count:
                    return

    await asyncio.wait_for(run(), timeout)
    return events


async def test_sse_parser_joins_data_lines_and_skips_the_rest():
    async def lines():
        for line in [": ping", "", "event: stats", "data: {\"a\":", "data: 1}", "", "id: 3", "data: x"]:
            yield line

    assert [d async for d in iter_sse_data(lines())] == ['{"a":\n1}', "x"]


def test_parse_stats_round_trips_the_dataclass():
    stats = make_stats(3)
    assert parse_stats(json.loads(json.dumps(stats.to_dict()))) == stats


@pytest.mark.parametrize("path, value, message", [
    (("kv_usage",), None, "missing field 'kv_usage'"),
    (("memory", "total_bytes"), "lots", "field 'memory.total_bytes' should be int"),
    (("requests", 1, "prompt_tokens"), None, "missing field 'requests[1].prompt_tokens'"),
    (("block_map",), [0, "x"], "field 'block_map' should be a list of ints"),
    (("num_running",), True, "field 'num_running' should be int"),
    (("kv_usage",), float("nan"), "field 'kv_usage' should be a finite number"),
    (("recent_steps", 0, "step_time_s"), float("inf"), "field 'recent_steps[0].step_time_s' should be a finite"),
    (("ttft_p50_s",), float("-inf"), "field 'ttft_p50_s' should be a finite number"),
])
def test_parse_stats_names_the_bad_field(path, value, message):
    data = make_stats(2).to_dict()
    target = data
    for key in path[:-1]:
        target = target[key]
    if value is None:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    with pytest.raises(StatsFormatError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_stats(data)


async def test_stream_delivers_frames_with_the_asked_cell_count(fake_server):
    url, server = fake_server
    events = await collect(LiveSource(f"{url}/ok"), 4, cells=321)
    assert isinstance(events[0], SourceStatus) and "stream" in events[0].text
    frames = [e for e in events if isinstance(e, StatsFrame)]
    assert [f.stats for f in frames] == [make_stats(k) for k in range(3)]
    assert 321 in server.seen_cells


async def test_api_key_is_sent_and_a_missing_one_is_explained(fake_server, fast_backoff):
    url, _ = fake_server
    events = await collect(LiveSource(f"{url}/auth", api_key=API_KEY), 2)
    assert isinstance(events[1], StatsFrame)
    events = await collect(LiveSource(f"{url}/auth"), 2)
    assert isinstance(events[1], SourceProblem)
    assert "asks for an API key (401)" in events[1].message and "--api-key" in events[1].message


async def test_wrong_url_garbage_and_refused_connections_are_explained(fake_server, fast_backoff):
    url, _ = fake_server
    cases = {
        f"{url}/missing": "has no /v1/stats (404)",
        f"{url}/garbage": "bad stats from",
        f"{url}/error": "the server reported: engine loop died",
        f"{url}/router": "this is a minillm router, which has no KV cache of its own: watch one of its servers "
                         "(http://d:2, http://p:1)",
        closed_port_url(): "cannot connect to",
        "not a url": "invalid server URL",
    }
    for base, expected in cases.items():
        events = await collect(LiveSource(base), 8)
        problems = [e for e in events if isinstance(e, SourceProblem)]
        assert problems and expected in problems[0].message, (base, events)


async def test_url_without_scheme_or_with_the_openai_path_reaches_the_server(fake_server):
    url, _ = fake_server
    bare = url.removeprefix("http://")
    for base in (f"{bare}/ok", f"{url}/ok/v1", f"{url}/ok/v1/", f"{url}/ok/v1/stats"):
        events = await collect(LiveSource(base), 2)
        assert events[0].text == f"live {url}/ok (stream)", base
        assert isinstance(events[1], StatsFrame), (base, events)


async def test_a_port_out_of_range_is_named_not_an_exception_group(fast_backoff):
    events = await collect(LiveSource("http://127.0.0.1:99999"), 2)
    assert isinstance(events[1], SourceProblem)
    assert "port" in events[1].message and "ExceptionGroup" not in events[1].message, events[1].message


async def test_retries_back_off_and_recover(fast_backoff):
    events = await collect(LiveSource(closed_port_url()), 8)
    delays = [e.retry_in_s for e in events if isinstance(e, SourceProblem)]
    assert delays[:3] == [0.01, 0.02, 0.04] and max(delays) == 0.04


async def test_falls_back_to_polling_without_the_stream(fake_server):
    url, _ = fake_server
    source = LiveSource(f"{url}/poll", interval_s=0.05)
    events = await collect(source, 4)
    frames = [e for e in events if isinstance(e, StatsFrame)]
    assert source.use_polling and len(frames) >= 2 and frames[0].stats == make_stats(1)


async def test_app_shows_a_banner_and_keeps_retrying(fast_backoff):
    app = MonitorApp(source=LiveSource(closed_port_url()))
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause(0.3)
        banner = app.query_one("#banner")
        assert banner.display and "cannot connect to" in banner.content.plain
        assert "retrying in" in banner.content.plain
        assert app.is_running and app.stats is None


async def test_app_shows_non_finite_stats_as_a_problem_and_keeps_running(fake_server, fast_backoff):
    url, _ = fake_server
    app = MonitorApp(source=LiveSource(f"{url}/nan"))
    async with app.run_test(size=(100, 30)) as pilot:
        banner = app.query_one("#banner")
        for _ in range(200):
            if banner.display and app.frames_shown >= 1:
                break
            await pilot.pause(0.05)
        assert "bad stats from" in banner.content.plain and "finite number" in banner.content.plain
        assert app.is_running and app.frames_shown >= 1


async def test_app_records_what_it_sees_from_a_live_server(fake_server, tmp_path):
    url, _ = fake_server
    path = tmp_path / "live.jsonl"
    app = MonitorApp(source=LiveSource(f"{url}/ok"), recorder=Recorder(path))
    async with app.run_test(size=(100, 30)) as pilot:
        for _ in range(200):
            if app.frames_shown >= 3:
                break
            await pilot.pause(0.01)
        assert not app.query_one("#banner").display
        assert app.stats.num_running == 4
    recorded = [frame.stats for _, frame in load_recording(path)]
    # The stream may reopen once the grid knows its size, so frames can repeat, but none is lost or changed.
    expected = [make_stats(k) for k in range(3)]
    assert len(recorded) >= 3 and all(stats in expected for stats in recorded) and expected[2] in recorded


async def test_replay_keeps_the_recorded_pace(tmp_path):
    path = tmp_path / "paced.jsonl"
    write_recording(path, num_frames=5, dt=0.06)
    start = time.monotonic()
    events = await collect(ReplaySource(path, loop=False), 6)
    assert time.monotonic() - start >= 0.2
    assert [e.stats for e in events if isinstance(e, StatsFrame)] == [make_stats(k) for k in range(5)]


def test_gzip_recordings_round_trip(tmp_path):
    path = tmp_path / "small.jsonl.gz"
    frames = write_recording(path, num_frames=3)
    assert [frame.stats for _, frame in load_recording(path)] == frames
    assert path.read_bytes()[:2] == b"\x1f\x8b"


async def test_replay_loops(tmp_path):
    path = tmp_path / "loop.jsonl"
    write_recording(path, num_frames=2, dt=0.0)
    events = await collect(ReplaySource(path, loop=True), 6)
    assert [e.stats.time for e in events if isinstance(e, StatsFrame)] == [1000.0, 1001.0, 1000.0, 1001.0]


def test_history_dedupes_steps_and_resets_when_numbers_go_back():
    history = StatsHistory()
    history.add(make_stats(0))
    history.add(make_stats(1))
    history.add(make_stats(1))
    assert [s.step for s in history.steps] == list(range(1, 13))
    history.add(make_stats(0))  # a restarted server starts counting again
    assert [s.step for s in history.steps] == list(range(1, 9))
    assert list(history.kv_usage) == [make_stats(k).kv_usage for k in (0, 1, 1, 0)]
