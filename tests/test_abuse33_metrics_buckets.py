"""/metrics histograms have vLLM's bucket bounds (vllm/v1/metrics/loggers.py), so a dashboard built for
vLLM (histogram_quantile over its `le` labels) reads minillm's: the latency lists up to TTFT's 2560 s and
the request phases' 7680 s, the inter-token ones from 10 ms, and the token counts 1-2-5 up to max_model_len."""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server_helpers import running_server

MODEL = "stories"
MAX_MODEL_LEN = 300

TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0, 160.0, 640.0, 2560.0]
PER_TOKEN = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0]
REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]
TOKENS_1_2_5 = [1, 2, 5, 10, 20, 50, 100, 200]      # vLLM's build_1_2_5_buckets(300)
VLLM_BUCKETS = {
    "time_to_first_token_seconds": TTFT,
    "inter_token_latency_seconds": PER_TOKEN,
    "request_time_per_output_token_seconds": PER_TOKEN,
    "e2e_request_latency_seconds": REQUEST_LATENCY,
    "request_queue_time_seconds": REQUEST_LATENCY,
    "request_inference_time_seconds": REQUEST_LATENCY,
    "request_prefill_time_seconds": REQUEST_LATENCY,
    "request_decode_time_seconds": REQUEST_LATENCY,
    "request_prompt_tokens": TOKENS_1_2_5,
    "request_generation_tokens": TOKENS_1_2_5,
    "request_params_max_tokens": TOKENS_1_2_5,
    "request_max_num_generation_tokens": TOKENS_1_2_5,
    "request_params_n": [1, 2, 5, 10, 20],
    "iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
}


@pytest.fixture(scope="module")
def scraped(stories_path):
    """{histogram family: its bucket bounds, +Inf last} from /metrics of a server with max_model_len 300."""
    with running_server(stories_path, served_model_name=MODEL, max_model_len=MAX_MODEL_LEN) as (url, _):
        text = httpx.get(f"{url}/metrics", timeout=10).text
    return {family.name: [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]
            for family in text_string_to_metric_families(text) if family.type == "histogram"}


@pytest.mark.parametrize("name", sorted(VLLM_BUCKETS))
def test_each_histogram_has_vllms_bucket_bounds(scraped, name):
    assert scraped[f"minillm:{name}"] == [str(float(bound)) for bound in VLLM_BUCKETS[name]] + ["+Inf"]


def test_every_histogram_is_one_vllm_has(scraped):
    assert sorted(scraped) == sorted(f"minillm:{name}" for name in VLLM_BUCKETS)


@pytest.mark.parametrize(("max_model_len", "bounds"), [
    (1, [1]), (4, [1, 2]), (100, [1, 2, 5, 10, 20, 50, 100]), (199, [1, 2, 5, 10, 20, 50, 100]),
    (131072, [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]),
])
def test_token_count_buckets_are_1_2_5_up_to_max_model_len(max_model_len, bounds):
    from minillm.server.metrics import buckets_1_2_5
    assert buckets_1_2_5(max_model_len) == bounds
