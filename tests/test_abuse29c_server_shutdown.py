"""A server that stops (SIGTERM, the end of --timeout-graceful-shutdown) answers what it can no
longer serve as a server that is unavailable, 503, as --timeout-graceful-shutdown says: a load
balancer or client retries it elsewhere. It used to be a 500, which reads as a server fault; an
engine that failed is still a 500."""
from __future__ import annotations

import threading

import httpx
import pytest
from core_hooks import install
from test_server_helpers import call_utility, get_stats, running_server, sse_events, wait_for

BODY = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}


def _post(url: str, body: dict, out: dict) -> None:
    """POST a completion; out gets its status and body (the stream's events, where it streams)."""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        out["status"] = response.status_code
        lines = list(response.iter_lines())
    out["lines"] = lines


@pytest.mark.parametrize("engine_core", ["process", "thread"])
def test_requests_the_stopping_engine_drops_are_503s(stories_path, engine_core):
    with running_server(stories_path, engine_core=engine_core, core_hook=install, max_num_seqs=1) as (url, engine):
        call_utility(engine, "pace_steps", 0.02)     # the running stream lasts past the shutdown
        running, waiting = {}, {}
        threads = [threading.Thread(target=_post, args=(url, {**BODY, "stream": True}, running), daemon=True)]
        threads[0].start()
        assert wait_for(lambda: get_stats(url)["num_running"] == 1, timeout=30)
        threads.append(threading.Thread(target=_post, args=(url, BODY, waiting), daemon=True))
        threads[1].start()
        assert wait_for(lambda: get_stats(url)["num_waiting"] == 1, timeout=30)
        engine.shutdown()
        for thread in threads:
            thread.join(30)
            assert not thread.is_alive()
        assert waiting["status"] == 503, waiting
        error = httpx.Response(503, content="".join(waiting["lines"])).json()["error"]
        assert error["code"] == "engine_dead" and error["type"] == "server_error" and "shut down" in error["message"]
        assert running["status"] == 200
        last = sse_events(running["lines"])[-1]
        assert "shut down" in last["error"]["message"] and last["error"]["code"] == "engine_dead", last
        late = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30)
        assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead", late.text
