"""The router against small fake backends in-process: URLs as people give them, refusals passed
through with their body, bad timeouts refused up front."""
from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from minillm.router import RouterConfig, create_router_app

pytestmark = pytest.mark.anyio

KV = {"remote_lease_id": "lease-1", "remote_host": "127.0.0.1", "remote_port": 1}


@pytest.fixture
def anyio_backend():
    return "asyncio"


class FakeBackend(BaseHTTPRequestHandler):
    """A prefill and decode server in one: the first path segment picks ok or refuse."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self.server.paths.append(self.path)
        if self.path.endswith(("/v1/models", "/version")):
            return self._send(200, {"path": self.path, "auth": self.headers.get("authorization")})
        self._send(200 if self.path.endswith("/health") else 404, {"status": "ok"})

    def do_POST(self) -> None:
        self.server.paths.append(self.path)
        self.server.request_ids.append((self.path, self.headers.get("x-request-id")))
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.path.endswith("tokenize"):
            return self._send(200, {"path": self.path, "auth": self.headers.get("authorization"), "body": body})
        kv = body.get("kv_transfer_params", {})
        if self.path.startswith("/refuse/") and kv.get("do_remote_prefill") is None and "remote_lease_id" in kv:
            return self._send(400, {"error": {"message": "max_tokens is too large", "param": "max_tokens"}})
        if kv.get("do_remote_decode"):
            return self._send(200, {"choices": [{"text": "x"}], "kv_transfer_params": KV})
        self._send(200, {"choices": [{"text": "decoded"}], "kv_seen": kv})

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def backend():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeBackend)
    server.paths, server.request_ids = [], []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", server
    server.shutdown()
    server.server_close()


async def post(config: RouterConfig, path: str = "/v1/completions", **body) -> httpx.Response:
    app = create_router_app(config)
    await app.state.router.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            if path == "/health":
                return await client.get(path)
            return await client.post(path, json={"prompt": "Once", "max_tokens": 4, **body})
    finally:
        await app.state.router.close()


async def test_backend_urls_given_as_openai_base_urls_reach_the_routes(backend):
    url, server = backend
    config = RouterConfig((f"{url}/ok/v1/",), (f"{url}/ok/v1",))
    response = await post(config)
    assert response.status_code == 200 and response.json()["kv_seen"] == KV, response.text
    assert (await post(config, "/health")).status_code == 200
    assert not any("/v1/v1/" in p for p in server.paths), server.paths


@pytest.mark.parametrize("stream", [False, True])
async def test_a_decode_servers_refusal_passes_through_with_its_body(backend, stream):
    url, _ = backend
    response = await post(RouterConfig((f"{url}/ok",), (f"{url}/refuse",)), stream=stream)
    assert response.status_code == 400
    assert response.json()["error"] == {"message": "max_tokens is too large", "param": "max_tokens"}


async def call(config: RouterConfig, method: str, path: str, **kw) -> httpx.Response:
    """One request of any shape to the router app."""
    app = create_router_app(config)
    await app.state.router.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            return await client.request(method, path, **kw)
    finally:
        await app.state.router.close()


@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("GET", "/version"), ("POST", "/tokenize"),
                                          ("POST", "/detokenize")])
async def test_requests_that_need_no_kv_go_to_a_decode_server_with_the_clients_key(backend, method, path):
    url, _ = backend
    body = {"model": "m", "prompt": "Once"} if method == "POST" else None
    response = await call(RouterConfig((f"{url}/prefill",), (f"{url}/decode",)), method, path, json=body,
                          headers={"authorization": "Bearer k1"})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["path"] == f"/decode{path}" and answer["auth"] == "Bearer k1"
    assert answer.get("body") == body


async def test_the_clients_request_id_reaches_both_servers(backend):
    url, server = backend
    server.request_ids.clear()
    response = await call(RouterConfig((f"{url}/prefill",), (f"{url}/decode",)), "POST", "/v1/completions",
                          json={"prompt": "Once", "max_tokens": 4}, headers={"X-Request-Id": "trace-42"})
    assert response.status_code == 200, response.text
    assert server.request_ids == [("/prefill/v1/completions", "trace-42"), ("/decode/v1/completions", "trace-42")]


async def test_a_decode_server_nobody_serves_makes_the_model_list_a_503():
    response = await call(RouterConfig(("http://127.0.0.1:1",), ("http://127.0.0.1:1",), connect_timeout_s=2),
                          "GET", "/v1/models")
    assert response.status_code == 503 and response.json()["error"]["code"] == "decode_unavailable"


@pytest.mark.parametrize("content, message, code", [
    (b"{bad", "malformed JSON in request body: Expecting property name enclosed in double quotes at character 1",
     "json_invalid"),
    (b"", "the request body is empty; send a JSON object", "invalid_body"),
    (b"\xff{}", "malformed JSON in request body: the body is not UTF-8 text (byte 0xff at 0)", "json_invalid"),
    (b"[1, 2]", "the request body must be a JSON object", "invalid_body")])
async def test_a_body_that_is_no_json_object_gets_the_servers_message(content, message, code):
    # Refused before any backend is asked (none listens at these URLs).
    response = await call(RouterConfig(("http://127.0.0.1:1",), ("http://127.0.0.1:1",)), "POST",
                          "/v1/completions", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == message and response.json()["error"]["code"] == code


@pytest.mark.parametrize("field, value", [("timeout_s", -1.0), ("connect_timeout_s", 0.0),
                                          ("health_timeout_s", float("nan"))])
def test_timeouts_that_would_fail_every_request_are_refused(field, value):
    with pytest.raises(ValueError, match="must be a positive number of seconds"):
        RouterConfig(("http://a",), ("http://b",), **{field: value})


class SlowStream:
    """A decode server's streamed response as _relay reads it: two events, then it would go on."""

    def __init__(self) -> None:
        self.closed = False

    async def aiter_raw(self):
        yield b'data: {"choices": [{"text": "a"}]}\n\n'
        yield b'data: {"choices": [{"text": "b"}]}\n\n'
        while True:                      # a long generation: the client leaves before it ends
            yield b'data: {"choices": [{"text": "c"}]}\n\n'

    async def aclose(self) -> None:
        self.closed = True


async def test_a_client_that_leaves_mid_stream_is_counted_apart_and_its_stream_closed():
    from minillm.router import CLIENT_CLOSED, RequestTiming, Router
    router = Router(RouterConfig(("http://127.0.0.1:1",), ("http://127.0.0.1:2",)))
    stream, timing = SlowStream(), RequestTiming()
    relay = router._relay("r1", "/v1/completions", stream, timing, 0.0, 0.0)
    assert b'"a"' in await relay.__anext__() and b'"b"' in await relay.__anext__()
    await relay.aclose()                 # what the server does when the client disconnects
    assert stream.closed and timing.status == CLIENT_CLOSED
    stats = router.stats.to_dict({})
    assert (stats["num_requests"], stats["num_failed"], stats["num_client_closed"]) == (1, 0, 1)
    # A stream served whole still counts as served.
    whole, timing = SlowStream(), RequestTiming()
    whole.aiter_raw = lambda: _two_events()
    assert len([chunk async for chunk in router._relay("r2", "/v1/completions", whole, timing, 0.0, 0.0)]) == 2
    assert timing.status == 200 and router.stats.to_dict({})["num_client_closed"] == 1


async def _two_events():
    yield b'data: {"choices": [{"text": "a"}]}\n\n'
    yield b'data: [DONE]\n\n'


@pytest.mark.parametrize("host, url", [("::1", "http://[::1]:8123"), ("127.0.0.1", "http://127.0.0.1:8123")])
def test_the_start_up_line_gives_a_url_that_can_be_called(monkeypatch, capsys, host, url):
    import minillm.router as router_module
    monkeypatch.setattr(router_module.uvicorn, "run", lambda *a, **kw: None)
    router_module.run_router(RouterConfig(("http://127.0.0.1:1",), ("http://127.0.0.1:1",)), host=host, port=8123)
    assert capsys.readouterr().err.startswith(f"minillm router: {url}, prefill ")


@pytest.mark.parametrize("path, body, reason", [
    ("/v1/completions", {"prompt": ["Once", "Tom"]}, "2 prompts"),
    ("/v1/completions", {"prompt": [[1, 2], [3]]}, "2 prompts"),
    ("/v1/completions", {"prompt": "Once", "n": 3}, "n = 3"),
    ("/v1/completions", {"prompt": "Once", "n": 1, "best_of": 2}, "n = 2"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n = 2"),
    ("/v1/responses", {"input": "hi"}, "the Responses API"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}, "the Messages API")])
async def test_a_request_one_lease_cannot_carry_goes_whole_to_a_decode_server(backend, path, body, reason):
    url, server = backend
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    server.paths.clear()
    config = RouterConfig((f"{url}/prefill",), (f"{url}/decode",))
    app = create_router_app(config)
    await app.state.router.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            logger = logging.getLogger("minillm.router")
            logger.addHandler(handler)
            level = logger.level
            logger.setLevel(logging.INFO)       # setLevel, not .level: it clears the logger's cached levels
            try:
                response = await client.post(path, json={"max_tokens": 4, **body})
            finally:
                logger.removeHandler(handler)
                logger.setLevel(level)
            stats = (await client.get("/v1/stats")).json()
    finally:
        await app.state.router.close()
    assert response.status_code == 200, response.text
    assert response.json()["kv_seen"] == {}                  # no lease was asked for or passed on
    assert server.paths == [f"/decode{path}"]
    assert stats["num_decode_only"] == 1 and stats["prefill_ms"]["mean"] is None
    assert len(lines) == 1 and f"decode only ({reason})" in lines[0], lines


@pytest.mark.parametrize("body", [{"prompt": ["Once"]}, {"prompt": [1, 2, 3]}, {"prompt": "Once", "n": 1},
                                  {"prompt": "Once", "n": "2"}, {"prompt": "Once", "n": True}])
async def test_one_prompt_and_one_completion_still_go_through_the_prefill_server(backend, body):
    url, server = backend
    server.paths.clear()
    response = await call(RouterConfig((f"{url}/prefill",), (f"{url}/decode",)), "POST", "/v1/completions",
                          json={"max_tokens": 4, **body})
    assert response.status_code == 200, response.text
    assert server.paths == ["/prefill/v1/completions", "/decode/v1/completions"]
    assert response.json()["kv_seen"] == KV
