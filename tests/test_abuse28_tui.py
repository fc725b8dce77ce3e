"""`minillm chat --url` and `minillm monitor` against servers that answer oddly: stream events that are
not the OpenAI chunk shape, a stream that ends without its [DONE], a page instead of a stream, a model
list without ids, stats with numbers too large for a float, and a URL that carries a password."""
from __future__ import annotations

import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_chat import run_scripted

from minillm.chat import ChatSession, ChatSettings
from minillm.chat_client import HttpChatBackend

OK_CHUNK = json.dumps({"choices": [{"index": 0, "delta": {"content": "Tom ran"}, "finish_reason": None}]})


class _OddServer(BaseHTTPRequestHandler):
    """GET /v1/models answers server.models; POST streams server.events (raw `data:` payloads), then
    `data: [DONE]` unless server.done is False; server.page: a text/html page instead of a stream;
    server.failure: (status, body) instead of a stream."""
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._send("application/json", json.dumps(self.server.models).encode())

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.server.failure is not None:
            status, body = self.server.failure
            return self._send("application/json", body, status)
        if self.server.page:
            return self._send("text/html", b"<html><body>Welcome to nginx!</body></html>")
        body = "".join(f"data: {event}\n\n" for event in self.server.events)
        if self.server.done:
            body += "data: [DONE]\n\n"
        self._send("text/event-stream", body.encode())

    def _send(self, content_type: str, body: bytes, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def odd_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OddServer)
    server.models = {"data": [{"id": "odd", "max_model_len": 512}]}
    server.events, server.done, server.page, server.failure = [OK_CHUNK], True, False, None
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", server
    server.shutdown()
    server.server_close()


def chat_over(url: str, lines: list[str], status: int) -> str:
    """What a scripted chat against url printed."""
    out = io.StringIO()
    run_scripted(ChatSession(HttpChatBackend(url), ChatSettings(max_tokens=8), out=out), lines, status=status)
    return out.getvalue()


@pytest.mark.parametrize("event, named", [
    ("[1, 2]", "not a JSON object"),
    ("5", "not a JSON object"),
    ("null", "not a JSON object"),
    ("<html>", "not JSON"),
    (json.dumps({"choices": ["x"]}), "choices"),
    (json.dumps({"choices": {"a": 1}}), "choices"),
    (json.dumps({"choices": [{"delta": None}]}), "delta"),
    (json.dumps({"choices": [{"delta": {"content": 5}}]}), "content"),
    (json.dumps({"choices": [{"text": ["a"]}]}), "text"),
])
def test_a_stream_event_of_the_wrong_shape_is_one_error_line_and_the_chat_goes_on(odd_server, event, named):
    url, server = odd_server
    server.events = [OK_CHUNK, event]
    out = chat_over(url, ["hello", "/stats", "/help"], status=1)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and named in errors[0] and "Traceback" not in out, out
    assert "commands:" in out          # /help after the failed reply still answers


def test_a_usage_of_the_wrong_shape_is_ignored_not_a_crash_in_stats(odd_server):
    url, server = odd_server
    for usage in (5, {"completion_tokens": "many", "prompt_tokens": "x"}):
        server.events = [OK_CHUNK, json.dumps({"choices": [], "usage": usage})]
        out = chat_over(url, ["hello", "/stats"], status=0)
        assert "Tom ran" in out and "last reply (measured by the client): 1 tokens" in out, out


def test_a_stream_that_ends_without_its_done_is_an_error_not_a_whole_reply(odd_server):
    """A proxy that cuts the stream between events: the reply is not kept as if it were whole."""
    url, server = odd_server
    server.done = False
    out = chat_over(url, ["hello"], status=1)
    assert "Tom ran\nerror: the stream from " in out and "ended before the reply finished" in out, out


def test_a_page_instead_of_a_stream_is_named_not_an_empty_reply(odd_server):
    url, server = odd_server
    server.page = True
    out = chat_over(url, ["hello"], status=1)
    assert f"error: {url}/v1/chat/completions answered text/html, not a stream of events" in out, out


@pytest.mark.parametrize("models", [{"data": [{"object": "model"}]}, {"data": [{"id": {"a": 1}}]},
                                    {"data": [{"id": None, "max_model_len": 64}]}])
def test_a_model_list_without_model_ids_is_named_at_start(odd_server, models):
    url, server = odd_server
    server.models = models
    with pytest.raises(RuntimeError, match="lists no models"):
        HttpChatBackend(url)


def test_a_model_list_that_is_a_number_is_named_at_start(odd_server):
    url, server = odd_server
    server.models = {"data": 5}
    with pytest.raises(RuntimeError, match="did not answer with a model list"):
        HttpChatBackend(url)


@pytest.mark.parametrize("max_model_len", [True, -5, 0, "64"])
def test_a_context_length_that_is_no_positive_integer_is_not_taken(odd_server, max_model_len):
    url, server = odd_server
    server.models = {"data": [{"id": "odd", "max_model_len": max_model_len}]}
    assert HttpChatBackend(url).context_len is None


class _StatsServer(BaseHTTPRequestHandler):
    """GET /v1/stats/stream: server.events (JSON texts) as one stream of stats events."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        body = "".join(f"data: {event}\n\n" for event in self.server.events).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def stats_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StatsServer)
    server.events = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", server
    server.shutdown()
    server.server_close()


def huge_stats(path: tuple[str, ...]) -> str:
    """A stats event whose field at `path` is 10**400, an integer no float holds."""
    from test_tui import make_stats
    data = make_stats(1).to_dict()
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = 10 ** 400
    return json.dumps(data)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("path", [("memory", "weights_bytes"), ("memory", "kv_pool_bytes")])
async def test_the_monitor_shows_an_integer_past_a_float_as_a_problem_and_goes_on(anyio_backend, stats_server,
                                                                                   path, monkeypatch):
    """The memory panel converted weights_bytes to float: OverflowError ended the dashboard."""
    import minillm.tui.client as client
    from test_tui import make_stats
    from minillm.tui.app import MonitorApp
    from minillm.tui.client import LiveSource
    monkeypatch.setattr(client, "BACKOFF_START_S", 0.01)
    url, server = stats_server
    server.events = [json.dumps(make_stats(0).to_dict()), huge_stats(path)]
    app = MonitorApp(LiveSource(url))
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.problem is not None)
        assert f"'{'.'.join(path)}'" in app.problem and "64-bit" in app.problem, app.problem
        server.events = [json.dumps(make_stats(2).to_dict())]
        # The next good frame clears the banner. A reconnect made before the events were replaced
        # replays the first good frame (and the huge one) first: wait for the new frame itself.
        steps = make_stats(2).num_steps
        await wait_until(pilot, lambda: app.problem is None and app.stats.num_steps == steps)


async def wait_until(pilot, condition, limit_s: float = 20.0) -> None:
    """Let the app run until condition() holds; fail when the app stopped or limit_s passed."""
    import time
    deadline = time.monotonic() + limit_s
    while not condition():
        assert pilot.app.is_running and time.monotonic() < deadline, "the app stopped or the condition never held"
        await pilot.pause(0.02)


def with_userinfo(url: str, userinfo: str = "ann:hunter2") -> str:
    return url.replace("://", f"://{userinfo}@")


def test_chat_never_prints_the_password_of_its_url(odd_server):
    url, server = odd_server
    server.events, server.done = [OK_CHUNK], False      # a failing reply prints the URL too
    out = io.StringIO()
    run_scripted(ChatSession(HttpChatBackend(with_userinfo(url)), out=out), ["hello"], status=1)
    assert "hunter2" not in out.getvalue() and "ann:***@127.0.0.1" in out.getvalue(), out.getvalue()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_monitor_never_shows_the_password_of_its_url(anyio_backend, monkeypatch):
    import minillm.tui.client as client
    from test_tui_client import closed_port_url, collect
    monkeypatch.setattr(client, "BACKOFF_START_S", 0.01)
    status, problem = await collect(client.LiveSource(with_userinfo(closed_port_url())), 2)
    assert "ann:***@127.0.0.1" in status.text and "hunter2" not in status.text
    assert "ann:***@127.0.0.1" in problem.message and "hunter2" not in problem.message


def test_a_password_in_the_url_beside_an_api_key_is_refused_not_sent_instead_of_it():
    """Both go in the Authorization header, where httpx put the URL's Basic one over the key."""
    from minillm.tui.client import LiveSource
    url = with_userinfo("http://127.0.0.1:1")
    for make in (lambda: LiveSource(url, api_key="key"), lambda: HttpChatBackend(url, api_key="key")):
        with pytest.raises(ValueError, match="the URL's user and password or --api-key, not both"):
            make()


class _SilentBackend:
    """A backend for commands only: no message is sent."""
    name, has_chat_template, last_stats = "silent", True, None


def test_a_tab_separates_a_commands_words_as_a_space_does():
    out = io.StringIO()
    session = ChatSession(_SilentBackend(), out=out)
    run_scripted(session, ["/set\ttemperature\t0.5", "/set top_k \t 3", "/system\tBe brief."])
    assert session.settings.temperature == 0.5 and session.settings.top_k == 3, out.getvalue()
    assert session.conversation.system == "Be brief."


def test_control_characters_in_a_bad_command_are_shown_escaped_not_sent_to_the_terminal():
    out = io.StringIO()
    run_scripted(ChatSession(_SilentBackend(), out=out), ["/\x1b[2J\x07", "/set\x00 top_p 1", "/set top_p \x1b[31m"])
    text = out.getvalue()
    assert "\x1b" not in text and "\x07" not in text and "\x00" not in text, repr(text)
    assert "unknown command '/\\x1b[2J\\x07' (try /help)" in text and "unknown command '/set\\x00'" in text
    assert "error: top_p needs a number, got '\\x1b[31m'" in text


@pytest.mark.parametrize("body", [b"\xc3\x28 engine down", b'{"error": {"message": "\xff"}}'])
def test_an_error_body_that_is_not_utf8_is_still_the_servers_status(odd_server, body):
    """json() of such a body raised UnicodeDecodeError: the line was a codec's message, not the 500."""
    url, server = odd_server
    server.failure = (500, body)
    out = chat_over(url, ["hello"], status=1)
    assert "error: server answered 500: " in out and "codec" not in out, out
