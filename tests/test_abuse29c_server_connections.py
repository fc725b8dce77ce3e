"""Connections that come and go as a public server's do: what a closed one leaves behind.

A client that resets its connection (SO_LINGER 0, a crashed or killed client, a load balancer's
health probe) after a response used to leave the connection's protocol, transport and request state
alive in uvicorn's keep-alive timer until it fired; a client churning connections held thousands at
once (the server's memory grew by about 3 KB a connection and stayed grown).
"""
from __future__ import annotations

import dataclasses
import gc
import socket
import struct
import weakref

import pytest
from test_server_helpers import running_server, wait_for

from minillm.server.app import ServerOptions
from minillm.server.limits import ServerLimits

# Timeouts far longer than the test, so that only the close can free the connection's state.
LONG = ServerLimits(timeout_keep_alive_s=600.0, header_timeout_s=600.0)


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request, stories_path):
    options = ServerOptions(limits=dataclasses.replace(LONG))
    with running_server(stories_path, options=options, http=request.param) as running:
        yield running


def _answered_connection(url: str) -> socket.socket:
    """A connection that has had a whole response (its body read to the end) and is kept alive."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(65536)
    head, body = received.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200"), head
    (length,) = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
    while len(body) < length:
        body += sock.recv(65536)
    return sock


def _reset(sock: socket.socket) -> None:
    """Close with a reset (RST), as a killed client's kernel does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@pytest.mark.parametrize("close", [_reset, socket.socket.close], ids=["reset", "clean"])
def test_a_closed_keep_alive_connection_leaves_nothing_behind(server, close):
    connections = server.http.server.server_state.connections
    assert wait_for(lambda: not connections)
    sock = _answered_connection(server[0])
    (protocol,) = wait_for(lambda: list(connections))
    ref = weakref.ref(protocol)
    del protocol
    close(sock)
    assert wait_for(lambda: not connections), "the server did not see the connection close"
    assert wait_for(lambda: gc.collect() >= 0 and ref() is None), "the closed connection's state is still held"
