"""Failures inside engine.step(): contained ones fail only their requests; any other ends the loop,
open requests get a 500, /health turns 503, nothing hangs, and `minillm serve` exits for a restart.

Each runs with the engine core in its own process and on the server's thread; the failures are
injected inside the engine wherever it runs (core_hooks.py). The engine core process dying
(SIGKILL) is seen at once, with the same outcome."""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from core_hooks import install
from test_server_helpers import HealthyStreams, call_utility, get_stats, running_server, sse_events, started_url, wait_for

from minillm.sampling_params import SamplingParams

MODEL = "stories"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", params=["process", "thread"])
def server(stories_path, request):
    with running_server(stories_path, served_model_name=MODEL, engine_core=request.param,
                        core_hook=install) as (url, engine):
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


def test_a_contained_step_failure_fails_only_its_requests(server):
    url, engine = server
    healthy = HealthyStreams(url, {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300})
    victims = ["The little dog", "Lily and Ben"]
    victim_ids = [engine.tokenizer.encode(p) for p in victims]
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

    with healthy.in_flight():
        threads = [threading.Thread(target=plain), threading.Thread(target=streaming)]
        for t in threads:
            t.start()
        assert streamed.wait(30)
        assert wait_for(lambda: sum(p in victim_ids for p in call_utility(engine, "unfinished_prompts")) == 2,
                        timeout=30)
        call_utility(engine, "fail_next_step_for", victim_ids)
        for t in threads:
            t.join(30)
            assert not t.is_alive(), "a request hung after its step failed"
    healthy.check()

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


def test_step_exception_fails_open_requests_and_flips_health(server):
    url, engine = server
    assert httpx.get(f"{url}/health").status_code == 200
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
    call_utility(engine, "fail_every_step", "injected step failure")
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


# `minillm` with LLMEngine.step failing for good once the file named first exists. Run as a script
# file, so that a spawned engine core process runs this patch too (spawn re-runs the main script
# there as __mp_main__, with the same sys.argv).
FAILING_SERVE = """
import os, sys
import minillm.engine
real_step = minillm.engine.LLMEngine.step

def step(self):
    if os.path.exists(sys.argv[1]):
        raise RuntimeError("injected fatal step failure")
    return real_step(self)

minillm.engine.LLMEngine.step = step

if __name__ == "__main__":
    from minillm.cli import main
    main(sys.argv[2:])
"""


@contextlib.contextmanager
def _serve(tmp_path: Path, command: list[str]):
    """Run `command` + serve options on a port the kernel picks; yield (process, url, log) once /health says ok."""
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(command + ["--device", "cpu", "--port", "0", "--served-model-name", MODEL],
                                cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        url = started_url(proc, log, timeout=120)
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200, log.read_text()
        yield proc, url, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class _Stream(threading.Thread):
    """A long streamed completion read on a thread; `first` is set once its first event is in."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.lines, self.first = url, [], threading.Event()
        self.start()

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                self.lines.append(line)
                self.first.set()


def _expect_failure_handling(proc: subprocess.Popen, url: str, log: Path, stream: _Stream, failed_at: float,
                             cause: str) -> None:
    """The stream ends with an error event naming the cause, /health is a 503 during the drain, and the
    process exits with status 1 soon after."""
    stream.join(30)
    assert not stream.is_alive(), "the stream hung after the engine failed"
    events = sse_events(stream.lines)
    assert cause in events[-1]["error"]["message"], events[-1]
    assert [line for line in stream.lines if line][-1] == "data: [DONE]"
    health = httpx.get(f"{url}/health", timeout=5)   # during the drain: up, but unhealthy
    assert health.status_code == 503 and cause in health.json()["error"]["message"]
    status = proc.wait(timeout=60)
    exited_after = time.monotonic() - failed_at
    assert status == 1, log.read_text()
    assert exited_after < 15, f"took {exited_after:.1f} s to exit"
    assert "the server exits in" in log.read_text()


@pytest.mark.parametrize("engine_core", ["process", "thread"])
def test_an_engine_failure_that_cannot_be_contained_exits_the_server(stories_path, tmp_path, engine_core):
    script, flag = tmp_path / "failing_serve.py", tmp_path / "fail-now"
    script.write_text(FAILING_SERVE)
    command = [sys.executable, str(script), str(flag), "serve", str(stories_path), "--engine-core", engine_core]
    with _serve(tmp_path, command) as (proc, url, log):
        stream = _Stream(url)
        assert stream.first.wait(30)
        flag.touch()
        _expect_failure_handling(proc, url, log, stream, time.monotonic(), "injected fatal step failure")


def test_a_killed_engine_core_process_exits_the_server(stories_path, tmp_path):
    command = [sys.executable, "-m", "minillm.cli", "serve", str(stories_path), "--engine-core", "process"]
    with _serve(tmp_path, command) as (proc, url, log):
        found = re.search(r"engine core in process (\d+)", log.read_text())
        assert found, log.read_text()
        core_pid = int(found.group(1))
        assert core_pid != proc.pid
        stream = _Stream(url)
        assert stream.first.wait(30)
        os.kill(core_pid, signal.SIGKILL)
        _expect_failure_handling(proc, url, log, stream, time.monotonic(), "killed by SIGKILL")


@pytest.mark.parametrize("engine_core", ["process", "thread"])
def test_a_stopped_server_ends_open_requests_with_the_engines_error_not_a_cut(stories_path, tmp_path, engine_core):
    # uvicorn cancelled the handlers still open at its graceful-shutdown deadline: streams were cut
    # without an error event or [DONE], a non-streaming request got an empty 500, the log tracebacks.
    command = [sys.executable, "-m", "minillm.cli", "serve", str(stories_path), "--engine-core", engine_core,
               "--timeout-graceful-shutdown", "1"]
    with _serve(tmp_path, command) as (proc, url, log):
        streams = [_Stream(url) for _ in range(6)]
        assert all(s.first.wait(30) for s in streams)
        plain: list = []
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
        waiter = threading.Thread(target=lambda: plain.append(httpx.post(f"{url}/v1/completions", json=body,
                                                                         timeout=60)), daemon=True)
        waiter.start()
        assert wait_for(lambda: get_stats(url)["num_running"] == 7, timeout=30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM), log.read_text()   # uvicorn raises the signal again
        ended_by_error = 0
        for stream in streams:
            stream.join(30)
            assert not stream.is_alive()
            assert [line for line in stream.lines if line][-1] == "data: [DONE]", stream.lines[-3:]
            last = sse_events(stream.lines)[-1]
            if "error" in last:
                assert "shut down" in last["error"]["message"], last
                ended_by_error += 1
        assert ended_by_error, "every stream finished before the deadline: the test needs longer streams"
        waiter.join(30)
        [response] = plain
        assert response.json()["error"]["code"] == "engine_dead" and "shut down" in response.json()["error"]["message"]
        text = log.read_text()
        assert "Traceback" not in text and "Exception in ASGI application" not in text, text[-3000:]
