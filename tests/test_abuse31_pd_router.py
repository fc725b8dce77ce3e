"""`minillm router` between real prefill and decode servers (stories260K, engines on threads) that
an operator set up wrong: a decode server whose blocks hold another number of tokens, or one started
without --kv-role. Its refusal of the kv_transfer_params the router wrote is the router's 502, never
a 400 naming a field the client did not send, and the prompt's lease goes back to the prefill server.
And a client that leaves while a decode server holds the claimed lease: the router leaves the lease
to its claimer."""
from __future__ import annotations

import asyncio
import io
import json
import socket

import httpx
import msgspec
import pytest
from test_abuse29_pd_router import BODY as FAKE_BODY, Backend, prefill_backend
from test_server_helpers import get_stats, openai_error, running_router, running_server, wait_for

from minillm.kv_connector.endpoint import ClaimClient, KVRelease, Message
from minillm.router import RouterConfig

BODY = {"model": "stories", "prompt": "Once upon a time there was a little girl named Lily who loved to play",
        "temperature": 0, "max_tokens": 4}


@pytest.fixture(scope="module")
def prefill_url(stories_path):
    with running_server(stories_path, engine_core="thread",
                        kv_transfer_config={"kv_role": "kv_producer", "kv_lease_s": 60}) as (url, _):
        yield url


def leases(url: str) -> tuple[int, int]:
    """A prefill server's (leases held, leases released)."""
    stats = get_stats(url)
    return stats["kv_transfer_num_leases"], stats["kv_transfer_leases_released"]


@pytest.mark.parametrize("decode_kwargs,reason", [
    ({"block_size": 32, "kv_transfer_config": {"kv_role": "kv_consumer"}}, "blocks hold 16 tokens, this engine's 32"),
    ({}, "takes no part in KV transfers"),
], ids=["block-size", "no-kv-role"])
def test_a_decode_server_that_refuses_the_kv_transfer_is_a_502_not_the_clients_400(
        stories_path, prefill_url, decode_kwargs, reason):
    with running_server(stories_path, engine_core="thread", **decode_kwargs) as (decode_url, _), \
            running_router(RouterConfig((prefill_url,), (decode_url,))) as router:
        for stream in (False, True):
            _, released = leases(prefill_url)
            r = httpx.post(f"{router}/v1/completions", json={**BODY, "stream": stream}, timeout=60)
            error = openai_error(r, 502, code="decode_server_failed")
            assert decode_url in error["message"] and reason in error["message"], error
            assert wait_for(lambda: leases(prefill_url) == (0, released + 1), timeout=10), leases(prefill_url)
        stats = httpx.get(f"{router}/v1/stats", timeout=10).json()
        assert stats["num_failed"] == 2


# ---------------------------------------------------------------------------------------------
# A client that leaves while a decode server holds the claimed lease
# ---------------------------------------------------------------------------------------------

class ClaimingBackend(Backend):
    """The prefill server of test_abuse29_pd_router's Backend; as a decode server it claims the
    lease, as a decode API server does before its engine copies the blocks, then answers nothing
    until its connection closes."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        kv = body.get("kv_transfer_params") or {}
        if not kv.get("do_remote_prefill"):
            self.rfile = io.BytesIO(json.dumps(body).encode())
            self.headers.replace_header("content-length", str(len(self.rfile.getvalue())))
            return super().do_POST()

        async def claim():
            client = ClaimClient(timeout_s=30)
            try:
                return await client.claim(kv["remote_host"], kv["remote_port"], kv["remote_lease_id"],
                                          kv["remote_prompt_hash"], kv["remote_num_tokens"])
            finally:
                client.close()

        self.server.grants.append(asyncio.run(claim()))
        self.connection.settimeout(30)
        self.connection.recv(1)                # the router closed the request: its client left


@pytest.fixture
def claiming_backend():
    with prefill_backend(ClaimingBackend, grants=[]) as both:
        yield both


def test_a_client_that_leaves_never_releases_a_lease_the_decode_server_claimed(claiming_backend):
    # The router released the lease of every request whose client left before the decode server's
    # answer began, claimed or not: the prefill server freed (and could reuse) blocks the decode
    # engine had yet to copy, whose KV it then cached under the prompt. A claimed lease is the
    # claimer's to release (its API server or its engine's connector, after any copy).
    url, server = claiming_backend
    handled = []
    handle = server.endpoint._handle

    def handle_and_note(identity: bytes, data: bytes) -> None:
        handle(identity, data)
        handled.append(msgspec.msgpack.decode(data, type=Message))

    server.endpoint._handle = handle_and_note
    with running_router(RouterConfig((url,), (url,))) as router:
        port = int(router.rsplit(":", 1)[1])
        data = json.dumps({**FAKE_BODY, "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
                           b"content-length: %d\r\n\r\n%s" % (len(data), data))
            assert wait_for(lambda: server.grants, timeout=30), "the decode server never claimed the lease"
        stats = lambda: httpx.get(f"{router}/v1/stats").json()     # noqa: E731
        assert wait_for(lambda: stats()["num_client_closed"] == 1, timeout=10), stats()
        assert wait_for(lambda: any(isinstance(m, KVRelease) for m in handled), timeout=10), handled
    assert server.leases.num_released == 0, "a claimed lease was released by the router"
    (grant,) = server.grants
    assert server.leases.release(grant.lease_id)       # its claimer's release frees it
