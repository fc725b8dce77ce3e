"""Leftovers: a dead engine core's error reads the same streamed or not; `minillm chat`'s token count
gives up on a server that does not answer /tokenize."""
from __future__ import annotations

import json
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
from test_server_helpers import get_stats, running_server, sse_events, wait_for

from minillm import chat_client
from minillm.chat import ChatSettings, Conversation

MODEL = "stories"


def test_a_dead_engine_cores_error_is_the_plain_message_streamed_or_not(stories_path):
    # The stream's error event read "EngineDeadError: the engine core has died: ...", the 500's
    # body "the engine core has died: ...": vLLM sends str(exc) in both.
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
    results, first_chunk = {}, threading.Event()

    def streaming():
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                first_chunk.set()
        results["stream"] = lines

    def plain():
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        results["plain"] = (response.status_code, response.json())

    with running_server(stories_path, served_model_name=MODEL, engine_core="process") as (url, engine):
        threads = [threading.Thread(target=streaming), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        assert first_chunk.wait(30)
        assert wait_for(lambda: get_stats(url)["num_running"] == 2, timeout=30)
        os.kill(engine.core_pid, signal.SIGKILL)
        for t in threads:
            t.join(30)
            assert not t.is_alive(), "a request hung after the engine core died"
        reason = engine.dead_reason
    status, error = results["plain"]
    assert status == 500 and error["error"]["code"] == "engine_dead"
    assert error["error"]["message"] == reason and reason.startswith("the engine core has died")
    streamed = sse_events(results["stream"])[-1]["error"]
    assert streamed == error["error"], (streamed, error["error"])


class _HangingTokenizeServer:
    """A server that lists model `m` (a 100-token context), streams a one-word reply to each chat
    completion, and takes each POST /tokenize without ever answering it (until stopped)."""

    def __init__(self) -> None:
        self.num_tokenize, self.stopped = 0, threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                self._send("application/json", json.dumps(
                    {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": 100}]}).encode())

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/tokenize":
                    owner.num_tokenize += 1
                    owner.stopped.wait()
                    return
                chunk = {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "stop"}]}
                self._send("text/event-stream", f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())

            def _send(self, content_type: str, body: bytes) -> None:
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.stopped.set()
        self.http.shutdown()
        self.http.server_close()


def test_chat_url_goes_on_without_a_count_when_tokenize_never_answers(monkeypatch):
    # The count before a reply waited out the whole reply timeout (600 s) without a word, each turn.
    monkeypatch.setattr(chat_client, "TOKENIZE_READ_TIMEOUT_S", 0.2)
    server = _HangingTokenizeServer()
    try:
        backend = chat_client.HttpChatBackend(server.url, timeout_s=5.0)
        settings = ChatSettings(max_tokens=80)    # past half the context: the chat counts the prompt first
        conversation = Conversation(turns=[{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"},
                                           {"role": "user", "content": "Again"}])
        for _ in range(2):
            assert "".join(backend.stream_reply(conversation, settings, lambda: False)) == "Hi"
            conversation.turns += [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "More"}]
    finally:
        server.stop()
    assert server.num_tokenize == 1
    assert backend.notices == [f"note: {server.url}/tokenize did not answer within 0.2 s, so the chat no longer "
                               "counts tokens before a reply."]
    assert backend.client.timeout.read == 5.0 and len(conversation.turns) == 7
