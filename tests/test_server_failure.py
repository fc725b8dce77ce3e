"""An exception inside engine.step(): open requests get a 500, /health turns 503, nothing hangs."""
from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from test_server_helpers import get_stats, running_server, sse_events, wait_for

from minillm.sampling_params import SamplingParams

MODEL = "stories"


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
