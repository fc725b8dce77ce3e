"""Clients that are slow to send or never read: cut off after a timeout, their requests aborted.

uvicorn has no deadline for request headers, and a stream to a client that stopped reading used to
pile its output up in the server. Here the timeouts are short (half a second) so that each case
plays out quickly; a healthy stream runs through each and must end with its solo text.
"""
from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from core_hooks import install
from test_server_helpers import HealthyStreams, call_utility, get_stats, running_server, wait_for

from minillm.server.app import ServerOptions
from minillm.server.http import MAX_HEADER_BYTES
from minillm.server.limits import ServerLimits

MODEL = "stories"
TIMEOUT_S = 0.5
LIMITS = ServerLimits(header_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S, stream_timeout_s=TIMEOUT_S,
                      timeout_keep_alive_s=TIMEOUT_S)


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(stories_path, request):
    """The server under each HTTP/1.1 implementation (the deadlines are added to either)."""
    if request.param == "httptools":
        pytest.importorskip("httptools")
    with running_server(stories_path, served_model_name=MODEL, options=ServerOptions(limits=LIMITS),
                        send_buffer_bytes=4096, core_hook=install, http=request.param) as running:
        yield running


@pytest.fixture(scope="module")
def healthy(server):
    streams = HealthyStreams(server[0], {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480, "n": 2})
    yield streams
    streams.check()
    # Everything the cut-off requests held has been given back.
    assert wait_for(lambda: (s := get_stats(server[0]))["num_running"] == 0 and s["kv_num_used_blocks"] == 0)
    assert server[1].is_healthy


def _connect(url: str, receive_buffer: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect((host, int(port)))
    sock.settimeout(30)   # a safety net: the server is expected to act within a second
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:   # an aborted connection may end in a reset rather than an orderly close
        pass
    return data


def _server_holds(server, sock: socket.socket) -> bool:
    """Whether the server still has a connection to this client socket."""
    port = sock.getsockname()[1]
    return any(conn.client and conn.client[1] == port for conn in list(server.http.server.server_state.connections))


def _request(body: dict) -> bytes:
    payload = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)


def _closed_after(sock: socket.socket) -> tuple[bytes, float]:
    start = time.monotonic()
    return _read_until_closed(sock), time.monotonic() - start


def test_headers_that_never_finish_are_cut_off(server, healthy):
    with healthy.in_flight():
        sock = _connect(server[0])
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        data, waited = _closed_after(sock)
    assert data == b"" and 0.8 * TIMEOUT_S <= waited < TIMEOUT_S + 5


def test_a_connection_that_sends_nothing_is_cut_off(server, healthy):
    with healthy.in_flight():
        data, waited = _closed_after(_connect(server[0]))
    assert data == b"" and 0.8 * TIMEOUT_S <= waited < TIMEOUT_S + 5


def test_slow_headers_of_a_second_request_on_a_kept_alive_connection_are_cut_off(server, healthy):
    with healthy.in_flight():
        sock = _connect(server[0])
        sock.sendall(_request({"model": MODEL, "prompt": "Once", "max_tokens": 2}))
        first = b""
        while b'"usage"' not in first:
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")
        data, waited = _closed_after(sock)
    assert data == b"" and waited < TIMEOUT_S + 5


def test_headers_past_the_size_limit_are_a_400(server, healthy):
    with healthy.in_flight():
        sock = _connect(server[0])
        filler = b"X-Filler: " + b"a" * 990 + b"\r\n"   # header lines past the limit, and no end of headers
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + filler * (MAX_HEADER_BYTES // len(filler) + 2))
        data, waited = _closed_after(sock)
    assert data.startswith(b"HTTP/1.1 400") and waited < TIMEOUT_S + 5


def test_a_body_that_never_finishes_is_a_408(server, healthy):
    with healthy.in_flight():
        sock = _connect(server[0])
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        data, waited = _closed_after(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["code"] == "request_timeout"
    assert 0.8 * TIMEOUT_S <= waited < TIMEOUT_S + 5


def test_a_stream_nobody_reads_is_cut_off_and_its_request_aborted(server, healthy):
    url, engine = server
    n, max_tokens = 8, 480   # with 20 log-probabilities a token: far more than the socket buffers hold
    before = get_stats(url)
    num_aborted = len(call_utility(engine, "aborted_requests"))
    with healthy.in_flight(fresh=True):
        sock = _connect(url, receive_buffer=4096)
        sock.sendall(_request({"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "n": n,
                               "logprobs": 20, "temperature": 0, "ignore_eos": True, "stream": True}))
        aborted = wait_for(lambda: (s := get_stats(url))["num_requests_finished"].get("abort", 0)
                           >= before["num_requests_finished"].get("abort", 0) + n and s, timeout=30)
        assert aborted, "the unread stream was not cut off"
        # The connection itself is dropped with what it had buffered, though the client still reads nothing.
        assert wait_for(lambda: not _server_holds(server, sock), timeout=30)
    cut_off = call_utility(engine, "aborted_requests")[num_aborted:]
    assert len(cut_off) == 1 and cut_off[0][3] < n * max_tokens    # aborted in the engine before it was done
    received = _read_until_closed(sock)   # what the kernel's buffers held, then the end
    assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received


def test_a_caller_that_falls_behind_holds_one_output_per_request():
    from minillm.outputs import CompletionOutput, RequestOutput
    from minillm.server.async_engine import OutputQueue, RequestStream
    from minillm.server.errors import EngineDeadError

    async def scenario():
        loop, queue, seen = asyncio.get_running_loop(), OutputQueue(), []
        streams = [RequestStream(f"r{i}", loop, queue, observer=lambda out, t: seen.append(out.request_id))
                   for i in range(2)]
        for step in range(1000):       # a thousand steps' outputs while nobody reads
            for stream in streams:
                text = "x" * step      # cumulative, so each is bigger than the last
                output = RequestOutput(stream.request_id, None, [1], None, [CompletionOutput(0, text, [])], False)
                stream.deliver(output, float(step))
        assert len(queue) == 2 and len(seen) == 2000   # held: the newest of each; observed: all of them
        newest = await queue.get_all()
        assert [(s.request_id, p.outputs[0].text, t) for s, p, t in newest] == [
            ("r0", "x" * 999, 999.0), ("r1", "x" * 999, 999.0)]
        streams[0].deliver(EngineDeadError("gone"), None)
        streams[0].deliver(RequestOutput("r0", None, [1], None, [CompletionOutput(0, "late", [])], False), 1000.0)
        (stream, payload, _), = await queue.get_all()
        assert stream is streams[0] and isinstance(payload, EngineDeadError)   # an error is not replaced

    asyncio.run(scenario())
