"""A JSON answer with hundreds of thousands of log-probability entries is built off the event loop
(it takes seconds of Python: on the loop, /health and every stream waited for it)."""
from __future__ import annotations

import asyncio

import httpx
import pytest
from test_server_helpers import running_server

from minillm.server import serving
from minillm.server.serving_completion import CompletionJob


def _on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.fixture(scope="module")
def server(stories_path):
    with running_server(stories_path, served_model_name="stories") as (url, _engine):
        yield url


def test_a_large_json_answer_is_built_off_the_loop_and_a_small_one_on_it(server, monkeypatch):
    built = []
    original = CompletionJob.response

    def response(self, finals):
        built.append((serving.response_entries(finals), _on_a_loop()))
        return original(self, finals)

    monkeypatch.setattr(CompletionJob, "response", response)
    body = {"model": "stories", "prompt": "Once upon a time", "temperature": 1.0, "seed": 1, "ignore_eos": True}
    large = httpx.post(f"{server}/v1/completions", timeout=300,
                       json={**body, "n": 8, "max_tokens": 200, "logprobs": 20})
    small = httpx.post(f"{server}/v1/completions", timeout=300, json={**body, "max_tokens": 8})
    assert large.status_code == small.status_code == 200, (large.text[:300], small.text)
    choices = large.json()["choices"]
    assert len(choices) == 8 and all(len(c["logprobs"]["top_logprobs"]) == 200 for c in choices)
    (large_entries, large_on_loop), (small_entries, small_on_loop) = built
    assert large_entries >= serving.LARGE_RESPONSE_ENTRIES > small_entries
    assert (large_on_loop, small_on_loop) == (False, True)
