"""The router against small fake backends in-process: URLs as people give them, refusals passed
through with their body, bad timeouts refused up front, and the router's own errors (no server
reachable, a decode server that fails, before or after its stream began) in the shape of the route's
API, as its clients read them."""
from __future__ import annotations

import contextlib
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import httpx2
import openai
import pytest

from minillm.router import RelayedEvents, RouterConfig, create_router_app
from minillm.server.errors import APIError

anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.anyio

KV = {"remote_lease_id": "lease-1", "remote_host": "127.0.0.1", "remote_port": 1}


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _responses_event(kind: str, number: int, **fields) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': number, **fields})}\n\n".encode()


RESPONSE = {"id": "resp_1", "object": "response", "created_at": 1, "status": "in_progress", "model": "m",
            "output": [], "error": None, "usage": None}
ITEM = {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
        "content": [{"type": "output_text", "text": "Once", "annotations": []}]}
MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "m", "stop_reason": None,
           "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 0}}
# What a decode server streams of each route before it fails (the connection drops mid-body).
CUT_STREAMS = {
    "/v1/chat/completions": b'data: {"choices": [{"index": 0, "delta": {"content": "Once"}}]}\n\n',
    "/v1/messages": b"event: message_start\ndata: " + json.dumps({"type": "message_start", "message": MESSAGE}).encode()
                    + b"\n\n",
    "/v1/responses": b"".join([
        _responses_event("response.created", 0, response=RESPONSE),
        _responses_event("response.in_progress", 1, response=RESPONSE),
        _responses_event("response.output_item.added", 2, output_index=0, item={**ITEM, "status": "in_progress"}),
        _responses_event("response.output_text.delta", 3, item_id="msg_1", output_index=0, content_index=0,
                         delta="Once"),
        _responses_event("response.output_item.done", 4, output_index=0, item=ITEM),
        _responses_event("response.output_item.added", 5, output_index=1, item={**ITEM, "id": "msg_2"})]),
}


class FakeBackend(BaseHTTPRequestHandler):
    """A prefill and decode server in one: the first path segment picks ok, refuse or broken (a decode
    server whose connection drops in the middle of its answer)."""

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
        if self.path.startswith("/broken/"):
            if body.get("stream"):
                return self._send_cut(CUT_STREAMS[self.path.removeprefix("/broken")], "text/event-stream")
            return self._send_cut(b'{"choices": [', "application/json")
        self._send(200, {"choices": [{"text": "decoded"}], "kv_seen": kv})

    def _send_cut(self, data: bytes, content_type: str) -> None:
        """A 200 whose body stops short of its length: the connection closes after data."""
        self.send_response(200)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(data) + 1000))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()
        self.close_connection = True

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
    relay = router._relay("r1", RelayedEvents("/v1/completions"), stream, timing, 0.0, 0.0)
    assert b'"a"' in await relay.__anext__() and b'"b"' in await relay.__anext__()
    await relay.aclose()                 # what the server does when the client disconnects
    assert stream.closed and timing.status == CLIENT_CLOSED
    stats = router.stats.to_dict({})
    assert (stats["num_requests"], stats["num_failed"], stats["num_client_closed"]) == (1, 0, 1)
    # A stream served whole still counts as served.
    whole, timing = SlowStream(), RequestTiming()
    whole.aiter_raw = lambda: _two_events()
    chunks = [chunk async for chunk in router._relay("r2", RelayedEvents("/v1/completions"), whole, timing, 0.0, 0.0)]
    assert len(chunks) == 2
    assert timing.status == 200 and router.stats.to_dict({})["num_client_closed"] == 1


async def _two_events():
    yield b'data: {"choices": [{"text": "a"}]}\n\n'
    yield b'data: [DONE]\n\n'


@pytest.mark.parametrize("host, url", [("::1", "http://[::1]:8123"), ("127.0.0.1", "http://127.0.0.1:8123")])
def test_the_start_up_line_gives_a_url_that_can_be_called(monkeypatch, capsys, host, url):
    import minillm.router as router_module
    monkeypatch.setattr(router_module.uvicorn.Server, "run", lambda *a, **kw: None)
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
                                  {"prompt": "Once", "n": "1"}, {"prompt": "Once", "n": True}])
async def test_one_prompt_and_one_completion_still_go_through_the_prefill_server(backend, body):
    url, server = backend
    server.paths.clear()
    response = await call(RouterConfig((f"{url}/prefill",), (f"{url}/decode",)), "POST", "/v1/completions",
                          json={"max_tokens": 4, **body})
    assert response.status_code == 200, response.text
    assert server.paths == ["/prefill/v1/completions", "/decode/v1/completions"]
    assert response.json()["kv_seen"] == KV


# ---- the router's own errors, in the shape of the route's API ----------------------------------------

NOBODY = RouterConfig(("http://127.0.0.1:1",), ("http://127.0.0.1:1",), connect_timeout_s=2)
USER = {"role": "user", "content": "hi"}
REQUESTS = {"/v1/chat/completions": {"model": "m", "messages": [USER], "max_tokens": 4},
            "/v1/messages": {"model": "m", "messages": [USER], "max_tokens": 4},
            "/v1/messages/count_tokens": {"model": "m", "messages": [USER]},
            "/v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 4}}


def error_of(response: httpx.Response, path: str) -> dict:
    """The error object of a response, checked to be in the shape of path's API."""
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body) == {"type", "error"}, body
    else:
        assert set(body) == {"error"}, body
    return body["error"]


@pytest.mark.parametrize("path, kind", [
    ("/v1/chat/completions", "server_error"), ("/v1/responses", "server_error"),
    ("/v1/messages", "overloaded_error"), ("/v1/messages/count_tokens", "overloaded_error")])
async def test_no_server_reachable_is_a_503_in_the_routes_shape(path, kind):
    response = await call(NOBODY, "POST", path, json=REQUESTS[path])
    assert response.status_code == 503
    error = error_of(response, path)
    assert error["type"] == kind and error["code"] in ("prefill_unavailable", "decode_unavailable"), error
    assert "no" in error["message"] and "server is reachable" in error["message"]


@pytest.mark.parametrize("content, message", [
    (b"", "the request body is empty; send a JSON object"),
    (b"{bad", "malformed JSON in request body: Expecting property name enclosed in double quotes at character 1"),
    (b"[1, 2]", "the request body must be a JSON object")])
async def test_a_messages_body_that_is_no_json_object_is_anthropics_400(content, message):
    response = await call(NOBODY, "POST", "/v1/messages", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = error_of(response, "/v1/messages")
    assert error["type"] == "invalid_request_error" and error["message"] == message


@pytest.mark.parametrize("path, kind", [("/v1/completions", "server_error"), ("/v1/messages", "api_error")])
async def test_a_decode_server_that_fails_mid_answer_is_a_502_in_the_routes_shape(backend, path, kind):
    url, _ = backend
    body = {"prompt": "Once", "max_tokens": 4} if path == "/v1/completions" else REQUESTS[path]
    response = await call(RouterConfig((f"{url}/ok",), (f"{url}/broken",)), "POST", path, json=body)
    assert response.status_code == 502
    error = error_of(response, path)
    assert error["type"] == kind and error["code"] == "decode_server_failed"


@contextlib.asynccontextmanager
async def routed(config: RouterConfig):
    """An httpx2 client of the router app, as OpenAI's and Anthropic's clients take one."""
    app = create_router_app(config)
    await app.state.router.start()
    try:
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://router") as client:
            yield client
    finally:
        await app.state.router.close()


async def test_a_chat_stream_cut_mid_way_ends_with_openais_error_and_done(backend):
    url, _ = backend
    async with routed(RouterConfig((f"{url}/ok",), (f"{url}/broken",))) as client:
        response = await client.post("/v1/chat/completions", json={**REQUESTS["/v1/chat/completions"],
                                                                   "stream": True})
    lines = [line for line in response.text.splitlines() if line]
    assert lines[0] == CUT_STREAMS["/v1/chat/completions"].decode().strip() and lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "decode_server_failed" and "failed mid-stream" in error["message"]


async def test_a_messages_stream_cut_mid_way_ends_with_anthropics_error_event(backend):
    # It ended with OpenAI's data-only error and [DONE], which the anthropic client skips: the reply
    # just stopped short, without message_stop and without an error.
    url, _ = backend
    kinds = []
    async with routed(RouterConfig((f"{url}/ok",), (f"{url}/broken",))) as http:
        client = anthropic.AsyncAnthropic(base_url="http://router", api_key="none", max_retries=0, http_client=http)
        with pytest.raises(anthropic.APIStatusError) as caught:
            async for event in await client.messages.create(stream=True, **REQUESTS["/v1/messages"]):
                kinds.append(event.type)
    assert kinds == ["message_start"]
    error = caught.value.body
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert error["error"]["code"] == "decode_server_failed" and "failed mid-stream" in error["error"]["message"]


async def test_a_responses_stream_cut_mid_way_ends_with_response_failed(backend):
    url, _ = backend
    async with routed(RouterConfig((f"{url}/ok",), (f"{url}/broken",))) as http:
        client = openai.AsyncOpenAI(base_url="http://router/v1", api_key="none", max_retries=0, http_client=http)
        events = [event async for event in await client.responses.create(stream=True, **REQUESTS["/v1/responses"])]
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                        "response.output_text.delta", "response.output_item.done",
                                        "response.output_item.added", "response.failed"]
    assert [e.sequence_number for e in events] == list(range(7))
    failed = events[-1].response.model_dump(exclude_unset=True)
    assert failed == {**RESPONSE, "status": "failed", "output": [ITEM], "error": {
        "code": "server_error", "message": failed["error"]["message"]}}
    assert "the decode server" in failed["error"]["message"] and "failed mid-stream" in failed["error"]["message"]


def test_a_responses_stream_that_failed_before_its_first_event_still_ends_with_response_failed():
    relayed = RelayedEvents("/v1/responses", "m")
    lines = relayed.failure_events(APIError(502, "the decode server failed mid-stream")).decode().splitlines()
    assert lines[0] == "event: response.failed"
    event = json.loads(lines[1].removeprefix("data: "))
    assert (event["type"], event["sequence_number"]) == ("response.failed", 0)
    response = event["response"]
    assert response["id"].startswith("resp_") and (response["model"], response["output"]) == ("m", [])
    assert response["status"] == "failed" and response["error"] == {
        "code": "server_error", "message": "the decode server failed mid-stream"}


async def test_a_large_body_is_parsed_off_the_routers_event_loop(backend, monkeypatch):
    # The router parsed every body with the JSON scanner on its event loop (10 MB: 0.1-0.2 s of no other
    # request). A large one now goes to a worker thread: held there, the router still answers /health.
    import asyncio
    from minillm.server import json_body
    url, _ = backend
    entered, released = threading.Event(), threading.Event()
    loads = json_body.loads_yielding

    def held(body):
        entered.set()
        assert released.wait(60), "never released"
        return loads(body)
    monkeypatch.setattr(json_body, "loads_yielding", held)
    app = create_router_app(RouterConfig((f"{url}/ok",), (f"{url}/ok",)))
    await app.state.router.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            body = {"prompt": "Once", "max_tokens": 4, "user": "x" * (json_body.LARGE_BODY_BYTES + 1)}
            large = asyncio.ensure_future(client.post("/v1/completions", json=body))
            try:
                assert await asyncio.to_thread(entered.wait, 60), "the large body was never parsed on a thread"
                assert (await client.get("/health")).status_code == 200
            finally:
                released.set()
            response = await large
            small = await client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4})
    finally:
        await app.state.router.close()
    assert response.status_code == small.status_code == 200, response.text
    assert response.json()["kv_seen"] == small.json()["kv_seen"] == KV
