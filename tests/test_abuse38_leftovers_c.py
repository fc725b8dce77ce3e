"""Leftovers: a dead engine core's error reads the same streamed or not."""
from __future__ import annotations

import os
import signal
import threading

import httpx
from test_server_helpers import get_stats, running_server, sse_events, wait_for

MODEL = "stories"


def test_a_dead_engine_cores_error_is_the_plain_message_streamed_or_not(stories_path):
    # The stream's error event read "EngineDeadError: the engine core has died: ...", the 500's
    # body "the engine core has died: ...": vLLM sends str(exc) in both.
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
    results, first_chunk = {}, threading.Event()

    def streaming():
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                first_chunk.set()
        results["stream"] = lines

    def plain():
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        results["plain"] = (response.status_code, response.json())

    with running_server(stories_path, served_model_name=MODEL, engine_core="process") as (url, engine):
        threads = [threading.Thread(target=streaming), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        assert first_chunk.wait(30)
        assert wait_for(lambda: get_stats(url)["num_running"] == 2, timeout=30)
        os.kill(engine.core_pid, signal.SIGKILL)
        for t in threads:
            t.join(30)
            assert not t.is_alive(), "a request hung after the engine core died"
        reason = engine.dead_reason
    status, error = results["plain"]
    assert status == 500 and error["error"]["code"] == "engine_dead"
    assert error["error"]["message"] == reason and reason.startswith("the engine core has died")
    streamed = sse_events(results["stream"])[-1]["error"]
    assert streamed == error["error"], (streamed, error["error"])

