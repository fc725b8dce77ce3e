"""A decode server whose engine dies while a request it took holds a claimed lease: the API server
gives the lease back at once (the dead engine would never release it), not at the lease's end;
for a streamed request whose engine dies after its first token, and for a request whose caller left
(its abort queued) just before the engine died, streamed or not."""
from __future__ import annotations

import json
import os
import socket
import threading

import httpx
import pytest
from test_abuse30_pd_server import prefill, producer_and_consumer
from test_server_helpers import get_stats, wait_for

BODY = {"model": "stories", "prompt": "Once upon a time there was a little girl named Lily who loved to play",
        "temperature": 0, "max_tokens": 40, "ignore_eos": True}


def leases_of(url: str) -> tuple[int, int, int]:
    """A producer's (leases held, released, expired)."""
    stats = get_stats(url)
    return (stats["kv_transfer_num_leases"], stats["kv_transfer_leases_released"],
            stats["kv_transfer_leases_expired"])


class FailAfterFirstOutput:
    """A core_hook (picklable, for either engine core): the step after the first that returned an
    output waits until the FIFO at path is opened for writing and closed, then raises an error the
    engine cannot contain."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, engine) -> None:
        real_step, seen = engine.step, []

        def step():
            if seen:
                with open(self.path) as fifo:
                    fifo.read()
                raise RuntimeError("injected fatal step failure")
            outputs = real_step()
            seen.extend(outputs)
            return outputs

        engine.step = step


def let_go(path: str) -> None:
    """Open the FIFO a FailAfterFirstOutput step waits on, and close it (a failure if it never waits)."""
    opener = threading.Thread(target=lambda: open(path, "w").close(), daemon=True)
    opener.start()
    opener.join(30)
    assert not opener.is_alive(), "the engine never waited on its FIFO"


@pytest.mark.parametrize("engine_core", ["thread", "process"])
def test_a_dead_decode_engine_gives_a_streamed_requests_lease_back(stories_path, engine_core, tmp_path):
    fifo = str(tmp_path / "fail")
    os.mkfifo(fifo)
    with producer_and_consumer(stories_path, FailAfterFirstOutput(fifo), engine_core) as (p_url, d_url, _):
        kv_transfer_params = prefill(p_url, BODY)
        assert leases_of(p_url)[0] == 1
        events = []
        with httpx.stream("POST", f"{d_url}/v1/completions", timeout=60,
                          json={**BODY, "stream": True, "kv_transfer_params": kv_transfer_params}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 1:                   # the engine took the request and decodes it
                    let_go(fifo)
        error = next(json.loads(e) for e in events if e != "[DONE]" and "error" in json.loads(e))
        assert "injected fatal step failure" in error["error"]["message"]
        assert wait_for(lambda: leases_of(p_url)[0] == 0, timeout=10)
        assert leases_of(p_url) == (0, 1, 0)


class BlockedFatalStep:
    """A core_hook (engine on a thread): once armed, the next step waits to be let go, then raises an
    error the engine cannot contain."""

    def __init__(self) -> None:
        self.is_armed = False
        self.entered, self.gate = threading.Event(), threading.Event()

    def install(self, engine) -> None:
        real_step = engine.step

        def step():
            if self.is_armed:
                self.entered.set()
                self.gate.wait(30)
                raise RuntimeError("injected fatal step failure")
            return real_step()

        engine.step = step


def http_post(url: str, path: str, body: dict) -> socket.socket:
    """Send a POST over a raw socket (closed by the caller: a client that hangs up) and return it."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_lease_whose_caller_left_just_before_its_engine_died_is_given_back(stories_path, stream):
    fatal = BlockedFatalStep()
    with producer_and_consumer(stories_path, fatal.install) as (p_url, d_url, d_engine):
        kv_transfer_params = prefill(p_url, BODY)
        assert leases_of(p_url)[0] == 1
        fatal.is_armed = True
        sock = http_post(d_url, "/v1/completions", {**BODY, "stream": stream, "kv_transfer_params": kv_transfer_params})
        assert fatal.entered.wait(30)             # the engine took the request and is in the step that loads it
        sock.close()                              # the caller leaves: its API server queues the abort
        assert wait_for(lambda: d_engine._commands.qsize() >= 1, timeout=10)   # its abort
        fatal.gate.set()                          # the step fails before the abort is handled
        assert d_engine.ended.wait(10) and d_engine.has_failed
        assert wait_for(lambda: leases_of(p_url)[0] == 0, timeout=10)
        assert leases_of(p_url) == (0, 1, 0)


def serve_other_weights(engine) -> None:
    """A core_hook: the decode engine's KV connector takes itself for an engine of other weights."""
    engine.kv_connector.worker.model = "f" * 64


@pytest.mark.parametrize("engine_core", ["thread", "process"])
def test_a_lease_released_twice_for_a_refused_add_is_released_once(stories_path, engine_core):
    """The engine refuses a claimed request (a prefill engine of other weights): its API server and
    its engine both give the lease back; the producer counts one release and nothing else changes."""
    with producer_and_consumer(stories_path, serve_other_weights, engine_core) as (p_url, d_url, _):
        for count in (1, 2):
            response = httpx.post(f"{d_url}/v1/completions", timeout=60,
                                  json={**BODY, "kv_transfer_params": prefill(p_url, BODY)})
            assert response.status_code == 400 and "other weights" in response.text, response.text
            assert response.json()["error"]["param"] == "kv_transfer_params"
            assert wait_for(lambda: leases_of(p_url)[0] == 0, timeout=10)
            assert leases_of(p_url) == (0, count, 0)
