"""`minillm router` in front of servers that misbehave: JSON nested past Python's stack in a prefill
answer, a refusal or the KV transfer header, a transfer header of 1e999 tokens, and an event longer
than the router holds (a long prompt's prompt_logprobs, or a stream with no blank line at all)."""
from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from minillm.router import MAX_HELD_EVENT_BYTES, RelayedEvents, RequestTiming, Router, RouterConfig, create_router_app

pytestmark = pytest.mark.anyio

DEEP = b"[" * 5000 + b"]" * 5000        # JSON that json.loads leaves as a RecursionError
LEASE = {"remote_lease_id": "lease-1", "remote_host": "127.0.0.1", "remote_port": 1}


@pytest.fixture
def anyio_backend():
    return "asyncio"


class OddBackend(BaseHTTPRequestHandler):
    """A prefill and decode server in one; the first path segment picks what is odd about it."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._send(200, b"{}")

    def do_POST(self) -> None:
        mode = self.path.split("/")[1]
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            if mode in ("deep-prefill", "deep-kv"):
                return self._send(200, DEEP if mode == "deep-prefill" else b'{"kv_transfer_params": ' + DEEP + b"}")
            return self._send(200, json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": LEASE}).encode())
        if mode == "deep-refusal":
            return self._send(400, DEEP)
        header = {"infinite-header": '{"tokens": 1e999, "claim_ms": 1}', "huge-header": '{"claim_ms": 1' + "0" * 400 + "}",
                  "deep-header": "[" * 3000}.get(mode)
        self._send(200, b'{"choices": [{"text": "decoded"}]}', header)

    def _send(self, status: int, data: bytes, kv_header: str | None = None) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        if kv_header is not None:
            self.send_header("x-minillm-kv-transfer", kv_header)
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def backend():
    server = ThreadingHTTPServer(("127.0.0.1", 0), OddBackend)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


async def complete(url: str, mode: str) -> httpx.Response:
    app = create_router_app(RouterConfig((f"{url}/{mode}",), (f"{url}/{mode}",)))
    await app.state.router.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            return await client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 4})
    finally:
        await app.state.router.close()


@pytest.mark.parametrize("mode", ["deep-prefill", "deep-kv"])
async def test_a_prefill_answer_nested_past_the_stack_is_a_502_naming_the_server(backend, mode):
    # json.loads let a RecursionError out: the client got a 500 "maximum recursion depth exceeded".
    response = await complete(backend, mode)
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == "prefill_server_failed" and "returned no kv_transfer_params" in error["message"]


async def test_a_decode_refusal_nested_past_the_stack_is_passed_on_as_it_came(backend):
    response = await complete(backend, "deep-refusal")
    assert (response.status_code, response.content) == (400, DEEP)


@pytest.mark.parametrize("mode", ["infinite-header", "huge-header", "deep-header"])
async def test_a_kv_transfer_header_no_server_writes_leaves_the_answer_alone(backend, mode):
    # 1e999 tokens was int(inf), whose OverflowError the client got as its own 400; a claim of 10**400
    # ms overflowed a float too, and JSON nested past the stack was a 500.
    response = await complete(backend, mode)
    assert response.status_code == 200, response.text
    assert response.json() == {"choices": [{"text": "decoded"}]}


def test_a_responses_event_nested_past_the_stack_is_relayed_without_its_details():
    relayed = RelayedEvents("/v1/responses")
    relayed.note(b"event: response.created\ndata: " + DEEP + b"\n\nevent: response.output_item.done\ndata: "
                 + DEEP + b"\n\n")
    assert (relayed.num_events, relayed.response, relayed.items) == (2, None, [])


class EndlessEvent:
    """A decode server's stream: an event of num_bytes in 64 KB chunks, then [DONE], then nothing
    until the client leaves."""

    def __init__(self, num_bytes: int) -> None:
        self.num_bytes = num_bytes
        self.go_on = asyncio.Event()
        self.closed = False

    async def aiter_raw(self):
        yield b"data: ["
        for _ in range(self.num_bytes // 65536):
            yield b"1," * 32768
        yield b"1]}\n\ndata: [DONE]\n\n"
        await self.go_on.wait()

    async def aclose(self) -> None:
        self.closed = True


async def test_an_event_longer_than_the_router_holds_goes_on_in_pieces():
    # Held whole, a 64 MB event was copied at every 64 KB chunk (bytes += chunk, rfind over it all):
    # 33 s with the router's loop held, and a stream without a blank line grew the router's memory
    # without end while its client got nothing.
    router = Router(RouterConfig(("http://127.0.0.1:1",), ("http://127.0.0.1:2",)))
    stream = EndlessEvent(4 * MAX_HELD_EVENT_BYTES)
    relay = router._relay("r1", RelayedEvents("/v1/completions"), stream, RequestTiming(), 0.0, 0.0)
    pieces = []
    while not pieces or not pieces[-1].endswith(b"data: [DONE]\n\n"):
        pieces.append(await asyncio.wait_for(relay.__anext__(), 30))
        assert len(pieces[-1]) <= MAX_HELD_EVENT_BYTES + 65536 + 16
    assert len(pieces) >= 4
    whole = b"".join(pieces)
    assert whole == b"data: [" + b"1," * (4 * MAX_HELD_EVENT_BYTES // 2) + b"1]}\n\ndata: [DONE]\n\n"
    await relay.aclose()
    assert stream.closed
