"""`minillm chat --url` against a server that is odd: plain http given as https://, a model id holding an
ESC, a reply interrupted before its first chunk, a reply that fails after old exchanges were dropped for it."""
from __future__ import annotations

import io
import json
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_chat import run_scripted

from minillm.chat import ChatSession, ChatSettings

ESC_ID = "evil\x1b]0;pwned\x07"
MAX_MESSAGES = 3          # a longer conversation is refused as past the context


class _FakeServer(BaseHTTPRequestHandler):
    """/v1/models; a chat completion that replies "Re: TEXT", stalls before its headers on "stall" (until
    released) and breaks after one chunk on "die"; past MAX_MESSAGES messages, vLLM's context-length 400."""
    arrived = threading.Event()
    release = threading.Event()

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send(200, {"data": [{"id": "fake", "max_model_len": 512}, {"id": ESC_ID}]})

    def do_POST(self) -> None:
        if self.path != "/v1/chat/completions":
            self._send(404, {"error": {"message": "not found"}})
            return
        messages = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["messages"]
        text = messages[-1]["content"]
        if len(messages) > MAX_MESSAGES:
            self._send(400, {"error": {"message": "too long", "code": "context_length_exceeded",
                                       "param": "messages"}})
        elif text == "stall":
            self.arrived.set()
            self.release.wait(30)
        else:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            chunks = [{"choices": [{"index": 0, "delta": {"content": f"Re: {text}"}, "finish_reason": None}]}]
            if text != "die":           # "die": the connection closes after the first chunk
                chunks += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                           {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}]
            self.wfile.write("".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode())
            if text != "die":
                self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture(scope="module")
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        _FakeServer.release.set()
        server.shutdown()
        server.server_close()


def _session(url: str) -> tuple[ChatSession, io.StringIO]:
    from minillm.chat_client import HttpChatBackend
    out = io.StringIO()
    return ChatSession(HttpChatBackend(f"http://{url}"), ChatSettings(max_tokens=8), out=out), out


def test_https_to_a_plain_http_server_says_to_use_http(url):
    # It said "cannot reach a minillm server at https://...: [SSL: WRONG_VERSION_NUMBER] wrong version number".
    from minillm.chat_client import HttpChatBackend
    with pytest.raises(RuntimeError) as caught:
        HttpChatBackend(f"https://{url}")
    assert str(caught.value) == f"TLS with https://{url} failed: the server does not speak TLS: is it http://, " \
                                "not https://?"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stderr, shown", [(_Terminal(), "evil\\x1b]0;pwned\\x07"), (io.StringIO(), ESC_ID)])
def test_a_model_id_with_an_esc_in_the_error_line_is_escaped_on_a_terminal(url, monkeypatch, stderr, shown):
    from minillm.cli import main
    monkeypatch.setattr("sys.stderr", stderr)
    with pytest.raises(SystemExit) as caught:
        main(["chat", "--url", url, "wrongname"])
    assert caught.value.code == 1
    assert stderr.getvalue() == f"minillm: error: the server at http://{url} does not serve 'wrongname' " \
                                f"(it serves: fake, {shown})\n"


def test_ctrl_c_before_the_first_chunk_keeps_no_turn_and_no_stale_stats(url):
    # It kept the message with an empty reply, and /stats showed the reply before it.
    session, out = _session(url)

    def interrupt() -> None:
        if _FakeServer.arrived.wait(30):
            os.kill(os.getpid(), signal.SIGINT)

    _FakeServer.arrived.clear()
    threading.Thread(target=interrupt, daemon=True).start()
    history = run_scripted(session, ["hi", "stall", "/stats"])
    assert history == [["hi", "Re: hi"], ["hi", "Re: hi"]]
    stats = out.getvalue().split("[interrupted]")[1]
    assert "last reply (measured by the client): 0 tokens in" in stats
    assert "finish reason abort" in stats and "prompt: not counted" in stats, stats


def test_exchanges_dropped_for_a_message_that_failed_come_back(url):
    # The oldest exchange was dropped to fit "die", whose stream then broke: it stayed dropped.
    session, out = _session(url)
    history = run_scripted(session, ["a", "b", "die", "c"], status=1)
    assert history[2] == ["a", "Re: a", "b", "Re: b"], out.getvalue()
    assert "(dropped the 1 oldest exchange(s) to fit the 512-token context)" in out.getvalue()
    assert "(the exchanges dropped to fit that message are kept)" in out.getvalue()
    assert history[3] == ["b", "Re: b", "c", "Re: c"]
