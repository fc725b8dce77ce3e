"""A decode server whose engine dies while a request it took holds a claimed lease: the request is
a 500 naming the engine's death, /health says 503, and the API server gives the lease back at once
(the dead engine copies nothing more and would never release it), not at the lease's end."""
from __future__ import annotations

import contextlib

import httpx
from test_server_helpers import CHAT_TEMPLATE, get_stats, running_server, wait_for

from minillm.server.app import ServerOptions

BODY = {"model": "stories", "prompt": "Once upon a time there was a little girl named Lily who loved to play",
        "temperature": 0, "max_tokens": 8}


class FatalSteps:
    """A core_hook: once armed, every step raises an error the engine cannot contain."""

    def __init__(self) -> None:
        self.is_armed = False

    def install(self, engine) -> None:
        real_step = engine.step

        def step():
            if self.is_armed:
                raise RuntimeError("injected fatal step failure")
            return real_step()

        engine.step = step


@contextlib.contextmanager
def producer_and_consumer(stories_path, core_hook, engine_core: str = "thread"):
    """A prefill server (engine on a thread, leases held 60 s) and a decode server whose engine
    core_hook patches, both with CHAT_TEMPLATE: yield (prefill url, decode url, the decode engine client)."""
    options = ServerOptions(chat_template=CHAT_TEMPLATE)
    with running_server(stories_path, engine_core="thread", options=options,
                        kv_transfer_config={"kv_role": "kv_producer", "kv_lease_s": 60}) as (p_url, _), \
            running_server(stories_path, engine_core=engine_core, options=options, core_hook=core_hook,
                           kv_transfer_config={"kv_role": "kv_consumer"}) as (d_url, d_engine):
        yield p_url, d_url, d_engine


def prefill(p_url: str, body: dict) -> dict:
    """Prefill body (one token) on the prefill server for a remote decode: the kv_transfer_params of its lease."""
    response = httpx.post(f"{p_url}/v1/completions", timeout=60,
                          json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert response.status_code == 200, response.text
    return response.json()["kv_transfer_params"]


def test_a_dead_decode_engine_gives_its_claimed_lease_back(stories_path):
    fatal = FatalSteps()
    with producer_and_consumer(stories_path, fatal.install) as (p_url, d_url, _):
        kv_transfer_params = prefill(p_url, BODY)
        assert get_stats(p_url)["kv_transfer_num_leases"] == 1
        fatal.is_armed = True
        response = httpx.post(f"{d_url}/v1/completions", timeout=60,
                              json={**BODY, "kv_transfer_params": kv_transfer_params})
        assert response.status_code == 500 and "injected fatal step failure" in response.text, response.text
        assert response.json()["error"]["code"] == "engine_dead"
        assert httpx.get(f"{d_url}/health", timeout=10).status_code == 503
        assert wait_for(lambda: get_stats(p_url)["kv_transfer_num_leases"] == 0, timeout=10)
        stats = get_stats(p_url)
        assert (stats["kv_transfer_leases_released"], stats["kv_transfer_leases_expired"]) == (1, 0)
