"""/metrics has vLLM's request-parameter and per-step histograms a deployment's dashboards chart:
request_params_n, request_params_max_tokens, request_max_num_generation_tokens, iteration_tokens_total."""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server_helpers import get_stats, running_server, wait_for

MODEL = "stories"
PROMPT = [1, 403, 407, 263, 31]     # five tokens


def scrape(url: str) -> tuple[dict, dict]:
    """({(sample name, frozen labels without model_name): value}, {family: type}) from /metrics."""
    samples, types = {}, {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        types[family.name] = family.type
        for s in family.samples:
            assert s.labels.get("model_name") == MODEL, s
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            samples[(s.name, frozenset(labels.items()))] = s.value
    return samples, types


def metric(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def complete(url: str, **body) -> dict:
    response = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPT, "ignore_eos": True, "temperature": 1.0, "seed": 7, **body})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def server(stories_path):
    with running_server(stories_path, served_model_name=MODEL) as (url, _):
        yield url


def _idle(url: str, finished: int):
    stats = get_stats(url)
    done = sum(stats["num_requests_finished"].values())
    return stats if stats["num_running"] == 0 and stats["num_waiting"] == 0 and done == finished else None


def test_request_parameter_histograms_count_each_request(server):
    complete(server, n=3, max_tokens=5)
    complete(server, max_tokens=7)
    assert wait_for(lambda: _idle(server, 4), timeout=20)
    samples, types = scrape(server)
    for name in ("request_params_n", "request_params_max_tokens", "request_max_num_generation_tokens"):
        assert types[f"minillm:{name}"] == "histogram", name
    # n: once per request (vLLM's buckets 1, 2, 5, 10, 20)
    assert metric(samples, "minillm:request_params_n_count") == 2
    assert metric(samples, "minillm:request_params_n_sum") == 3 + 1
    assert metric(samples, "minillm:request_params_n_bucket", le="1.0") == 1
    assert metric(samples, "minillm:request_params_n_bucket", le="2.0") == 1
    assert metric(samples, "minillm:request_params_n_bucket", le="5.0") == 2
    # max_tokens: once per finished completion, as vLLM observes each child request
    assert metric(samples, "minillm:request_params_max_tokens_count") == 4
    assert metric(samples, "minillm:request_params_max_tokens_sum") == 3 * 5 + 7
    # the longest completion of each request
    assert metric(samples, "minillm:request_max_num_generation_tokens_count") == 2
    assert metric(samples, "minillm:request_max_num_generation_tokens_sum") == 5 + 7


def test_iteration_tokens_count_every_step_and_its_tokens(stories_path):
    with running_server(stories_path, served_model_name=MODEL) as (url, _):
        complete(url, max_tokens=6)
        stats = wait_for(lambda: _idle(url, 1), timeout=20)
        assert stats
        samples, types = scrape(url)
    assert types["minillm:iteration_tokens_total"] == "histogram"
    assert metric(samples, "minillm:iteration_tokens_total_count") == stats["num_steps"]
    # one prompt step of 5 tokens, then one token a step for the 5 more it generated
    assert metric(samples, "minillm:iteration_tokens_total_sum") == len(PROMPT) + 5
    assert metric(samples, "minillm:iteration_tokens_total_bucket", le="1.0") == stats["num_steps"] - 1
    assert metric(samples, "minillm:iteration_tokens_total_bucket", le="8.0") == stats["num_steps"]
    assert metric(samples, "minillm:iteration_tokens_total_bucket", le="+Inf") == stats["num_steps"]


def test_request_success_has_every_finish_reason_a_request_can_end_with_from_the_start(server):
    """vLLM creates a request_success series per finish reason up front (a rate over one that has
    not happened yet is 0, not missing); minillm ends a request whose grammar failed with "error"."""
    samples, _ = scrape(server)
    for reason in ("stop", "length", "abort", "error"):
        assert ("minillm:request_success_total", frozenset({("finished_reason", reason)})) in samples, reason


def test_a_decode_servers_stale_claims_are_a_counter(stories_path):
    """A claimed lease that ran out before the engine loaded it means the decode server computed
    that prompt itself: /v1/stats counted it and /metrics did not."""
    import dataclasses

    from minillm import LLM
    from minillm.server.metrics import ServerMetrics
    llm = LLM(str(stories_path), device="cpu")
    try:
        stats = dataclasses.replace(llm.engine.stats(summary=True), kv_transfer_role="kv_consumer",
                                    kv_transfer_stale_claims=3)
    finally:
        llm.shutdown()
    metrics = ServerMetrics(MODEL, 128)
    metrics.update(stats)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    family = families["minillm:kv_transfer_stale_claims"]
    assert family.type == "counter"
    assert [(s.name, s.value) for s in family.samples] == [("minillm:kv_transfer_stale_claims_total", 3.0)]
