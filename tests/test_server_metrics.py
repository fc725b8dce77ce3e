"""/metrics (Prometheus text), /v1/stats and /v1/stats/stream against a real server."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import threading
import time
import types

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server_helpers import running_server, wait_for

from minillm.config import EngineConfig
from minillm.server.app import ServerOptions, run_server
from minillm.stats import EngineStats, StepStats

MODEL = "stories"
GAUGES = ("minillm:num_requests_running", "minillm:num_requests_waiting", "minillm:kv_cache_usage_perc")
COUNTERS = ("minillm:prefix_cache_queries", "minillm:prefix_cache_hits", "minillm:num_preemptions",
            "minillm:prompt_tokens", "minillm:generation_tokens", "minillm:request_success")
HISTOGRAMS = ("minillm:time_to_first_token_seconds", "minillm:inter_token_latency_seconds",
              "minillm:e2e_request_latency_seconds")


LOG_INTERVAL = 0.2


@pytest.fixture(scope="module")
def server(stories_path):
    with running_server(stories_path, served_model_name=MODEL, log_interval=LOG_INTERVAL) as (url, engine):
        yield url, engine


def scrape(http: httpx.Client) -> dict:
    """{(sample name, frozen labels): value} and the family types, from /metrics."""
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples, types = {}, {}
    for family in text_string_to_metric_families(response.text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return {"samples": samples, "types": types}


def value(scraped: dict, name: str, **labels) -> float:
    return scraped["samples"][(name, frozenset({"model_name": MODEL, **labels}.items()))]


def test_metrics_parse_with_vllm_style_names(http):
    scraped = scrape(http)
    for name in GAUGES:
        assert scraped["types"][name] == "gauge"
    for name in COUNTERS:
        assert scraped["types"][name] == "counter"
    for name in HISTOGRAMS:
        assert scraped["types"][name] == "histogram"
    assert value(scraped, "minillm:num_requests_running") == 0
    assert 0 <= value(scraped, "minillm:kv_cache_usage_perc") <= 1


def test_counters_and_histograms_move_as_requests_complete(http):
    before = scrape(http)
    prompt = [1, 403, 407, 261, 378]
    for _ in range(3):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                               "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
    after = scrape(http)

    def moved(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # vLLM's meaning: each request's whole prompt once; the computed part is the prefill counter.
    assert moved("minillm:prompt_tokens_total") == 3 * len(prompt)
    assert moved("minillm:prefill_tokens_total") == 3 * len(prompt) - moved("minillm:prefix_cache_hits_total")
    assert moved("minillm:prompt_tokens_by_source_total", source="local_compute") \
        == moved("minillm:prefill_tokens_total")
    assert moved("minillm:prompt_tokens_by_source_total", source="local_cache_hit") \
        == moved("minillm:prompt_tokens_cached_total") == moved("minillm:prefix_cache_hits_total")
    assert moved("minillm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert moved("minillm:generation_tokens_total") == 3 * 8
    assert moved("minillm:request_success_total", finished_reason="length") == 3
    assert moved("minillm:prefix_cache_queries_total") >= 3 * len(prompt) - 3
    assert moved("minillm:time_to_first_token_seconds_count") == 3
    assert moved("minillm:e2e_request_latency_seconds_count") == 3
    assert moved("minillm:inter_token_latency_seconds_count") == 3 * 7   # one gap between each pair of tokens
    assert moved("minillm:e2e_request_latency_seconds_sum") > 0
    assert moved("minillm:time_to_first_token_seconds_bucket", le="+Inf") == 3


def test_stats_has_engine_stats_fields_and_bounded_block_map(http):
    stats = http.get("/v1/stats", params={"cells": 16}).json()
    assert set(stats) == {f.name for f in dataclasses.fields(EngineStats)}
    assert 1 <= len(stats["block_map"]) <= 16
    assert len(stats["block_map"]) * stats["block_map_blocks_per_cell"] >= stats["kv_num_blocks"]
    assert stats["model"] and stats["kv_num_blocks"] > 0
    default = http.get("/v1/stats").json()
    assert len(default["block_map"]) <= 64
    if default["recent_steps"]:
        assert set(default["recent_steps"][-1]) == {f.name for f in dataclasses.fields(StepStats)}


def test_the_host_tier_block_map_is_downsampled_like_the_pools(stories_path):
    from minillm import LLM, SamplingParams
    from minillm.engine_core.core import FULL_RESOLUTION
    from minillm.server.stats_hub import StatsHub, with_cells
    llm = LLM(str(stories_path), device="cpu", num_kv_blocks=16, max_model_len=64, kv_offload_gib=0.01)
    llm.generate(["Once upon a time"] * 4, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    full = llm.engine.stats(FULL_RESOLUTION)
    assert len(full.kv_offload_block_map) == full.kv_offload_num_blocks > 100
    small = with_cells(full, 16)
    assert len(small.block_map) == 16 and 1 <= len(small.kv_offload_block_map) <= 16
    # The stats stream's event at that resolution is the same snapshot.
    event = StatsHub(engine=None, min_interval=0.1, max_subscribers=1)._render(full, 16)
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event[len("data: "):]) == json.loads(json.dumps(small.to_dict()))


def test_stats_stream_pushes_several_snapshots_a_second(server, http):
    url, _ = server
    stop = threading.Event()

    def keep_busy():
        while not stop.is_set():
            http.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 64,
                                               "ignore_eos": True})

    worker = threading.Thread(target=keep_busy, daemon=True)
    worker.start()
    events, start = [], time.monotonic()
    try:
        with httpx.stream("GET", f"{url}/v1/stats/stream", params={"cells": 8, "interval": 0.1},
                          timeout=10) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                if time.monotonic() - start > 1.0:
                    break
    finally:
        stop.set()
        worker.join(30)
    assert len(events) >= 5
    assert all(len(e["block_map"]) <= 8 for e in events)
    assert [e["time"] for e in events] == sorted(e["time"] for e in events)
    assert any(e["num_running"] >= 1 for e in events)
    assert any(e["recent_steps"] for e in events)
    busy = [e for e in events if e["num_running"]]
    assert any(s["num_decode_tokens"] + s["num_prefill_tokens"] > 0 for e in busy for s in e["recent_steps"])


def test_health_and_models(http):
    assert http.get("/health").status_code == 200
    data = http.get("/v1/models").json()["data"]
    assert data[0]["id"] == MODEL and data[0]["max_model_len"] > 0


def test_run_server_with_monitor_serves_while_the_dashboard_runs(stories_path, monkeypatch):
    seen = {}

    def fake_run_monitor(url, api_key=None):
        # Stands in for the Textual dashboard: the real engine and server must answer meanwhile.
        seen["url"], seen["api_key"] = url, api_key
        seen["health"] = httpx.get(f"{url}/health", timeout=10).status_code
        seen["stats"] = httpx.get(f"{url}/v1/stats", headers={"Authorization": f"Bearer {api_key}"},
                                  timeout=10).json()["kv_num_blocks"]

    monkeypatch.setitem(sys.modules, "minillm.tui.app", types.SimpleNamespace(run_monitor=fake_run_monitor))
    # Port 0: the server binds a free port and hands the dashboard the URL it bound.
    status = run_server(EngineConfig(model=str(stories_path), device="cpu"), port=0,
                        options=ServerOptions(api_key="k"), monitor=True)
    assert status == 0
    assert re.fullmatch(r"http://127\.0\.0\.1:[1-9]\d*", seen["url"]) and seen["api_key"] == "k"
    assert seen["health"] == 200 and seen["stats"] > 0


def test_stats_stream_ends_promptly_when_the_server_stops(stories_path):
    events, ended = [], threading.Event()
    with running_server(stories_path, served_model_name=MODEL) as (url, _):
        def watch():
            with httpx.stream("GET", f"{url}/v1/stats/stream", params={"interval": 0.2}, timeout=30) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)
            ended.set()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        assert wait_for(lambda: len(events) >= 2, timeout=10)
        stopped_at = time.monotonic()
    assert ended.wait(5)
    assert time.monotonic() - stopped_at < 1.5   # not held until the graceful-shutdown timeout


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_throughput_line_is_logged_while_busy(http):
    logger = logging.getLogger("minillm.server")
    handler, level = _ListHandler(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200,
                                               "ignore_eos": True})
        assert r.status_code == 200
        time.sleep(3 * LOG_INTERVAL)
        lines = [m for m in handler.messages if "Avg generation throughput" in m]
        assert lines
        assert all(key in lines[-1] for key in ("Avg prompt throughput", "Running:", "Waiting:", "KV cache usage"))
        handler.messages.clear()
        time.sleep(3 * LOG_INTERVAL)       # idle: nothing to report
        assert not [m for m in handler.messages if "throughput" in m]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _cpu_seconds(stat_path: str) -> float:
    fields = open(stat_path).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_idle_engine_sleeps(server):
    _, engine = server
    # The engine's thread here (the engine loop, or the reader of the core's outputs) and the engine
    # core process, if it has one.
    paths = [f"/proc/self/task/{engine._thread.native_id}/stat"]
    if getattr(engine, "core_pid", None):
        paths.append(f"/proc/{engine.core_pid}/stat")
    before = [_cpu_seconds(path) for path in paths]
    time.sleep(0.5)
    for path, start in zip(paths, before):
        assert _cpu_seconds(path) - start < 0.05, path    # blocked on its queue or socket, not spinning


def test_batched_histogram_counts_as_prometheus_observe_does():
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from minillm.server.metrics import TTFT_BUCKETS, BatchedHistogram

    def child(registry):
        return Histogram("minillm:gap_seconds", "gaps", labelnames=["model_name"], buckets=TTFT_BUCKETS,
                         registry=registry).labels(MODEL)

    direct, batched_registry = CollectorRegistry(), CollectorRegistry()
    plain, batched = child(direct), BatchedHistogram(child(batched_registry))
    # Every bound exactly (a bucket holds values <= its bound), values between and beyond them, zero.
    values = [0.0, *TTFT_BUCKETS, *(b * 1.5 for b in TTFT_BUCKETS), 1e9]
    values += [i * 0.0007 for i in range(3 * BatchedHistogram.FLUSH_EVERY)]   # flushes on its own too
    for v in values:
        plain.observe(v)
        batched.observe(v)
    assert batched.num_pending < len(values)
    batched.flush()
    assert batched.num_pending == 0

    def samples(registry):
        text = generate_latest(registry).decode()
        return {(s.name, frozenset(s.labels.items())): s.value for family in text_string_to_metric_families(text)
                for s in family.samples if not s.name.endswith("_created")}

    got, expected = samples(batched_registry), samples(direct)
    assert got.keys() == expected.keys()
    for key, count in expected.items():     # the bucket counts exactly; the sum up to rounding order
        assert got[key] == pytest.approx(count, rel=1e-12) if key[0].endswith("_sum") else got[key] == count, key
