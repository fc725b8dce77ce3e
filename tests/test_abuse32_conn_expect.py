"""`Expect: 100-continue` requests answered before their body was asked for (401, 413, 415).

The client holds its body until it sees 100 Continue; an answer that comes first means the body is
never sent. The server answered without `Connection: close` and kept the connection waiting for the
declared body, so a client that sent its next request on it (the answer said the connection stays)
had that request read as the body of the last one and waited for ever.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import socket

import pytest
from test_server_helpers import get_stats, running_server, wait_for

from minillm.server.app import ServerOptions
from minillm.server.limits import ServerLimits

KEY = "sk-test"
BODY = json.dumps({"model": "stories", "prompt": "Once", "max_tokens": 4}).encode()
# Timeouts far longer than the test: only the server's own close can end the connection.
LONG = ServerLimits(timeout_keep_alive_s=600.0, header_timeout_s=600.0, max_body_bytes=1000)


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request, stories_path):
    with running_server(stories_path, api_key=KEY, options=ServerOptions(limits=dataclasses.replace(LONG)),
                        http=request.param) as running:
        yield running


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One response's head and body (by its Content-Length)."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed mid-response: {received!r}"
        received += chunk
    head, body = received.split(b"\r\n\r\n", 1)
    (length,) = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
    while len(body) < length:
        body += sock.recv(65536)
    return head, body


def _request(length: int, auth: bool = True, extra: bytes = b"") -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + (f"Authorization: Bearer {KEY}\r\n".encode() if auth else b"") + extra
            + b"Content-Length: %d\r\n\r\n" % length)


@pytest.mark.parametrize("status, head", [
    (413, _request(5000, extra=b"Expect: 100-continue\r\n")),
    (401, _request(len(BODY), auth=False, extra=b"Expect: 100-continue\r\n")),
    (415, _request(len(BODY), extra=b"Expect: 100-continue\r\nContent-Encoding: gzip\r\n")),
], ids=["413", "401", "415"])
def test_an_answer_before_the_body_closes_the_connection(server, status, head):
    url, _ = server
    sock = _connect(url)
    sock.sendall(head)                       # the body waits for 100 Continue, which does not come
    response_head, body = _response(sock)
    assert response_head.startswith(b"HTTP/1.1 %d" % status), response_head
    assert b"connection: close" in response_head.lower().split(b"\r\n")
    assert json.loads(body)["error"]["code"]
    assert sock.recv(65536) == b""            # closed: the client's next request goes on a new connection
    sock.close()
    assert wait_for(lambda: not server.http.server.server_state.connections)


def test_a_body_asked_for_keeps_the_connection(server):
    """100 Continue sent and the body read: the connection serves the next request as before."""
    url, _ = server
    sock = _connect(url)
    sock.sendall(_request(len(BODY), extra=b"Expect: 100-continue\r\n"))
    assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
    sock.sendall(BODY)
    head, body = _response(sock)
    assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["usage"]["completion_tokens"] == 4
    gz = gzip.compress(BODY)                 # a 415 to a body sent whole: the connection stays too
    sock.sendall(_request(len(gz), extra=b"Content-Encoding: gzip\r\n") + gz + _request(len(BODY)) + BODY)
    assert _response(sock)[0].startswith(b"HTTP/1.1 415")
    head, body = _response(sock)
    assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["usage"]["completion_tokens"] == 4
    sock.close()
    assert wait_for(lambda: (s := get_stats(url, {"Authorization": f"Bearer {KEY}"}))["num_running"] == 0
                    and s["num_waiting"] == 0 and s["kv_num_used_blocks"] == 0)
