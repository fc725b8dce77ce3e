"""`minillm router` as operators and clients use it: a client that leaves while its prompt is
prefilled, bodies that grow on the way to a server, backends on Unix sockets, a router that names
itself as its own backend, and the headers of a server's refusal."""
from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

import httpx
import openai
import pytest
import uvicorn
from pydantic import TypeAdapter
from test_abuse29_pd_router import BODY, Backend, prefill_backend, released
from test_abuse29b_cli import one_line
from test_abuse29b_cli_values import ROUTER
from test_cli import run_main
from test_server_helpers import openai_error, running_router, wait_for

from minillm.router import SLICE_ITEMS, RouterConfig, create_router_app, encode_body
from minillm.server.json_body import LARGE_BODY_BYTES


class LateBackend(Backend):
    """Backend whose prefill (path /late/...) answers only once the test says so, its lease made
    whether or not the router still reads the answer."""

    def do_POST(self) -> None:
        if not self.path.startswith("/late/"):
            return super().do_POST()
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        assert body["kv_transfer_params"] == {"do_remote_decode": True}
        self.server.prefill_seen.set()
        assert self.server.go.wait(30)
        lease = self.server.leases.create([3, 4], "hash", 5)
        try:
            self._send(200, {"choices": [{"text": "x"}], "kv_transfer_params": {
                "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": self.server.endpoint.port,
                "remote_lease_id": lease.lease_id, "remote_num_tokens": 5, "remote_prompt_hash": "hash"}})
        except OSError:
            pass          # the router closed the connection: nobody will read the lease's id


@pytest.fixture
def late_backend():
    with prefill_backend(LateBackend, prefill_seen=threading.Event(), go=threading.Event(),
                         taken=threading.Event(), closed=threading.Event()) as both:
        yield both


def test_a_client_that_leaves_during_the_prefill_has_its_lease_given_back(late_backend):
    # The router dropped the prefill request when its client left. A prefill server that had finished
    # it by then (its response on the way) held the prompt's blocks under a lease nobody could name,
    # for the whole lease (30 s): clients that time out under load filled the prefill server's pool.
    url, server = late_backend
    with running_router(RouterConfig((url + "/late",), (url,))) as router:
        data = json.dumps(BODY).encode()
        with socket.create_connection(("127.0.0.1", int(router.rsplit(":", 1)[1]))) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
                           b"content-length: %d\r\n\r\n%s" % (len(data), data))
            assert server.prefill_seen.wait(10)
        stats = lambda: httpx.get(f"{router}/v1/stats").json()     # noqa: E731
        assert wait_for(lambda: stats()["num_client_closed"] == 1, timeout=10), stats()
        server.go.set()
        assert wait_for(lambda: released(server) == 1, timeout=10), server.leases.snapshot()


class RecordingBackend(Backend):
    """A prefill and decode server in one that keeps every request body as it came."""

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers["content-length"]))
        self.server.bodies.append(raw)
        if json.loads(raw).get("kv_transfer_params", {}).get("do_remote_decode"):
            return self._send(200, {"choices": [{"text": "x"}], "kv_transfer_params": {"remote_lease_id": "l"}})
        self._send(200, {"choices": [{"text": "decoded"}]})


@pytest.fixture
def recording_backend():
    with prefill_backend(RecordingBackend, bodies=[]) as both:
        yield both


def compact(prompt) -> bytes:
    """A body with this prompt (and a NaN temperature) as a client may send it: compact, its text in UTF-8."""
    return json.dumps({**BODY, "prompt": prompt, "temperature": float("nan")}, ensure_ascii=False,
                      separators=(",", ":")).encode()


@pytest.mark.parametrize("prompt,sent", [
    (list(range(20000)), compact(list(range(20000)))),
    ("故事" * 20000, compact("故事" * 20000)),
    ("a\ud800b", b'{"model":"m","prompt":"a\\ud800b","max_tokens":4,"temperature":NaN}'),
], ids=["token-ids", "cjk", "lone-surrogate"])
def test_a_body_reaches_the_servers_no_larger_than_the_client_sent_it(recording_backend, prompt, sent):
    # json.dumps's defaults wrote ", " between items and each character past ASCII as \\uXXXX: a
    # client's 12 MB of token ids or 11 MB of Chinese text (within the servers' 16 MiB) reached them
    # past it, and the client got their 413 instead of the 400 naming prompt that a server gives.
    url, server = recording_backend
    with running_router(RouterConfig((url,), (url,))) as router:
        r = httpx.post(f"{router}/v1/completions", content=sent, headers={"content-type": "application/json"},
                       timeout=30)
        assert r.json()["choices"][0]["text"] == "decoded"
    assert len(server.bodies) == 2           # the prefill request, then the decode request
    for body in server.bodies:
        assert len(body) <= len(sent) + 100, (len(body), len(sent))     # + the fields the router writes
        forwarded = json.loads(body)
        assert forwarded["prompt"] == prompt and forwarded["temperature"] != forwarded["temperature"]   # NaN


class SocketBackend(BaseHTTPRequestHandler):
    """A prefill and decode server in one on a Unix socket (serve --uds): health, the model list,
    a lease's params for a prefill request and a text for a decode request."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._send({"status": "ok"} if self.path == "/health" else {"object": "list", "data": [{"id": "m"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if body["kv_transfer_params"].get("do_remote_decode"):
            return self._send({"choices": [{"text": "x"}], "kv_transfer_params": {"remote_lease_id": "l"}})
        self._send({"choices": [{"text": "decoded"}], "kv_seen": body["kv_transfer_params"]})

    def _send(self, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_servers_on_unix_sockets_are_reached(tmp_path):
    # minillm router took --prefill unix:PATH and --decode unix:PATH (serve --uds PATH's URL, which chat
    # and monitor reach), then answered every request with a 502 (httpx: UnsupportedProtocol) and
    # /health with 503.
    path = str(tmp_path / "server.sock")
    server = socketserver.ThreadingUnixStreamServer(path, SocketBackend)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with running_router(RouterConfig((f"unix:{path}",), (f"unix:{path}",))) as router:
            for stream in (False, True):
                r = httpx.post(f"{router}/v1/completions", json={**BODY, "stream": stream}, timeout=30)
                assert r.status_code == 200, r.text
                assert r.content.count(b'"kv_seen": {"remote_lease_id": "l"}') == 1, r.text
            health = httpx.get(f"{router}/health", timeout=30)
            assert health.status_code == 200 and health.json()["decode"][0]["url"] == f"unix:{path}", health.text
            assert httpx.get(f"{router}/v1/models", timeout=30).json()["data"][0]["id"] == "m"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def router_on(sock: socket.socket, config: RouterConfig):
    """The base URL of a router app for config served by uvicorn on a thread, on sock (already bound)."""
    server = uvicorn.Server(uvicorn.Config(create_router_app(config), log_level="warning", access_log=False,
                                           log_config=None))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert wait_for(lambda: server.started, timeout=30)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture
def backend():
    with prefill_backend(Backend, taken=threading.Event(), closed=threading.Event()) as both:
        yield both


@pytest.mark.parametrize("through", ["itself", "a second router"])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_router_whose_server_url_leads_back_to_it_answers_508_not_a_loop(backend, role, through):
    # Each request went to the router again, which sent it on again, until its sockets ran out (2690
    # open after 20 s): the client waited for ever, and /health and /v1/models went round too.
    url, _ = backend
    with socket.socket() as sock, socket.socket() as other:
        sock.bind(("127.0.0.1", 0))
        other.bind(("127.0.0.1", 0))
        own, peer = (f"http://127.0.0.1:{s.getsockname()[1]}" for s in (sock, other))
        target = own if through == "itself" else peer      # a second router sends back to the first
        servers = {"prefill": (target,), "decode": (url,)} if role == "prefill" else \
            {"prefill": (url,), "decode": (target,)}
        with router_on(sock, RouterConfig(servers["prefill"], servers["decode"], timeout_s=30)) as router, \
                (router_on(other, RouterConfig((own,), (own,), timeout_s=30)) if target == peer
                 else contextlib.nullcontext()):
            for path in ("/v1/completions", "/v1/chat/completions"):
                r = httpx.post(router + path, json={**BODY, "messages": [{"role": "user", "content": "hi"}]},
                               timeout=30)
                assert "a --prefill or --decode URL" in openai_error(r, 508, code="loop_detected")["message"]
            health = httpx.get(f"{router}/health", timeout=30)
            assert health.status_code == 503, health.text
            # The second router's /health: the first is its server, which it found looped.
            status = 508 if through == "itself" else 503
            assert {"url": target, "ok": False, "status": status} in health.json()[role], health.text
            if role == "decode":
                openai_error(httpx.get(f"{router}/v1/models", timeout=30), 508, code="loop_detected")


class KeyedBackend(BaseHTTPRequestHandler):
    """A prefill and decode server in one that wants the key "k" (a 401 naming its scheme, as a server's
    --api-key does) and names each response with vLLM's X-Request-Id (--enable-request-id-headers)."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._answer({"object": "list", "data": [{"id": "m"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            return self._answer({"choices": [{"text": "x"}], "kv_transfer_params": {"remote_lease_id": "l"}})
        self._answer({"choices": [{"text": "decoded"}]})

    def _answer(self, payload: dict) -> None:
        if self.headers.get("authorization") != "Bearer k":
            status, payload = 401, {"error": {"message": "Invalid or missing API key", "type": "authentication_error",
                                              "param": None, "code": "invalid_api_key"}}
        else:
            status = 200
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.send_header("x-request-id", self.headers.get("x-request-id") or "server-id")
        if status == 401:
            self.send_header("www-authenticate", "Bearer")
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def keyed_backend():
    server = ThreadingHTTPServer(("127.0.0.1", 0), KeyedBackend)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("key", [None, "k"])
def test_a_servers_401_and_request_id_reach_the_client(keyed_backend, key):
    # The router passed a server's 401 on without its WWW-Authenticate (which a 401 must carry), and
    # every answer without the X-Request-Id a server started with --enable-request-id-headers gives.
    headers = {"x-request-id": "req-7"} | ({"authorization": f"Bearer {key}"} if key else {})
    with running_router(RouterConfig((keyed_backend,), (keyed_backend,))) as router:
        for stream in (False, True):
            r = httpx.post(f"{router}/v1/completions", json={**BODY, "stream": stream}, headers=headers, timeout=30)
            assert (r.status_code, r.headers["x-request-id"]) == (200 if key else 401, "req-7"), r.text
            assert r.headers.get("www-authenticate") == (None if key else "Bearer")
        models = httpx.get(f"{router}/v1/models", headers=headers, timeout=30)
        assert (models.status_code, models.headers["x-request-id"]) == (200 if key else 401, "req-7")
        assert models.headers.get("www-authenticate") == (None if key else "Bearer")


def test_a_router_with_api_keys_refuses_requests_without_one_before_any_server(backend):
    # minillm router took no --api-key: a router in front of servers without keys answered anyone, its
    # /v1/stats too. As serve's, the key guards /v1 (Authorization, or x-api-key on the Messages API)
    # and /health stays open; the client's key goes on to the servers.
    url, server = backend
    with running_router(RouterConfig((url,), (url,), api_keys=("k1", "k2"))) as router:
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages"):
            r = httpx.post(router + path, json=BODY, headers={"authorization": "Bearer k3"}, timeout=30)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
        assert httpx.get(f"{router}/v1/stats", timeout=30).status_code == 401
        assert httpx.get(f"{router}/v1/models", timeout=30).status_code == 401
        assert server.leases.snapshot().num_created == 0         # no server saw a request
        assert httpx.get(f"{router}/health", timeout=30).status_code == 200
        for headers in ({"authorization": "Bearer k2"}, {"x-api-key": "k1"}):
            r = httpx.post(f"{router}/v1/completions", json=BODY, headers=headers, timeout=30)
            assert r.json()["choices"][0]["text"] == "decoded"
        assert httpx.get(f"{router}/v1/stats", headers={"authorization": "Bearer k1"}, timeout=30).json()[
            "num_requests"] == 2


@pytest.mark.parametrize("keys", [["--api-key", "k1", "k2"], ["--api-key", "k1", "--api-key", "k2"]])
def test_router_takes_api_keys_as_serve_does_and_refuses_a_blank_one(capsys, monkeypatch, keys):
    import minillm.router as router_module
    configs = []
    monkeypatch.setattr(router_module, "run_router", lambda config, host, port: configs.append(config))
    status, _, _ = run_main(capsys, *ROUTER, *keys)
    assert status == 0 and configs[0].api_keys == ("k1", "k2")
    status, out, err = run_main(capsys, *ROUTER, "--api-key", " ")
    assert (status, out) == (2, "")
    assert "Invalid value for '--api-key': an API key must not be empty" in one_line(err)


class PathBackend(BaseHTTPRequestHandler):
    """A decode server whose every GET answers with the path (and query) it was sent."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        data = json.dumps({"id": unquote(self.path.removeprefix("/v1/models/")), "object": "model", "created": 0,
                           "owned_by": "minillm", "path": self.path}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)

    do_HEAD = do_GET


def test_a_servers_routes_that_need_no_kv_are_reached_with_their_path_and_methods():
    # GET /v1/models/{model} (the OpenAI client's models.retrieve, and a served name such as
    # Org/model holds a slash) and GET /v1/responses/{id} were the router's 404 Not Found, and a
    # HEAD of /v1/models or /version its 405, where a server answers them.
    server = ThreadingHTTPServer(("127.0.0.1", 0), PathBackend)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with running_router(RouterConfig((url,), (url,))) as router:
            client = openai.OpenAI(base_url=f"{router}/v1", api_key="k", max_retries=0)
            assert client.models.retrieve("Org/model").id == "Org/model"
            for path in ("/v1/responses/resp_1?include=x", "/v1/models/a%2Fb"):
                assert httpx.get(router + path, timeout=30).json()["path"] == path
            for path in ("/v1/models", "/version"):
                assert httpx.head(router + path, timeout=30).status_code == 200
            r = httpx.get(f"{router}/v1/models/", timeout=30)
            assert (r.status_code, r.headers["location"]) == (307, f"{router}/v1/models")
    finally:
        server.shutdown()
        server.server_close()


class StreamingBackend(Backend):
    """Backend whose decode answer streams where a server would: "stream" read as pydantic reads a
    boolean ("false", "0", "no" are false)."""

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers["content-length"]))
        body = json.loads(raw)
        if body["kv_transfer_params"].get("do_remote_decode"):
            return self._send(200, {"choices": [{"text": "x"}], "kv_transfer_params": {"remote_lease_id": "l"}})
        if TypeAdapter(bool).validate_python(body.get("stream") or False):
            data = b'data: {"choices": [{"text": "decoded"}]}\n\ndata: [DONE]\n\n'
            self.send_response(200)
            self.send_header("content-type", "text/event-stream; charset=utf-8")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            return self.wfile.write(data)
        self._send(200, {"choices": [{"text": "decoded"}]})


@pytest.mark.parametrize("stream, is_streamed", [("false", False), ("no", False), ("true", True), (1, True)])
def test_an_answer_is_relayed_as_the_server_gave_it_whatever_stream_says(stream, is_streamed):
    # The router chose by Python's truth: "stream": "false", which a server reads as false (its JSON
    # answer), came back labelled text/event-stream, and a client reading it as JSON by that label failed.
    with prefill_backend(StreamingBackend) as (url, _), running_router(RouterConfig((url,), (url,))) as router:
        r = httpx.post(f"{router}/v1/completions", json={**BODY, "stream": stream}, timeout=30)
        assert r.headers["content-type"].startswith("text/event-stream" if is_streamed else "application/json")
        assert (r.text.startswith("data: ") if is_streamed else r.json()["choices"][0]["text"] == "decoded"), r.text


@pytest.mark.parametrize("field, value", [("n", "2"), ("n", 2.0), ("best_of", "2")])
def test_n_as_a_server_reads_it_sends_the_request_whole_to_a_decode_server(recording_backend, field, value):
    # "n": "2" is n = 2 to a server (pydantic's lax integer), 1 to the router, which sent it with a
    # lease's kv_transfer_params to a decode server: its 400 "n: a request with kv_transfer_params
    # takes n = 1 only", about a field the client never sent, where a single server answers.
    url, server = recording_backend
    with running_router(RouterConfig((url,), (url,))) as router:
        r = httpx.post(f"{router}/v1/completions", json={**BODY, field: value}, timeout=30)
        assert r.json()["choices"][0]["text"] == "decoded"
        assert httpx.get(f"{router}/v1/stats", timeout=30).json()["num_decode_only"] == 1
    assert [json.loads(body).get("kv_transfer_params") for body in server.bodies] == [None]


def test_a_body_encoded_in_slices_is_the_body_encoded_whole():
    bodies = [{"prompt": list(range(3 * SLICE_ITEMS + 5)), "max_tokens": 3, "t": float("nan"), "x": float("-inf")},
              {"prompt": [list(range(SLICE_ITEMS + 1)), [], [[1, [2, {"k": [3] * SLICE_ITEMS}]]]], "e": {}},
              {"messages": [{"role": "user", "content": "故事"}] * (SLICE_ITEMS + 1), "f": 1e-7, "n": None},
              {"prompt": "a\ud800b", "stop": ["x\ud800"] * (SLICE_ITEMS + 1), "b": True}]
    for body in bodies:
        assert encode_body(body, in_slices=True) == encode_body(body)
        assert json.loads(encode_body(body, in_slices=True)).keys() == body.keys()


def test_a_large_body_is_encoded_for_the_servers_off_the_routers_event_loop(backend, monkeypatch):
    # The router wrote each body for the prefill and the decode server with one json.dumps on its event
    # loop: 3 million token ids (a 6 MB body) held every other stream and /health for 0.6 s, twice.
    import asyncio

    import minillm.router as router_module
    url, _ = backend
    entered, released = threading.Event(), threading.Event()
    encode = router_module.encode_body

    def held(body, *args, **kwargs):
        if len(body.get("user", "")) > LARGE_BODY_BYTES:
            entered.set()
            assert released.wait(10), "the event loop was held: /v1/stats never answered"
        return encode(body, *args, **kwargs)
    monkeypatch.setattr(router_module, "encode_body", held)

    async def scenario():
        app = create_router_app(RouterConfig((f"{url}/ok",), (f"{url}/ok",)))
        await app.state.router.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
                large = asyncio.ensure_future(client.post("/v1/completions", json={
                    **BODY, "user": "x" * (LARGE_BODY_BYTES + 1)}, timeout=30))
                try:
                    assert await asyncio.to_thread(entered.wait, 30)
                    assert (await client.get("/v1/stats")).status_code == 200
                finally:
                    released.set()
                return await large
        finally:
            await app.state.router.close()
    response = asyncio.run(scenario())
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "decoded", response.text
