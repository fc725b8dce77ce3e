"""`minillm router` against fake backends and a real lease table: what becomes of a prompt's lease
when no decode server takes it, a client that leaves a non-streamed request, a prefill server that
takes no part in KV transfers, and backend URLs that carry a password."""
from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from test_server_helpers import openai_error, running_router, wait_for

from minillm.kv_connector.endpoint import TransferEndpoint
from minillm.kv_connector.lease import LeaseTable
from minillm.router import RouterConfig

BODY = {"model": "m", "prompt": "Once", "max_tokens": 4}


class Backend(BaseHTTPRequestHandler):
    """A prefill server (leases from a real LeaseTable, served by a real transfer endpoint) and a
    decode server in one; the path's first segment picks how it answers: ok, refuse (a 400),
    hang (the decode server takes the request and answers only when its connection closes) or
    norole (a server started without --kv-role)."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._send(200, {"status": "ok"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        mode = self.path.split("/")[1]
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode"):
            if mode == "norole":
                return self._send(400, {"error": {
                    "message": "kv_transfer_params: this server takes no part in KV transfers (start it with "
                               "--kv-role producer or consumer)", "type": "invalid_request_error",
                    "param": "kv_transfer_params", "code": None}})
            lease = self.server.leases.create([3, 4], "hash", 5)
            return self._send(200, {"choices": [{"text": "x"}], "kv_transfer_params": {
                "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": self.server.endpoint.port,
                "remote_lease_id": lease.lease_id, "remote_num_tokens": 5, "remote_prompt_hash": "hash"}})
        if mode == "refuse":
            return self._send(400, {"error": {"message": "min_tokens must not exceed max_tokens", "type":
                                              "invalid_request_error", "param": "min_tokens", "code": None}})
        if mode == "hang":
            self.server.taken.set()
            self.connection.settimeout(30)
            self.server.closed.set() if self.connection.recv(1) == b"" else None
            return
        self._send(200, {"choices": [{"text": "decoded"}]})

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextlib.contextmanager
def prefill_backend(handler, **attributes):
    """(URL, server) of a fake prefill server: handler over HTTP, a lease table and a transfer endpoint."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    server.leases = LeaseTable(30.0)
    server.endpoint = TransferEndpoint("127.0.0.1", 0, "engine", server.leases, {})
    for name, value in attributes.items():
        setattr(server, name, value)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server
    finally:
        server.shutdown()
        server.server_close()
        server.endpoint.close()


@pytest.fixture
def backend():
    with prefill_backend(Backend, taken=threading.Event(), closed=threading.Event()) as both:
        yield both


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def released(server) -> int:
    return server.leases.snapshot().num_released


@pytest.mark.parametrize("stream", [False, True])
def test_a_lease_the_decode_server_refused_goes_back_to_the_prefill_server(backend, stream):
    # The prefill server leased the prompt's blocks, the decode server refused the request (a field
    # only it reads: min_tokens, which the prefill request leaves out, or a max_tokens past the
    # context): the blocks stayed held for the whole lease (30 s by default), so a burst of such
    # requests filled the prefill server's pool.
    url, server = backend
    with running_router(RouterConfig((url,), (url + "/refuse",))) as router:
        r = httpx.post(f"{router}/v1/completions", json={**BODY, "stream": stream}, timeout=30)
        assert openai_error(r, 400, "min_tokens")["message"].startswith("min_tokens")
        assert wait_for(lambda: released(server) == 1, timeout=10), server.leases.snapshot()
    # A request a decode server serves leaves its lease to that server (which releases it once it has
    # copied the blocks).
    with running_router(RouterConfig((url,), (url,))) as router:
        r = httpx.post(f"{router}/v1/completions", json={**BODY, "stream": stream}, timeout=30)
        assert r.json()["choices"][0]["text"] == "decoded"
    assert server.leases.snapshot().num_created == 2 and released(server) == 1


def test_a_lease_no_decode_server_could_take_goes_back_to_the_prefill_server(backend):
    url, server = backend
    with running_router(RouterConfig((url,), (f"http://127.0.0.1:{free_port()}",))) as router:
        r = httpx.post(f"{router}/v1/completions", json=BODY, timeout=30)
        openai_error(r, 503, code="decode_unavailable")
        assert wait_for(lambda: released(server) == 1, timeout=10), server.leases.snapshot()


def test_a_client_that_leaves_a_request_not_streamed_cancels_it_on_the_decode_server(backend):
    # The router went on waiting for the whole answer (a server aborts such a request when its client
    # hangs up): the decode server generated every token for nobody, the router counted it served.
    url, server = backend
    with running_router(RouterConfig((url,), (url + "/hang",))) as router:
        port = int(router.rsplit(":", 1)[1])
        data = json.dumps(BODY).encode()
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
                           b"content-length: %d\r\n\r\n%s" % (len(data), data))
            assert server.taken.wait(10)
        assert server.closed.wait(10), "the decode server's request was not closed"
        stats = lambda: httpx.get(f"{router}/v1/stats").json()     # noqa: E731
        assert wait_for(lambda: stats()["num_client_closed"] == 1, timeout=10), stats()
        assert stats()["num_failed"] == 0


def test_a_prefill_server_that_takes_no_part_in_kv_transfers_is_a_502_not_the_clients_400(backend):
    # Its 400 named kv_transfer_params, a field the client never sent (the router writes it).
    url, _ = backend
    with running_router(RouterConfig((url + "/norole",), (url,))) as router:
        r = httpx.post(f"{router}/v1/completions", json=BODY, timeout=30)
        error = openai_error(r, 502, code="prefill_server_failed")
        assert "/norole" in error["message"] and "takes no part in KV transfers" in error["message"]


def test_a_password_in_a_backend_url_is_never_shown(backend, caplog):
    # /health and /v1/stats (which need no key), error messages and the log printed it.
    url, _ = backend
    secret = url.replace("http://", "http://user:s3cret@")
    nobody = f"http://user:s3cret@127.0.0.1:{free_port()}"
    caplog.set_level(logging.INFO, logger="minillm.router")
    with running_router(RouterConfig((secret,), (secret, nobody))) as router:
        shown = [httpx.get(f"{router}/health").text, httpx.get(f"{router}/v1/stats").text]
        for _ in range(2):         # one decode server refuses the connection: its error names it
            shown.append(httpx.post(f"{router}/v1/completions", json=BODY, timeout=30).text)
        with running_router(RouterConfig((nobody,), (nobody,))) as down:
            shown.append(httpx.post(f"{down}/v1/completions", json=BODY, timeout=30).text)
            shown.append(httpx.get(f"{down}/v1/models", timeout=30).text)
    shown.append(caplog.text)
    assert all("user:***@127.0.0.1" in text for text in shown[:2]), shown[:2]
    assert not any("s3cret" in text for text in shown), shown
