"""`minillm chat` used roughly: replies past the context over --url, a server that breaks or stalls
mid-reply, a chat template that renders nothing, a system message longer than the context; and
`minillm monitor`'s problem banner on an 80-column terminal."""
from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_chat import STORIES, needs_stories, run_scripted, short_context_engine  # noqa: F401
from test_server_helpers import running_server

from minillm.chat import ChatSession, ChatSettings, EngineChatBackend

TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m.content }} {% endfor %}"


@pytest.fixture(scope="module")
def engine(short_context_engine):
    return short_context_engine


@needs_stories
def test_a_reply_over_url_asked_for_more_than_the_context_gets_the_rest_of_it():
    """A model without a chat template is served by /v1/completions, whose default max_tokens is
    16: a reply capped at the context must ask for the rest of the context, not that default."""
    from minillm.chat_client import HttpChatBackend
    with running_server(STORIES, max_model_len=64) as (url, _):
        backend = HttpChatBackend(url)
        out = io.StringIO()
        run_scripted(ChatSession(backend, ChatSettings(temperature=0, max_tokens=1000), out=out),
                     ["Once upon a time"])
        stats = backend.last_stats
        assert stats.finish_reason == "length"
        assert stats.prompt_tokens + stats.output_tokens == 64, out.getvalue()
        assert "[the 64-token context is full: /reset starts over]" in out.getvalue()

        # A system message past the context fails every message, /reset or not: say how to clear it.
        out = io.StringIO()
        session = ChatSession(HttpChatBackend(url), ChatSettings(max_tokens=4), system="Tom had a ball. " * 20,
                              out=out)
        run_scripted(session, ["hi", "/reset", "hi"], status=1)
        assert out.getvalue().count("(the system message counts too: /system alone clears it)") == 2


class _BreakingBackend:
    """Writes part of a reply, then its connection breaks."""
    name, has_chat_template, last_stats = "breaking", True, None

    def stream_reply(self, conversation, settings, should_stop):
        yield "Tom ran to the"
        raise RuntimeError("the stream from http://127.0.0.1:1 broke: peer closed connection")


def test_a_reply_broken_midway_puts_its_error_on_a_line_of_its_own():
    out = io.StringIO()
    history = run_scripted(ChatSession(_BreakingBackend(), out=out), ["hello"], status=1)
    assert "Tom ran to the\nerror: the stream from http://127.0.0.1:1 broke" in out.getvalue()
    assert history == [[]]          # the failed message is not kept


class _StallingServer(BaseHTTPRequestHandler):
    """/v1/models, and a completion stream that sends one chunk and then nothing until released."""
    release = threading.Event()

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        body = json.dumps({"data": [{"id": "stalling", "max_model_len": 512}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunk = {"choices": [{"index": 0, "delta": {"content": "Once upon"}, "finish_reason": None}]}
        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.flush()
        self.release.wait(60)


def test_one_ctrl_c_stops_a_reply_from_a_server_that_stalls():
    """README: Ctrl-C stops a reply. A server that stops sending must not need a second Ctrl-C."""
    from minillm.chat_client import HttpChatBackend
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StallingServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out, sigints = io.StringIO(), []
    write = out.write

    def watch(text: str) -> int:
        # Ctrl-C once the first chunk is on the screen; a second one only if the first did nothing.
        written = write(text)
        if text == "Once upon":
            def press() -> None:
                sigints.append(1)
                os.kill(os.getpid(), signal.SIGINT)
                if not stopped.wait(10):
                    sigints.append(2)
                    os.kill(os.getpid(), signal.SIGINT)
            threading.Thread(target=press, daemon=True).start()
        return written

    stopped = threading.Event()
    out.write = watch
    session = ChatSession(HttpChatBackend(f"http://127.0.0.1:{server.server_address[1]}"), out=out)
    try:
        history = run_scripted(session, ["hello"])
    finally:
        stopped.set()
        _StallingServer.release.set()
        server.shutdown()
        server.server_close()
    assert "Once upon [interrupted]" in out.getvalue()
    assert history == [["hello", "Once upon"]]
    assert sigints == [1], "the first Ctrl-C left the chat waiting on the server"


@needs_stories
def test_a_template_that_renders_nothing_is_named_not_the_prompt(engine):
    out = io.StringIO()
    backend = EngineChatBackend(engine, "stories", chat_template='{{ "" }}')
    run_scripted(ChatSession(backend, ChatSettings(max_tokens=4), out=out), ["hello"], status=1)
    assert "error: the chat template rendered an empty prompt" in out.getvalue()
    assert not engine.has_unfinished_requests()


@needs_stories
def test_a_system_message_past_the_context_says_how_to_clear_it(engine):
    """/reset keeps the system message: a message that fails because of it says /system clears it."""
    out = io.StringIO()
    session = ChatSession(EngineChatBackend(engine, "stories", chat_template=TEMPLATE),
                          ChatSettings(temperature=0, max_tokens=4), system="Tom had a ball. " * 20, out=out)
    history = run_scripted(session, ["hi", "/reset", "hi", "/system", "hi"], status=1)
    text = out.getvalue()
    assert text.count("(the system message counts too: /system alone clears it)") == 2
    assert "error: message too long" in text
    assert history[-1][0] == "hi" and len(history[-1]) == 2      # answered once the system message was cleared


class _RefusingSource:
    """A stats source whose server refuses the API key, as LiveSource reports it."""

    async def events(self, cells):
        from minillm.tui.client import SourceProblem
        yield SourceProblem("http://127.0.0.1:8000 refused the API key (401): pass the server's key with "
                            "--api-key", 0.5)
        await asyncio.Event().wait()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_monitors_problem_banner_is_shown_whole_on_an_80_column_terminal(anyio_backend):
    """The banner's end says what to do (--api-key) and when it retries: a one-row banner cut it off."""
    from minillm.tui.app import MonitorApp
    app = MonitorApp(_RefusingSource())
    async with app.run_test(size=(80, 24)) as pilot:
        while not app.banner.display:
            await pilot.pause(0.02)
        await pilot.pause()
        text = app.banner.content.plain
        assert text.endswith("--api-key · retrying in 0.5 s")
        assert app.banner.size.height >= 2 and app.banner.size.height * app.banner.size.width >= len(text)
        assert app.grid.size.height > 0
