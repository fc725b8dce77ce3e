"""Using chat and monitor as people do: what a reply or a server's error holds must not act on the terminal."""
from __future__ import annotations

import asyncio
import contextlib
import io
import ssl
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_chat import run_scripted

from minillm.chat import ChatSession

# What a reply sampled at a high temperature can hold: byte tokens such as ESC (stories260K at
# temperature 3, seed 12, wrote "rain bar\x1bt had"); ESC c resets the terminal, ESC ] sets its title.
RAW_REPLY = "Once\x1bc upon\x1b]0;owned\x07 a \x9b2Jtime\tthere\r\nwas"


class _TerminalOut(io.StringIO):
    """A StringIO that says it is a terminal, as sys.stdout is in an interactive chat."""

    def isatty(self) -> bool:
        return True


class _RawBackend:
    """Replies with RAW_REPLY; a message holding "fail" gets a server error that quotes it."""

    name, has_chat_template, last_stats = "raw", True, None

    def stream_reply(self, conversation, settings, should_stop):
        text = conversation.turns[-1]["content"]
        if "fail" in text:
            raise ValueError(f"server answered 400: unknown model '\x1b[31m{text}'")
        return (delta for delta in (RAW_REPLY[:5], RAW_REPLY[5:]))


def test_a_reply_and_an_error_write_no_control_character_to_a_terminal():
    out = _TerminalOut()
    history = run_scripted(ChatSession(_RawBackend(), out=out), ["hello", "fail"], status=1)
    shown = out.getvalue()
    assert "Once\\x1bc upon\\x1b]0;owned\\x07 a \\x9b2Jtime\tthere\r\nwas" in shown
    assert "unknown model '\\x1b[31mfail'" in shown
    assert not {"\x1b", "\x07", "\x9b"} & set(shown)
    assert history[0] == ["hello", RAW_REPLY]       # the conversation keeps the reply as the model wrote it


def test_a_reply_to_a_file_or_a_pipe_is_written_as_it_came():
    out = io.StringIO()
    run_scripted(ChatSession(_RawBackend(), out=out), ["hello"])
    assert RAW_REPLY in out.getvalue()


# ---- the monitor over https ---------------------------------------------------------------------------------

class _Silent(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@contextmanager
def _http_server(tls_files: dict | None = None):
    """A web server on 127.0.0.1 (TLS with tls_files' certificate): its port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Silent)
    if tls_files is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(tls_files["cert"], tls_files["key"])
        server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _first_problem(url: str) -> str:
    """The banner the monitor shows first for url."""
    from minillm.tui.client import LiveSource, SourceProblem

    async def first() -> str:
        async with contextlib.aclosing(LiveSource(url).events(lambda: 8)) as events:   # closed in this task
            async for event in events:
                if isinstance(event, SourceProblem):
                    return event.message
    return asyncio.run(first())


def test_the_monitor_says_a_server_that_is_up_speaks_no_tls_to_https():
    # It said "cannot connect to https://127.0.0.1:PORT: is `minillm serve` running there?"
    with _http_server() as port:
        message = _first_problem(f"https://127.0.0.1:{port}")
    assert message == f"TLS with https://127.0.0.1:{port} failed: the server does not speak TLS: is it http://, " \
                      "not https://?"


def test_the_monitor_says_how_to_trust_a_private_ca(tmp_path, monkeypatch):
    make_tls_files = pytest.importorskip("test_abuse36_serve_transport").make_tls_files
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    with _http_server(make_tls_files(tmp_path)) as port:
        message = _first_problem(f"https://127.0.0.1:{port}")
    assert message.startswith(f"TLS with https://127.0.0.1:{port} failed: unable to get local issuer certificate")
    assert message.endswith("$SSL_CERT_FILE (its CA's certificate)")
