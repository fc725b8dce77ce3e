"""The router's view of its servers: one that refused a connection is down for a backoff (requests go
to the others without trying it again, a 503 with Retry-After when every one is down) until its /health
answers 200; and GET /metrics, the router's own Prometheus series (requests and errors by route,
requests, failures and health by server, request durations)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minillm.router import RouterConfig, create_router_app

pytestmark = pytest.mark.anyio

KV = {"remote_lease_id": "lease-1", "remote_host": "127.0.0.1", "remote_port": 1}
BODY = {"prompt": "Once", "max_tokens": 4}


@pytest.fixture
def anyio_backend():
    return "asyncio"


class FakeServer(BaseHTTPRequestHandler):
    """A prefill and decode server in one: /health answers the server's health_status; a prompt
    "refuse" is a 400."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.server.paths.append(("GET", self.path))
        if self.path == "/health":
            return self._send(self.server.health_status, {})
        self._send(200, {"object": "list", "data": []})

    def do_POST(self) -> None:
        self.server.paths.append(("POST", self.path))
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if body.get("prompt") == "refuse":
            return self._send(400, {"error": {"message": "refused", "type": "invalid_request_error",
                                              "param": "prompt", "code": None}})
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            return self._send(200, {"choices": [{"text": "x"}], "kv_transfer_params": KV})
        self._send(200, {"choices": [{"text": "decoded"}]})

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class Server:
    """A FakeServer on its own port; until listen() its port is bound but refuses connections."""

    def __init__(self) -> None:
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer, bind_and_activate=False)
        self.http.server_bind()
        self.http.paths, self.http.health_status = [], 200
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread: threading.Thread | None = None

    def listen(self) -> Server:
        self.http.server_activate()
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()
        return self

    @property
    def paths(self) -> list[tuple[str, str]]:
        return self.http.paths

    def close(self) -> None:
        if self.thread is not None:
            self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def servers():
    """Make Servers, listening or not; close them all after."""
    made = []

    def make(listening: bool = True) -> Server:
        server = Server()
        made.append(server)
        return server.listen() if listening else server

    yield make
    for server in made:
        server.close()


@contextlib.asynccontextmanager
async def router_client(config: RouterConfig):
    """(the Router, an httpx client of its app) in this event loop; the router's sends to its servers
    are recorded in router.sent (their URLs)."""
    app = create_router_app(config)
    router = app.state.router
    await router.start()
    router.sent = []
    send = router.client.send

    async def recording_send(request, **kwargs):
        router.sent.append(str(request.url))
        return await send(request, **kwargs)

    router.client.send = recording_send
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router",
                                     timeout=60) as client:
            yield router, client
    finally:
        await router.close()


async def until(predicate, timeout: float = 30.0):
    """Wait, letting the router's tasks run, until predicate() is truthy; return its last value."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return value


def sent_to(router, server: Server) -> list[str]:
    return [url for url in router.sent if url.startswith(server.url + "/")]


async def test_a_server_that_refused_a_connection_is_not_tried_again_during_its_backoff(servers):
    live, dead = servers(), servers(listening=False)
    config = RouterConfig((live.url,), (dead.url, live.url), backoff_s=60, max_backoff_s=60)
    async with router_client(config) as (router, client):
        for _ in range(6):
            response = await client.post("/v1/completions", json=BODY)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == "decoded"
        assert (await client.get("/v1/models")).status_code == 200
        # The dead server's turn came three times: one connection refused, then it was passed over.
        assert len(sent_to(router, dead)) == 1
        health = router.server_health[dead.url]
        assert not health.is_up and health.reason == "ConnectError" and 59 < health.down_for_s() <= 60
        assert [path for method, path in live.paths if method == "POST"].count("/v1/completions") == 12


async def test_every_server_down_is_a_503_with_retry_after_and_no_connection_tried(servers):
    dead = servers(listening=False)
    config = RouterConfig((dead.url,), (dead.url,), backoff_s=30, max_backoff_s=30)
    async with router_client(config) as (router, client):
        first = await client.post("/v1/completions", json=BODY)
        assert first.status_code == 503 and first.json()["error"]["code"] == "prefill_unavailable"
        assert router.sent == [dead.url + "/v1/completions"]
        again = await client.post("/v1/completions", json=BODY)
        models = await client.get("/v1/models")      # the server is down in its decode role too
        responses = await client.post("/v1/responses", json={"input": "Once"})
        assert len(router.sent) == 1, router.sent
    for response, role in ((again, "prefill"), (models, "decode"), (responses, "decode")):
        assert response.status_code == 503
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == f"{role}_unavailable"
        assert error["type"] == "server_error" and error["message"].startswith(f"no {role} server is reachable (")
        assert f"{dead.url}: down for another " in error["message"] and "after ConnectError" in error["message"]
        assert 29 <= int(response.headers["retry-after"]) <= 30


async def test_a_down_server_is_used_again_only_after_its_health_answers_200(servers):
    live, revived = servers(), servers(listening=False)
    config = RouterConfig((live.url,), (revived.url, live.url), backoff_s=0.05, max_backoff_s=60)
    async with router_client(config) as (router, client):
        health = router.server_health[revived.url]

        async def served_until(predicate) -> bool:
            """Once the server's backoff ends, send a request (which checks its /health, on the side) and
            wait for the check, until predicate() holds."""
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                assert await until(health.is_due_for_check, timeout=60)
                assert (await client.post("/v1/completions", json=BODY)).status_code == 200
                assert await until(lambda: not health.is_checking)
                if predicate():
                    return True
            return False

        for _ in range(2):                # one of the two tries the revived server first
            assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        assert not health.is_up and health.reason.endswith("ConnectError")
        num_down = health.num_down
        revived.http.health_status = 503          # up, not ready: it stays down, for a longer backoff
        revived.listen()
        assert await served_until(lambda: health.reason == "/health answered 503")
        assert not health.is_up and health.num_down > num_down
        revived.http.health_status = 200
        assert await served_until(lambda: health.is_up)
        assert set(revived.paths) == {("GET", "/health")}    # checked, not yet used
        for _ in range(2):
            assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        assert ("POST", "/v1/completions") in revived.paths and health.num_down == 0


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """A Prometheus exposition as {(sample name, sorted labels): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_metrics_count_requests_by_route_and_server_and_show_each_servers_health(servers):
    live, dead = servers(), servers(listening=False)
    secret = live.url.replace("http://", "http://user:s3cret@")
    shown = live.url.replace("http://", "http://user:***@")
    async with router_client(RouterConfig((secret,), (dead.url, secret), backoff_s=60)) as (router, client):
        for prompt in ("Once", "Once", "Once", "refuse"):
            await client.post("/v1/completions", json={**BODY, "prompt": prompt})
        response = await client.get("/metrics")
        only_health = await client.get("/metrics", params={"name[]": "minillm_router_worker_health"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    assert "s3cret" not in response.text
    got = samples(response.text)
    route = (("route", "/v1/completions"),)
    assert got["minillm_router_requests_total", route] == 4
    assert got["minillm_router_request_errors_total", (("route", "/v1/completions"), ("status", "400"))] == 1
    assert got["minillm_router_request_duration_seconds_count", route] == 4

    def of(name: str, role: str, worker: str) -> float:
        return got[name, (("role", role), ("worker", worker))]

    # The prefill server answered all four (the fourth with its 400); the decode server the three it got.
    assert of("minillm_router_processed_requests_total", "prefill", shown) == 4
    assert of("minillm_router_processed_requests_total", "decode", shown) == 3
    assert of("minillm_router_processed_requests_total", "decode", dead.url) == 0
    assert of("minillm_router_worker_errors_total", "decode", dead.url) == 1
    assert of("minillm_router_worker_errors_total", "decode", shown) == 0
    assert of("minillm_router_worker_health", "decode", dead.url) == 0
    assert of("minillm_router_worker_health", "decode", shown) == 1
    assert {name for name, _ in samples(only_health.text)} == {"minillm_router_worker_health"}


@pytest.mark.parametrize("field, value", [("backoff_s", 0.0), ("max_backoff_s", -1.0), ("backoff_s", float("nan"))])
def test_a_backoff_that_is_no_positive_number_of_seconds_is_refused(field, value):
    with pytest.raises(ValueError, match="must be a positive number of seconds"):
        RouterConfig(("http://a",), ("http://b",), **{field: value})
