"""`minillm monitor` against servers that answer without end or oddly: an error body or a /v1/stats
answer that never ends, a stream line that never ends, JSON nested past the stack (an error body's
too) or with an integer too long to read; the stream's lines split as httpx splits them."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_tui_client import collect, fast_backoff  # noqa: F401 - quick retries, as a fixture

import minillm.tui.client as client
from minillm.tui.client import LiveSource, SourceProblem, StatsFormatError, bounded_lines, parse_frame


@pytest.fixture
def anyio_backend():
    return "asyncio"


class _EndlessServer(BaseHTTPRequestHandler):
    """server.mode: "error" (a 500 whose body never ends), "poll" (no stream; a /v1/stats whose body
    never ends), "line" (a stats stream whose first line never ends), "nested" (a 500 whose body
    is JSON nested past the stack)."""
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        mode = self.server.mode
        if mode == "poll" and "/stream" in self.path:
            body = b'{"error": {"message": "Not Found"}}'
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if mode == "nested":
            body = b"[" * 50_000
            self.send_response(500)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(500 if mode == "error" else 200)
        self.send_header("Content-Type", "text/event-stream" if mode == "line" else "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunk = b"x" * 4096
        first = b"data: " if mode == "line" else b""
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(first + chunk), first + chunk))
            while not self.server.is_stopping:      # until the client goes away
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except OSError:
            pass


@pytest.fixture
def endless_server(monkeypatch):
    monkeypatch.setattr(client, "MAX_EVENT_CHARS", 64 * 1024)
    monkeypatch.setattr(client, "MAX_ERROR_BYTES", 16 * 1024, raising=False)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EndlessServer)
    server.is_stopping = False
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", server
    server.is_stopping = True
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("mode, named", [
    ("error", "answered 500: xxxx"),
    ("poll", "/v1/stats answered over 65536 bytes: not a minillm server"),
    ("line", "a line over 65536 characters in the stats stream: not a minillm server"),
    ("nested", "answered 500: [[[["),      # RecursionError out of the handler of errors: the monitor's end
], ids=["error-body", "poll-body", "stream-line", "nested-error-body"])
async def test_an_answer_without_end_or_past_the_parser_is_a_problem_the_monitor_shows(anyio_backend, endless_server,
                                                                                   fast_backoff, mode, named):  # noqa: F811
    # The monitor read each of them whole (response.aread(), client.get(), aiter_lines()): its memory
    # grew by gigabytes a minute and no problem was ever shown.
    url, server = endless_server
    server.mode = mode
    events = await collect(LiveSource(url), 4)
    problems = [e for e in events if isinstance(e, SourceProblem)]
    assert problems and named in problems[0].message, events
    assert len(problems[0].message) < 300


@pytest.mark.parametrize("text, named", [
    ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply to read"),
    ("1" * 5000, "JSON with an integer too long to read"),
    ('{"a": ' + "9" * 5000 + "}", "JSON with an integer too long to read"),
], ids=["nested", "integer", "integer-field"])
def test_json_no_parser_reads_is_bad_stats_not_a_lost_server(text, named):
    # RecursionError and ValueError went past parse_frame: "lost http://...: RecursionError: ...".
    with pytest.raises(StatsFormatError, match=named):
        parse_frame(text)


async def _lines(chunks: list[str], limit: int = 100) -> list[str]:
    async def source():
        for chunk in chunks:
            yield chunk
    return [line async for line in bounded_lines(source(), limit)]


@pytest.mark.parametrize("chunks, lines", [
    (["data: a\r\n\r\ndata: b\n\n"], ["data: a", "", "data: b", ""]),
    (["data: a\r", "\n\r", "\ndata: b\n", "\n"], ["data: a", "", "data: b", ""]),     # \r\n cut in two: one end
    (["da", "ta: a\r\r", "data: b\r\r"], ["data: a", "", "data: b", ""]),
    (["data: a\n\ndata: b"], ["data: a", "", "data: b"]),                               # the last line unended
])
async def test_stream_lines_split_as_httpx_splits_them(anyio_backend, chunks, lines):
    assert await _lines(chunks) == lines


async def test_a_line_past_the_limit_is_refused_one_at_the_limit_is_kept(anyio_backend):
    assert await _lines(["x" * 60, "x" * 40, "\n"]) == ["x" * 100]
    with pytest.raises(StatsFormatError, match="a line over 100 characters"):
        await _lines(["x" * 60, "x" * 41, "\n"])
    assert await _lines(["x" * 90 + "\n", "y" * 90 + "\n"]) == ["x" * 90, "y" * 90]     # the count starts over


def test_a_frame_still_parses():
    from test_tui import make_stats
    assert parse_frame(json.dumps(make_stats(1).to_dict())).stats == make_stats(1)
