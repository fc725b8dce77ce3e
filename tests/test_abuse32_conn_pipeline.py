"""A streaming client with pipelined requests queued behind its stream hangs up mid-stream.

httptools' protocol keeps the requests it parsed while a response was still going out in a queue,
and takes the last one parsed as the connection's request: on the hang-up it told that queued
request the client was gone and not the stream being served. The stream went on to its last token
(its request never aborted, its blocks held), writing every event to the closed socket, each write
after the fifth logged by asyncio ("socket.send() raised exception."). A /v1/stats/stream, which has
no last event, went on for ever.
"""
from __future__ import annotations

import json
import logging
import socket
import struct

import httpx
import pytest
from core_hooks import install
from test_server_helpers import call_utility, get_stats, running_server, wait_for

from minillm.server.app import ServerOptions
from minillm.server.limits import ServerLimits

MAX_TOKENS = 300
# Each engine step lasts at least this long: the stream cannot end by itself while the test looks on.
STEP_PACE_S = 0.05


@pytest.fixture(scope="module")
def server(stories_path):
    with running_server(stories_path, core_hook=install, http="httptools") as running:
        yield running


def _post(body: dict) -> bytes:
    payload = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(payload)) + payload


def test_a_hang_up_with_requests_pipelined_behind_the_stream_aborts_it(server, caplog):
    url, engine = server
    before = get_stats(url)["num_requests_finished"]
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    call_utility(engine, "pace_steps", STEP_PACE_S)
    try:
        stream = {"model": "stories", "prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "stream": True,
                  "ignore_eos": True}
        other = {"model": "stories", "prompt": "Once", "max_tokens": 4}
        sock.sendall(_post(stream) + _post(other) + _post(other))
        received = b""
        while received.count(b"data: ") < 3:
            chunk = sock.recv(65536)
            assert chunk, "the server closed the stream early"
            received += chunk
        with caplog.at_level(logging.WARNING, logger="asyncio"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()         # a reset, as a killed client's kernel sends
            # The stream's end, as the snapshots count it (an abort's count may come a snapshot after
            # its blocks are free).
            stats = wait_for(lambda: (s := get_stats(url))["num_running"] == 0 and s["num_waiting"] == 0
                             and s["num_requests_finished"] != before and s, timeout=60)
    finally:
        call_utility(engine, "pace_steps", 0)
    assert stats and stats["kv_num_used_blocks"] == 0
    finished = stats["num_requests_finished"]
    assert finished.get("abort", 0) == before.get("abort", 0) + 1     # the stream, cut short
    assert finished.get("length", 0) == before.get("length", 0)       # nothing ran to its end
    assert "socket.send() raised exception" not in caplog.text
    assert wait_for(lambda: not server.http.server.server_state.connections)


@pytest.fixture(scope="module")
def one_stats_stream_server(stories_path):
    options = ServerOptions(limits=ServerLimits(max_stats_streams=1))
    with running_server(stories_path, options=options, http="httptools") as running:
        yield running


def _stats_stream_status(url: str) -> int:
    """The status of a new /v1/stats/stream (closed at once)."""
    with httpx.stream("GET", f"{url}/v1/stats/stream", timeout=10) as response:
        return response.status_code


def test_a_stats_stream_with_a_request_pipelined_behind_it_ends_with_its_client(one_stats_stream_server):
    """The endless stream went on for ever after its client left, holding the only subscriber's place."""
    url, _ = one_stats_stream_server
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"GET /v1/stats/stream?interval=0.1 HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    received = b""
    while received.count(b"data: ") < 2:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the stream early"
        received += chunk
    assert _stats_stream_status(url) == 503          # the one place is taken
    sock.close()
    assert wait_for(lambda: _stats_stream_status(url) == 200)
    assert wait_for(lambda: not one_stats_stream_server.http.server.server_state.connections)
