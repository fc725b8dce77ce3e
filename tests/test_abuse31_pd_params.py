"""Hand-crafted kv_transfer_params sent straight to a decode server: an address that can never answer
is the client's 400 at once, and a claim to an address that did not answer leaves no socket behind
that ZeroMQ would reconnect to every 100 ms for as long as the server runs."""
from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from test_server_helpers import openai_error, running_server

from minillm.kv_connector.endpoint import ClaimClient
from minillm.kv_connector.lease import prompt_hash

MODEL = "stories"
IDS = [1, 403, 411, 263, 358, 282, 281, 431, 266, 275, 268, 369, 301, 291, 358, 392, 300, 31]   # stories260K ids


@pytest.fixture(scope="module")
def consumer(stories_path):
    with running_server(stories_path, served_model_name=MODEL, engine_core="thread",
                        kv_transfer_config={"kv_role": "kv_consumer"}) as (url, _):
        yield url


def decode_params(**override) -> dict:
    return {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9, "remote_lease_id": "0" * 32,
            "remote_num_tokens": len(IDS), "remote_prompt_hash": prompt_hash(IDS), **override}


@pytest.mark.parametrize("field", ["remote_host", "remote_lease_id", "remote_prompt_hash"])
def test_an_empty_string_field_is_a_400_naming_it(consumer, field):
    # An empty remote_host went to ZeroMQ as tcp://:PORT, which it takes and never connects: a 503
    # "did not answer within 5 s" (a status clients retry) for params that can never work.
    r = httpx.post(f"{consumer}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": IDS, "max_tokens": 4, "kv_transfer_params": decode_params(**{field: ""})})
    error = openai_error(r, 400, "kv_transfer_params")
    assert error["message"] == f"kv_transfer_params: {field} must be a non-empty string, got ''"


def read_until_closed(conn: socket.socket) -> None:
    """Read what the peer sends until it closes the connection (socket.timeout if it never does)."""
    conn.settimeout(30)
    while conn.recv(4096):
        pass


def test_a_claim_nobody_answers_closes_its_connection():
    # The socket of a claim that timed out stayed open: ZeroMQ kept reconnecting to the address a
    # client chose (an HTTP server there logged "Invalid HTTP request" ten times a second), up to
    # 64 such addresses at once, for as long as the decode server ran.
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)
    port = listener.getsockname()[1]

    async def claim_nobody_answers() -> None:
        client = ClaimClient(timeout_s=0.5)
        try:
            claim = asyncio.ensure_future(client.claim("127.0.0.1", port, "0" * 32, "hash", 3))
            accepted, _ = await asyncio.to_thread(listener.accept)     # ZeroMQ connected, and waits
            try:
                with pytest.raises(asyncio.TimeoutError):
                    await claim
                assert client.endpoints == []
                await asyncio.to_thread(read_until_closed, accepted)
            finally:
                accepted.close()
        finally:
            client.close()

    try:
        asyncio.run(claim_nobody_answers())
    finally:
        listener.close()
