"""/metrics as a vLLM dashboard reads it: token totals that match the responses' usage.

A stop string is found by the API server; the core runs on until the stop reaches it, and the
tokens it made meanwhile are in no response, so generation_tokens_total leaves them out (as vLLM's
frontend, which counts only the tokens of requests it still follows).
"""
from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server_helpers import get_stats, running_server, wait_for

from minillm.config import EngineConfig
from minillm.engine_core import messages as m
from minillm.engine_core.core import EngineCore
from minillm.engine_core.output_processor import OutputProcessor
from minillm.sampling_params import SamplingParams

MODEL = "stories"
STOP_FIELDS = {"max_tokens": 60, "stop": ["."], "temperature": 0}


def test_tokens_the_core_made_past_a_stop_string_are_reported_as_dropped(stories_path, tok):
    core = EngineCore(EngineConfig(model=str(stories_path), device="cpu"), log=lambda _: None)
    try:
        processor = OutputProcessor(tok)
        prompt = tok.encode("Once upon a time")
        processor.add("r", None, prompt, SamplingParams(**STOP_FIELDS), time.time(), handle=object())
        assert core.add_request(m.AddRequest("r", prompt, dict(STOP_FIELDS), time.time())) is None
        retired, last = [], None
        while not retired:      # the stop never reaches the core: it runs on to max_tokens
            done = processor.process(core.step(), time.time())
            retired, last = done.retired, (done.outputs[-1][1] if done.outputs else last)
        kept = last.outputs[0]
        generated = core.engine.stats().generation_tokens_total
        assert kept.finish_reason == "stop" and len(kept.token_ids) < generated == STOP_FIELDS["max_tokens"]
        assert processor.take_dropped_tokens() == generated - len(kept.token_ids)
        assert processor.take_dropped_tokens() == 0
    finally:
        core.engine.shutdown()


def _generation_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "minillm:generation_tokens":
            return family.samples[0].value
    raise AssertionError("no minillm:generation_tokens_total")


@pytest.fixture(scope="module")
def server(stories_path):
    with running_server(stories_path, served_model_name=MODEL, engine_core="process") as (url, engine):
        yield url, engine


def test_the_core_takes_dropped_tokens_out_of_generation_tokens(server):
    url, engine = server
    body = {"model": MODEL, "prompt": "Once upon a time", **STOP_FIELDS}
    usage = [httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["usage"]["completion_tokens"]
             for _ in range(3)]
    # Late reports of a stop's overrun arrive with the core's last word on each request.
    assert wait_for(lambda: get_stats(url)["generation_tokens_total"] == sum(usage), timeout=20)
    assert _generation_tokens(url) == sum(usage)
    engine._send(m.FinishedCounts({}, engine.client_index, 2))   # what an API server reports after a late stop
    assert wait_for(lambda: _generation_tokens(url) == sum(usage) - 2, timeout=10)
    assert get_stats(url)["generation_tokens_total"] == sum(usage) - 2
