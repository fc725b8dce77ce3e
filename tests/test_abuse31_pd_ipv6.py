"""A prefill engine's transfer endpoint on an IPv6 address (kv_ip "::1"): claimed and released over it."""
from __future__ import annotations

import asyncio
import socket
import time

import pytest

from minillm.kv_connector.endpoint import ClaimClient, KVGrant, LeaseReleaser, TransferEndpoint, tcp_address
from minillm.kv_connector.lease import LeaseTable


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_tcp_addresses_bracket_ipv6_literals():
    assert tcp_address("::1", 5) == "tcp://[::1]:5" and tcp_address("[::1]", 5) == "tcp://[::1]:5"
    assert tcp_address("127.0.0.1", 5) == "tcp://127.0.0.1:5" and tcp_address("fe80::1") == "tcp://[fe80::1]"


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_an_endpoint_on_ipv6_loopback_grants_and_takes_releases():
    # "cannot listen on ::1:0: No such device": the address went to ZeroMQ unbracketed, IPv6 off.
    table = LeaseTable(30)
    region = {"kind": "shm", "handle": "/dev/shm/x", "shape": [1, 2, 3, 4, 5, 6], "dtype": "float32", "device": ""}
    endpoint = TransferEndpoint("::1", 0, "engine-p", table, region)
    lease = table.create([7, 8], "hash", 20)

    async def ask():
        client = ClaimClient(timeout_s=10)
        try:
            return await client.claim("::1", endpoint.port, lease.lease_id, "hash", 20)
        finally:
            client.close()

    try:
        grant = asyncio.run(ask())
        assert isinstance(grant, KVGrant) and grant.block_ids == [7, 8]
        releaser = LeaseReleaser()
        releaser.release("::1", endpoint.port, lease.lease_id)
        deadline, ended = time.monotonic() + 30, []
        while not ended and time.monotonic() < deadline:
            ended = table.take_ended()
            time.sleep(0.01)
        releaser.close()
        assert [e.lease_id for e in ended] == [lease.lease_id]
    finally:
        endpoint.close()
