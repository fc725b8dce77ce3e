"""Failures inside engine.step(): contained ones fail only their requests; any other ends the loop,
open requests get a 500, /health turns 503, nothing hangs, and `minillm serve` exits for a restart."""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_server_helpers import HealthyStreams, get_stats, running_server, sse_events, wait_for

from minillm.sampling_params import SamplingParams
from minillm.server.async_engine import StepError

MODEL = "stories"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(stories_path):
    with running_server(stories_path, served_model_name=MODEL) as (url, engine):
        yield url, engine


def test_add_request_value_error_reaches_the_caller_and_spares_the_others(server):
    _, engine = server
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    async def scenario():
        stream = await engine.add_request("dup", [1, 403, 407], params)
        with pytest.raises(ValueError, match="request_id"):
            await engine.add_request("dup", [1, 403], params)
        outputs = [output async for output, _ in stream]
        return outputs[-1]

    last = asyncio.run(scenario())
    assert last.finished and len(last.outputs[0].token_ids) == 30 and last.outputs[0].finish_reason == "length"
    assert engine.is_healthy


def _inject_contained_failure(engine, prompt_ids: list[list[int]]) -> threading.Event:
    """Once the returned event is set, the next step fails for the requests with these prompts only:
    as LLMEngine does for a contained failure, it aborts them, then raises StepError naming them."""
    fail = threading.Event()
    inner = engine.engine
    real_step = inner.step

    def step():
        if fail.is_set():
            fail.clear()
            hit = [rid for rid, req in inner.requests.items() if req.prompt_token_ids in prompt_ids]
            for rid in hit:
                inner.abort_request(rid)
            raise StepError(request_ids=hit, cause=RuntimeError("injected kernel fault"))
        return real_step()

    inner.step = step
    return fail


def test_a_contained_step_failure_fails_only_its_requests(server):
    url, engine = server
    healthy = HealthyStreams(url, {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300})
    victims = ["The little dog", "Lily and Ben"]
    victim_ids = [engine.tokenizer.encode(p) for p in victims]
    fail = _inject_contained_failure(engine, victim_ids)
    results, streamed = {}, threading.Event()

    def plain():
        body = {"model": MODEL, "prompt": victims[0], "max_tokens": 300, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        results["plain"] = (r.status_code, r.json())

    def streaming():
        body = {"model": MODEL, "prompt": victims[1], "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                streamed.set()
        results["stream"] = (r.status_code, lines)

    try:
        with healthy.in_flight():
            threads = [threading.Thread(target=plain), threading.Thread(target=streaming)]
            for t in threads:
                t.start()
            assert streamed.wait(30)
            assert wait_for(lambda: get_stats(url)["num_running"] == 3, timeout=30)
            fail.set()
            for t in threads:
                t.join(30)
                assert not t.is_alive(), "a request hung after its step failed"
        healthy.check()
    finally:
        del engine.engine.step   # back to the class's own step

    status, body = results["plain"]
    assert status == 500 and body["error"]["code"] == "engine_step_failed"
    assert "RuntimeError: injected kernel fault" in body["error"]["message"]
    status, lines = results["stream"]
    events = sse_events(lines)
    assert status == 200 and "injected kernel fault" in events[-1]["error"]["message"]
    assert [line for line in lines if line][-1] == "data: [DONE]"
    assert httpx.get(f"{url}/health").status_code == 200 and engine.is_healthy
    stats = wait_for(lambda: (s := get_stats(url))["num_running"] == 0 and s)
    assert stats and stats["kv_num_used_blocks"] == 0
    again = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": victims[0], "max_tokens": 5,
                                                      "ignore_eos": True}, timeout=30)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 5


def _inject_step_failure(engine) -> threading.Event:
    """Wrap the real engine's step so it raises once the returned event is set."""
    fail = threading.Event()
    real_step = engine.engine.step

    def step():
        if fail.is_set():
            raise RuntimeError("injected step failure")
        return real_step()

    engine.engine.step = step
    return fail


def test_step_exception_fails_open_requests_and_flips_health(server):
    url, engine = server
    assert httpx.get(f"{url}/health").status_code == 200
    fail = _inject_step_failure(engine)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    results, first_chunk = {}, threading.Event()

    def streaming():
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            results["stream_status"] = r.status_code
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                first_chunk.set()
        results["stream_lines"] = lines

    def non_streaming():
        r = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 450}, timeout=30)
        results["plain"] = (r.status_code, r.json())

    threads = [threading.Thread(target=streaming), threading.Thread(target=non_streaming)]
    for t in threads:
        t.start()
    assert first_chunk.wait(10)
    assert wait_for(lambda: get_stats(url)["num_running"] == 2, timeout=10)
    fail.set()
    for t in threads:
        t.join(20)
        assert not t.is_alive(), "a request hung after the engine failed"

    status, error_json = results["plain"]
    assert status == 500 and set(error_json["error"]) == {"message", "type", "param", "code"}
    assert "injected step failure" in error_json["error"]["message"]
    assert results["stream_status"] == 200        # headers were out before the failure
    events = sse_events(results["stream_lines"])
    assert "error" in events[-1] and "injected step failure" in events[-1]["error"]["message"]
    assert [line for line in results["stream_lines"] if line][-1] == "data: [DONE]"

    health = httpx.get(f"{url}/health")
    assert health.status_code == 503 and "error" in health.json()
    for stream in (False, True):
        late = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 4, "stream": stream}, timeout=10)
        assert late.status_code == 500 and late.json()["error"]["code"] == "engine_dead"
    assert httpx.get(f"{url}/v1/stats", timeout=10).status_code == 500
    assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200


# Runs `minillm` with LLMEngine.step failing for good once the file named first exists.
FAILING_SERVE = """
import os, sys
import minillm.engine
real_step = minillm.engine.LLMEngine.step

def step(self):
    if os.path.exists(sys.argv[1]):
        raise RuntimeError("injected fatal step failure")
    return real_step(self)

minillm.engine.LLMEngine.step = step
from minillm.cli import main
main(sys.argv[2:])
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_engine_failure_that_cannot_be_contained_exits_the_server(stories_path, tmp_path):
    port, flag, log = _free_port(), tmp_path / "fail-now", tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", FAILING_SERVE, str(flag), "serve", str(stories_path),
                                 "--device", "cpu", "--port", str(port), "--served-model-name", MODEL],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        def up():
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(f"{url}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False
        assert wait_for(up, timeout=120, interval=0.1), "the server did not come up"
        lines, first = [], threading.Event()

        def streaming():
            body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    first.set()

        reader = threading.Thread(target=streaming)
        reader.start()
        assert first.wait(30)
        flag.touch()
        failed_at = time.monotonic()
        reader.join(30)
        assert not reader.is_alive()
        assert "injected fatal step failure" in sse_events(lines)[-1]["error"]["message"]
        health = httpx.get(f"{url}/health", timeout=5)   # during the drain: up, but unhealthy
        assert health.status_code == 503 and "injected fatal step failure" in health.json()["error"]["message"]
        status = proc.wait(timeout=60)
        exited_after = time.monotonic() - failed_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert status == 1, log.read_text()
    assert exited_after < 15, f"took {exited_after:.1f} s to exit"
    assert "the server exits in" in log.read_text()
