"""A long-running server keeps no per-request state once a request has ended, however it ended.

Each test drives requests through a real server and then counts what is left in the maps that
follow a request (the API server's output processor, the engine core's routes, the engine's
queues and blocks), waiting on that state to drain, with a generous limit as a safety net.
"""
from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading

import httpx
import pytest
from core_hooks import install
from test_server_helpers import api_servers_on_one_core, call_utility, get_stats, running_server, wait_for

from minillm.config import EngineConfig
from minillm.server.app import ServerOptions
from minillm.server.async_llm import AsyncLLM
from minillm.server.limits import ServerLimits

MODEL = "stories"
DRAIN_S = 30.0     # a safety net only: every wait below polls state and returns as soon as it holds


def install_with_counts(engine) -> None:
    """core_hooks.install, plus a utility that counts the per-request state the core holds."""
    install(engine)

    def per_request_counts():
        """Entries in the engine's and the core loop's per-request maps, and the KV blocks in use."""
        counts = {"requests": len(engine.requests), "changed": len(engine._changed),
                  "waiting": engine.scheduler.num_waiting, "running": engine.scheduler.num_running,
                  "used_blocks": engine.block_manager.num_used_blocks}
        frame = sys._getframe(1)
        while frame is not None:   # the core loop and its EngineCore call this utility: they are on the stack
            owner = frame.f_locals.get("self")
            frame = frame.f_back
            if hasattr(owner, "client_of"):
                counts["client_of"] = len(owner.client_of)
        return counts

    engine.per_request_counts = per_request_counts


def _drained(counts: dict) -> bool:
    return all(value == 0 for value in counts.values())


@pytest.fixture(scope="module")
def two_servers(stories_path):
    """One engine core for two API servers in this process: ([urls], [AsyncLLM])."""
    config = EngineConfig(model=str(stories_path), device="cpu", max_model_len=256)
    with api_servers_on_one_core(config, 2, install_with_counts, MODEL) as both:
        yield both


def test_a_failed_step_on_the_second_api_server_leaves_nothing_behind(two_servers):
    """A step that fails for a request of the second API server: the core's last output for it
    (the next step's) must reach that server, whose output processor follows the request until
    then; sent to the first server instead, the second kept the request for ever."""
    urls, engines = two_servers
    core = engines[0]
    prompts = ["Lily and Ben", "One day, a cat", "The little dog"]
    results: dict[str, int] = {}

    def post(prompt: str) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 200, "ignore_eos": True}
        results[prompt] = httpx.post(f"{urls[1]}/v1/completions", json=body, timeout=60).status_code

    for prompt in prompts:
        ids = engines[1].tokenizer.encode(prompt, add_special_tokens=True)
        call_utility(core, "pace_steps", 0.05)     # the request is still running when the failure is armed
        try:
            thread = threading.Thread(target=post, args=(prompt,))
            thread.start()
            assert wait_for(lambda: ids in call_utility(core, "unfinished_prompts"), timeout=DRAIN_S)
            call_utility(core, "fail_next_step_for", [ids])
            thread.join(DRAIN_S)
        finally:
            call_utility(core, "pace_steps", 0)
        assert not thread.is_alive() and results[prompt] == 500

    counts = call_utility(core, "per_request_counts")
    assert "client_of" in counts, counts
    assert wait_for(lambda: _drained(call_utility(core, "per_request_counts")), timeout=DRAIN_S), \
        call_utility(core, "per_request_counts")
    assert wait_for(lambda: not engines[1].processor.requests, timeout=DRAIN_S), \
        f"{len(engines[1].processor.requests)} failed requests still followed by the second API server"
    assert not engines[0].processor.requests


STRUCTURED = {"json": {"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                       "required": ["a"]}}},
              "regex": {"structured_outputs": {"regex": "[a-z]{3,8}( [a-z]+)?"}},
              "choice": {"structured_outputs": {"choice": ["yes", "no", "maybe"]}}}
# (how it ends, the body, how the client behaves: "read" to the end, "hang_up" mid-stream, "leave" at once)
ENDINGS = [
    ("length", {"max_tokens": 8, "ignore_eos": True}, "read"),
    ("stop string", {"max_tokens": 40, "stop": ["the", "."]}, "read"),
    ("eos", {"max_tokens": 200, "temperature": 0}, "read"),
    ("logprobs", {"max_tokens": 10, "logprobs": 3, "echo": True}, "read"),
    ("n=3 streamed", {"max_tokens": 12, "n": 3, "stream": True}, "read"),
    ("two prompts", {"max_tokens": 6, "prompt": ["Once upon a time", "The little dog"]}, "read"),
    ("json", {"max_tokens": 30, **STRUCTURED["json"]}, "read"),
    ("regex", {"max_tokens": 20, **STRUCTURED["regex"]}, "read"),
    ("choice streamed", {"max_tokens": 10, "stream": True, **STRUCTURED["choice"]}, "read"),
    ("400 past the context", {"max_tokens": 5000}, "read"),
    ("400 kv_transfer_params", {"max_tokens": 5, "kv_transfer_params": {"do_remote_prefill": True}}, "read"),
    ("400 over a limit", {"max_tokens": 5, "n": 500}, "read"),
    ("hang-up mid-stream", {"max_tokens": 200, "ignore_eos": True, "stream": True}, "hang_up"),
    ("hang-up, n=2", {"max_tokens": 200, "ignore_eos": True, "stream": True, "n": 2}, "hang_up"),
    ("hang-up, json", {"max_tokens": 200, "stream": True, "structured_outputs": {"json": {"type": "object"}}}, "hang_up"),
    ("left, plain", {"max_tokens": 200, "ignore_eos": True}, "leave"),
    ("left, regex", {"max_tokens": 200, "structured_outputs": {"regex": "[a-z ]{10,300}"}}, "leave"),
]


def _raw_post(url: str, body: dict, num_events: int) -> None:
    """POST on a bare socket, read num_events events (none: not even the status) and hang up."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=DRAIN_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        received = b""
        while received.count(b"data: ") < num_events:
            chunk = sock.recv(65536)
            if not chunk:
                return
            received += chunk


async def _end_every_way(url: str, rounds: int, endings=None, prompts=("Once upon a time", "Lily and Ben", "One day"),
                         concurrency: int = 8) -> dict[str, set]:
    """Each ending (default: ENDINGS) `rounds` times, `concurrency` at a time; {ending: the statuses
    seen} (hang-ups: None)."""
    endings = ENDINGS if endings is None else endings
    seen: dict[str, set] = {}
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=DRAIN_S * 2) as client:
        async def one(i: int) -> None:
            name, extra, how = endings[i % len(endings)]
            body = {"model": MODEL, "prompt": prompts[i % len(prompts)], **extra}
            async with gate:
                if how != "read":
                    await asyncio.to_thread(_raw_post, url, body, 1 + i % 3 if how == "hang_up" else 0)
                    seen.setdefault(name, set()).add(None)
                elif body.get("stream"):
                    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                        async for _ in response.aiter_lines():
                            pass
                    seen.setdefault(name, set()).add(response.status_code)
                else:
                    response = await client.post(f"{url}/v1/completions", json=body)
                    seen.setdefault(name, set()).add(response.status_code)
        await asyncio.gather(*(one(i) for i in range(rounds * len(endings))))
    return seen


def _api_server_counts(engine) -> dict:
    """Entries in the API server's per-request maps (either engine client)."""
    if isinstance(engine, AsyncLLM):
        return {"output processor": len(engine.processor.requests), "adds": len(engine._adds),
                "calls": len(engine._calls), "stats batches": len(engine._stats_batches)}
    return {"streams": len(engine._streams)}


@pytest.mark.parametrize("engine_core", ["thread", "process"])
def test_requests_that_end_every_way_leave_nothing_behind(stories_path, engine_core):
    """Finished (length, stop string, EOS, structured), refused (400s), left by their clients
    (mid-stream, before any output), with preemptions on a small KV pool: afterwards nothing of
    them is held by the API server or the engine."""
    with running_server(stories_path, engine_core=engine_core, core_hook=install_with_counts,
                        max_model_len=256, num_kv_blocks=20, block_size=16) as (url, engine):
        seen = asyncio.run(_end_every_way(url, rounds=6))
        stats = get_stats(url)
        assert wait_for(lambda: _drained(call_utility(engine, "per_request_counts")), timeout=DRAIN_S), \
            call_utility(engine, "per_request_counts")
        assert wait_for(lambda: _drained(_api_server_counts(engine)), timeout=DRAIN_S), _api_server_counts(engine)
    assert stats["num_preemptions"] > 0, "the pool was large enough: nothing was preempted"
    assert seen["length"] == {200} and seen["json"] == {200} and seen["400 kv_transfer_params"] == {400}
    assert seen["400 past the context"] == {400} and seen["400 over a limit"] == {400}


def test_streams_cut_off_for_not_reading_leave_nothing_behind(stories_path):
    """Clients that stop reading are dropped after the stream timeout; their requests go with them."""
    # The streams must outlast the timeout: 500 tokens each (the model's whole context) against 0.5 s
    # without a read. At 250 tokens and 1 s the engine, once its host work got faster, finished some runs first.
    options = ServerOptions(limits=ServerLimits(stream_timeout_s=0.5))
    with running_server(stories_path, engine_core="process", core_hook=install_with_counts, max_model_len=512,
                        send_buffer_bytes=4096, options=options) as (url, engine):
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True,
                           "stream": True, "n": 4, "logprobs": 5}).encode()
        sockets = []
        try:
            for _ in range(6):
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)    # full after a few events
                sock.connect((host, int(port)))
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                sockets.append(sock)
            finished = wait_for(lambda: get_stats(url)["num_requests_finished"].get("abort", 0) == 6 * 4,
                                timeout=DRAIN_S)
            assert finished, get_stats(url)["num_requests_finished"]
            assert wait_for(lambda: _drained(call_utility(engine, "per_request_counts")), timeout=DRAIN_S)
            assert wait_for(lambda: _drained(_api_server_counts(engine)), timeout=DRAIN_S), _api_server_counts(engine)
        finally:
            for sock in sockets:
                sock.close()
