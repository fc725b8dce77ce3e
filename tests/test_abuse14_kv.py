"""Abuse of prefill/decode disaggregation's KV transfer path: what a client puts in kv_transfer_params
and what a peer sends to a transfer endpoint (or answers from one) gets a clear error or is dropped,
never an exception in the engine loop, a 500, or another request's claim answered."""
from __future__ import annotations

import time

import msgspec
import zmq

from minillm.kv_connector.endpoint import KVClaim, KVGrant, Message, TransferEndpoint
from minillm.kv_connector.lease import LeaseTable

REGION = {"kind": "shm", "handle": "/dev/shm/x", "shape": [1, 2, 3, 4, 5, 6], "dtype": "float32", "device": ""}


def recv_reply(sock, request_id: int, timeout: float = 30.0):
    """The endpoint's reply to request_id (others are skipped)."""
    decoder = msgspec.msgpack.Decoder(Message)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sock.poll(100):
            reply = decoder.decode(sock.recv())
            if reply.request_id == request_id:
                return reply
    raise AssertionError(f"no reply to claim {request_id}")


def test_an_oversized_frame_never_reaches_the_endpoint_and_it_keeps_answering():
    # A 200 MiB frame was read whole into the producer's memory (a few such frames: out of memory).
    table = LeaseTable(30)
    endpoint = TransferEndpoint("127.0.0.1", 0, "engine-p", table, REGION)
    lease = table.create([7, 8], "hash", 20)
    sizes = []
    handle = endpoint._handle
    endpoint._handle = lambda identity, data: (sizes.append(len(data)), handle(identity, data))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{endpoint.port}")
        encoder = msgspec.msgpack.Encoder()
        sock.send(b"\x00" * (64 << 20))
        sock.send(encoder.encode(KVClaim(9, lease.lease_id, "hash", 20)))
        reply = recv_reply(sock, 9)
        assert isinstance(reply, KVGrant) and reply.block_ids == [7, 8]
        assert sizes and max(sizes) < 1 << 20       # the claim alone was handled
    finally:
        sock.close()
        endpoint.close()
