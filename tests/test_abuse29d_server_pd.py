"""A decode server's API server gives a claimed lease back only while its engine never got the
request: once the engine has accepted it, its KV connector releases the lease when the request ends
(an API-server release then could let the prefill server reuse the blocks before the copy ran).

Two servers in this process (engine cores on threads): a prefill server and a decode server whose
engine steps can be held, so a request the engine accepted is still waiting for its load when its
client hangs up.
"""
from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest
from test_server_helpers import CHAT_TEMPLATE, get_stats, running_server, wait_for

from minillm.kv_connector.endpoint import ClaimClient
from minillm.kv_connector.lease import LeaseTable
from minillm.server.app import ServerOptions

PROMPT = "Once upon a time there was a little girl named Lily who loved to play in the park"
MESSAGES = [{"role": "user", "content": "Tom had a big red ball. He liked to kick it high into the sky"}]


class StepGate:
    """A core_hook: while closed, the engine takes requests but runs no step (it waits instead)."""

    def __init__(self) -> None:
        self.is_open = threading.Event()
        self.is_open.set()

    def install(self, engine) -> None:
        real_step = engine.step

        def step():
            if not self.is_open.is_set():
                self.is_open.wait(0.01)        # the core goes on taking commands (adds, aborts) meanwhile
                return []
            return real_step()

        engine.step = step


GATE = StepGate()


@pytest.fixture(scope="module")
def servers(stories_path):
    """(prefill url, decode url, the decode server's engine client)."""
    options = ServerOptions(chat_template=CHAT_TEMPLATE)
    with running_server(stories_path, engine_core="thread", options=options,
                        kv_transfer_config={"kv_role": "kv_producer", "kv_lease_s": 60}) as (p_url, _), \
            running_server(stories_path, engine_core="thread", options=options, core_hook=GATE.install,
                           kv_transfer_config={"kv_role": "kv_consumer"}) as (d_url, d_engine):
        yield p_url, d_url, d_engine


@pytest.fixture
def releases(monkeypatch):
    """{"producer": lease ids the prefill server was told to release, "api": those the decode API server sent}."""
    seen: dict[str, list[str]] = {"producer": [], "api": []}
    table_release, client_release = LeaseTable.release, ClaimClient.release

    def on_table(self, lease_id):
        seen["producer"].append(lease_id)
        return table_release(self, lease_id)

    def on_client(self, host, port, lease_id):
        seen["api"].append(lease_id)
        return client_release(self, host, port, lease_id)

    monkeypatch.setattr(LeaseTable, "release", on_table)
    monkeypatch.setattr(ClaimClient, "release", on_client)
    yield seen
    GATE.is_open.set()


def lease(p_url: str, route: str, body: dict) -> dict:
    """The kv_transfer_params of a prefill request for body on the prefill server."""
    response = httpx.post(f"{p_url}{route}", timeout=60,
                          json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert response.status_code == 200, response.text
    return response.json()["kv_transfer_params"]


def watch_accepted(engine, monkeypatch) -> threading.Event:
    """An event set once the decode engine has accepted an add (its add_request returned)."""
    accepted = threading.Event()
    real_add = engine.add_request

    async def add_request(*args, **kwargs):
        stream = await real_add(*args, **kwargs)
        accepted.set()
        return stream

    monkeypatch.setattr(engine, "add_request", add_request)
    return accepted


def post_and_hang_up(url: str, route: str, body: dict, accepted: threading.Event) -> None:
    """Send a non-streaming request on a bare socket and close it once the engine accepted it."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        assert accepted.wait(30), "the decode engine never accepted the request"


def decode_idle(d_url: str) -> bool:
    stats = get_stats(d_url)
    return stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_num_used_blocks"] == 0


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"model": "stories", "prompt": PROMPT, "temperature": 0}),
    ("/v1/chat/completions", {"model": "stories", "messages": MESSAGES, "temperature": 0}),
])
def test_a_hang_up_after_the_engine_took_the_request_leaves_the_release_to_the_connector(
        servers, releases, monkeypatch, route, body):
    p_url, d_url, d_engine = servers
    kv = lease(p_url, route, body)
    accepted = watch_accepted(d_engine, monkeypatch)
    GATE.is_open.clear()          # the engine takes the request, but its load does not run yet
    post_and_hang_up(d_url, route, {**body, "max_tokens": 8, "kv_transfer_params": kv}, accepted)
    # The connector releases the lease of the request aborted before its load ...
    assert wait_for(lambda: kv["remote_lease_id"] in releases["producer"], timeout=30)
    assert wait_for(lambda: get_stats(p_url)["kv_transfer_num_leases"] == 0, timeout=30)
    GATE.is_open.set()
    assert wait_for(lambda: decode_idle(d_url), timeout=30)
    # ... and it alone: the API server sent none (one more request makes sure nothing is still queued).
    assert httpx.post(f"{d_url}{route}", json={**body, "max_tokens": 1}, timeout=60).status_code == 200
    assert releases["api"] == []
    assert releases["producer"] == [kv["remote_lease_id"]]


def test_a_request_the_engine_refuses_has_its_lease_released_by_the_api_server(servers, releases, monkeypatch):
    # The engine never gets the request (its add is refused): the API server gives the lease back.
    p_url, d_url, d_engine = servers
    body = {"model": "stories", "prompt": PROMPT, "temperature": 0}
    kv = lease(p_url, "/v1/completions", body)

    async def refused(*args, **kwargs):
        raise ValueError("refused by the engine")

    monkeypatch.setattr(d_engine, "add_request", refused)
    response = httpx.post(f"{d_url}/v1/completions", timeout=60, json={**body, "max_tokens": 2, "kv_transfer_params": kv})
    assert response.status_code == 400 and "refused by the engine" in response.text, response.text
    assert wait_for(lambda: get_stats(p_url)["kv_transfer_num_leases"] == 0, timeout=30)
    assert releases["api"] == [kv["remote_lease_id"]] and releases["producer"] == [kv["remote_lease_id"]]
