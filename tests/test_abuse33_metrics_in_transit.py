"""/metrics and /v1/stats with the engine core in its own process: a snapshot that says no request
runs counts every request the core has finished, even while the API server's report of how it
ended is still on its way to the core (a busy machine stretches that window)."""
from __future__ import annotations

import pytest
from test_server_helpers import get_stats, running_server

from minillm.engine_core import messages as m

MODEL = "stories"
LENGTH = 'minillm:request_success_total{finished_reason="length",model_name="stories"}'
RUNNING = 'minillm:num_requests_running{model_name="stories"}'


@pytest.fixture(scope="module")
def server(stories_path):
    with running_server(stories_path, served_model_name=MODEL, engine_core="process") as (url, engine):
        yield url, engine


def _scraped(http) -> dict[str, float]:
    """/metrics as {series with labels: value}."""
    lines = (line.rsplit(" ", 1) for line in http.get("/metrics").text.splitlines() if line and line[0] != "#")
    return {series: float(value) for series, value in lines}


def test_finished_requests_count_while_their_report_is_on_its_way_to_the_core(server, http, monkeypatch):
    # The core counted finish reasons from the API server's reports alone, so a scrape the core
    # answered before the report came said "idle" without the requests it had just finished: a test
    # that waited for idle and then compared two scrapes saw an earlier request end between them.
    _, engine = server
    held, send = [], engine._send
    monkeypatch.setattr(engine, "_send", lambda message: held.append(message)
                        if isinstance(message, m.FinishedCounts) else send(message))
    before, before_stats = _scraped(http), get_stats(str(http.base_url))
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3, "n": 2, "ignore_eos": True}
    http.post("/v1/completions", json=body).raise_for_status()
    after, after_stats = _scraped(http), get_stats(str(http.base_url))
    assert held, "the reports were sent before the test could hold them"
    assert after[RUNNING] == after_stats["num_running"] == 0
    assert after[LENGTH] - before[LENGTH] == 2
    assert after_stats["num_requests_finished"]["length"] - before_stats["num_requests_finished"].get("length", 0) == 2
    with engine._lock:          # the reports reach the core: nothing is counted twice
        for message in held:
            send(message)
    assert _scraped(http)[LENGTH] - before[LENGTH] == 2
    assert get_stats(str(http.base_url))["num_requests_finished"]["length"] == after_stats["num_requests_finished"]["length"]
