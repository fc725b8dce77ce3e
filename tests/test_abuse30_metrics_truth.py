"""/metrics and /v1/stats against what a seeded workload knows happened: finish reasons, token
totals, preemptions, prefix-cache hits, histogram counts and the gauges once the server is idle.

One server with a small KV pool (preemption), prompts that share a prefix (prefix-cache hits), n>1,
streams the client drops (aborts) and requests the server refuses (400s, counted nowhere).
"""
from __future__ import annotations

import json
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server_helpers import get_stats, running_server, wait_for

MODEL = "stories"
SEED = 30
PREFIX = [1] + [random.Random(SEED).randrange(3, 512) for _ in range(47)]   # three full 16-token blocks
ABORT_MAX_TOKENS = 300


def _prompt(rng: random.Random) -> list[int]:
    """Token ids: the shared prefix then a tail of its own."""
    return PREFIX + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 20))]


def _complete(url: str, body: dict) -> dict:
    """One non-streamed completion: its choices' finish reasons and its usage."""
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    data = response.json()
    return {"kind": "done", "n": body.get("n", 1), "prompt": len(body["prompt"]),
            "reasons": [c["finish_reason"] for c in data["choices"]], "usage": data["usage"]}


def _drop_stream(url: str, body: dict) -> dict:
    """A stream the client leaves after its first two chunks with text: the server aborts it."""
    num_tokens = 0
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                num_tokens += 1 if chunk["choices"] and chunk["choices"][0]["text"] else 0
                if num_tokens >= 2:
                    break
    return {"kind": "dropped", "n": 1, "prompt": len(body["prompt"]), "streamed": num_tokens}


def _refused(url: str, body: dict) -> dict:
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    return {"kind": "refused"}


def _workload(rng: random.Random, model: str) -> list[tuple]:
    jobs = []
    for k in range(30):
        body = {"model": model, "prompt": _prompt(rng), "temperature": 1.0, "seed": rng.randrange(10**6)}
        roll = k % 6
        if roll == 5:
            jobs.append((_drop_stream, {**body, "max_tokens": ABORT_MAX_TOKENS, "ignore_eos": True}))
        elif roll == 4:
            bad = rng.choice([{"max_tokens": -1}, {"n": 0}, {"temperature": -1.0}, {"top_p": 2.0}])
            jobs.append((_refused, {**body, "max_tokens": 8, **bad}))
        else:
            jobs.append((_complete, {**body, "max_tokens": rng.randrange(20, 90), "n": rng.choice([1, 1, 2, 3])}))
    return jobs


def scrape(url: str) -> dict:
    """{(sample name, frozen labels without model_name): value} from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            samples[(s.name, frozenset(labels.items()))] = s.value
    return samples


def metric(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture(scope="module")
def run(stories_path):
    with running_server(stories_path, served_model_name=MODEL, num_kv_blocks=24, max_num_seqs=8) as (url, engine):
        rng = random.Random(SEED)
        jobs = _workload(rng, MODEL)
        with ThreadPoolExecutor(8) as pool:
            ledger = list(pool.map(lambda job: job[0](url, job[1]), jobs))

        def idle():
            stats = get_stats(url)
            finished = sum(stats["num_requests_finished"].values())
            expected = sum(e["n"] for e in ledger if e["kind"] != "refused")
            return stats if (stats["num_running"] == 0 and stats["num_waiting"] == 0
                             and finished == expected) else None
        stats = wait_for(idle, timeout=20)
        assert stats, "the server never went idle with every request counted"
        yield ledger, stats, scrape(url)


def _done(ledger):
    return [e for e in ledger if e["kind"] == "done"]


def _dropped(ledger):
    return [e for e in ledger if e["kind"] == "dropped"]


def test_workload_did_what_it_set_out_to(run):
    ledger, stats, _ = run
    assert Counter(e["kind"] for e in ledger) == {"done": 20, "dropped": 5, "refused": 5}
    assert any(e["n"] > 1 for e in _done(ledger))
    assert stats["num_preemptions"] > 0, "the small KV pool should have forced preemptions"


def test_request_success_counts_every_completion_by_reason_and_no_400(run):
    ledger, stats, samples = run
    known = Counter(r for e in _done(ledger) for r in e["reasons"])
    got = {reason: metric(samples, "minillm:request_success_total", finished_reason=reason)
           for reason in ("stop", "length", "abort")}
    num_dropped = len(_dropped(ledger))
    # A dropped stream ends as an abort unless it ran to its 300 tokens first.
    assert got["abort"] >= 1
    assert got["stop"] - known["stop"] >= 0 and got["length"] - known["length"] >= 0
    assert got["abort"] + (got["stop"] - known["stop"]) + (got["length"] - known["length"]) == num_dropped
    assert set(stats["num_requests_finished"]) <= set(got)
    assert {r: stats["num_requests_finished"].get(r, 0) for r in got} == got


def test_generation_tokens_are_the_tokens_generated(run):
    ledger, stats, samples = run
    completed = sum(e["usage"]["completion_tokens"] for e in _done(ledger))
    streamed = sum(e["streamed"] for e in _dropped(ledger))
    total = metric(samples, "minillm:generation_tokens_total")
    assert completed + streamed <= total <= completed + ABORT_MAX_TOKENS * len(_dropped(ledger))
    assert stats["generation_tokens_total"] == total


def test_prompt_tokens_agree_between_metrics_and_stats(run):
    ledger, stats, samples = run
    assert sum(e["usage"]["prompt_tokens"] for e in _done(ledger)) == sum(e["prompt"] for e in _done(ledger))
    assert metric(samples, "minillm:prompt_tokens_total") == stats["prompt_tokens_total"] > 0


def test_prompt_tokens_count_each_completion_prompt_once(run):
    """vLLM counts a request's whole prompt once, when its first token comes (each of n as a
    request): cached prefix tokens count, tokens recomputed after a preemption do not count again."""
    ledger, _, samples = run
    expected = sum(e["prompt"] * e["n"] for e in ledger if e["kind"] != "refused")
    assert metric(samples, "minillm:prompt_tokens_total") == expected


def test_preemptions_match_the_engine(run):
    _, stats, samples = run
    assert metric(samples, "minillm:num_preemptions_total") == stats["num_preemptions"] > 0


def test_prefix_cache_hits_are_counted(run):
    _, stats, samples = run
    queries = metric(samples, "minillm:prefix_cache_queries_total")
    hits = metric(samples, "minillm:prefix_cache_hits_total")
    assert 0 < hits <= queries
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (queries, hits)


def test_histogram_counts_are_the_finished_completions(run):
    ledger, _, samples = run
    num_finished = sum(e["n"] for e in _done(ledger))
    aborted = metric(samples, "minillm:request_success_total", finished_reason="abort")
    num_finished += len(_dropped(ledger)) - int(aborted)   # dropped streams that finished all the same
    for name in ("minillm:e2e_request_latency_seconds", "minillm:time_to_first_token_seconds",
                 "minillm:request_prompt_tokens", "minillm:request_generation_tokens"):
        assert metric(samples, f"{name}_count") == num_finished, name
    prompts = sum(e["prompt"] * e["n"] for e in _done(ledger))
    assert metric(samples, "minillm:request_prompt_tokens_sum") >= prompts
    if aborted == len(_dropped(ledger)):
        assert metric(samples, "minillm:request_prompt_tokens_sum") == prompts
        generated = sum(e["usage"]["completion_tokens"] for e in _done(ledger))
        assert metric(samples, "minillm:request_generation_tokens_sum") == generated


def test_gauges_return_to_idle(run):
    _, stats, samples = run
    assert metric(samples, "minillm:num_requests_running") == 0 == stats["num_running"]
    assert metric(samples, "minillm:num_requests_waiting") == 0 == stats["num_waiting"]
    assert metric(samples, "minillm:kv_cache_usage_perc") == 0 == stats["kv_usage"]
    assert stats["kv_num_used_blocks"] == 0
    assert stats["kv_num_cached_blocks"] + stats["kv_num_free_blocks"] == stats["kv_num_blocks"]
    assert stats["kv_num_cached_blocks"] > 0
