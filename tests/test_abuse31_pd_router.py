"""`minillm router` between real prefill and decode servers (stories260K, engines on threads) that
an operator set up wrong: a decode server whose blocks hold another number of tokens, or one started
without --kv-role. Its refusal of the kv_transfer_params the router wrote is the router's 502, never
a 400 naming a field the client did not send, and the prompt's lease goes back to the prefill server."""
from __future__ import annotations

import httpx
import pytest
from test_server_helpers import get_stats, openai_error, running_router, running_server, wait_for

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
