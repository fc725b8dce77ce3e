"""`minillm serve` held to vLLM's server where a client of vLLM's would notice the difference.

A real server on loopback with a chat template; each test runs with a healthy greedy stream in
flight, and every such stream must end with the text of the same request made alone.
"""
from __future__ import annotations

import pytest
from test_server_helpers import openai_error, raw_stream, sse_events, wait_for
from test_server_helpers import chat_template_server, story_streams  # noqa: F401 (the server and healthy fixtures)

MODEL = "stories"
MESSAGES = [{"role": "user", "content": "Tom had a ball."}]


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, **fields}


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, **fields}


def _events(http, path: str, body: dict) -> list[dict]:
    response = http.post(path, json={**body, "stream": True})
    assert response.status_code == 200, response.text[:500]
    assert response.text.rstrip().endswith("data: [DONE]")
    return sse_events(response.text.splitlines())


BODIES = {"completion": ("/v1/completions", _completion(n=2)), "chat": ("/v1/chat/completions", _chat(n=2))}


@pytest.mark.parametrize("kind", BODIES)
def test_stream_options_include_the_usage_unless_told_not_to_as_in_vllm(http, healthy_stream, kind):
    # vLLM's StreamOptions has include_usage true by default: {} and {"continuous_usage_stats": true}
    # ask for the usage. Both streamed none here (continuous_usage_stats alone added nothing).
    path, body = BODIES[kind]
    [*chunks, last] = _events(http, path, {**body, "stream_options": {}})
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
    assert all(chunk["usage"] is None for chunk in chunks)
    [*chunks, last] = _events(http, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
    assert chunks and all(chunk["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for chunk in chunks)
    for off in ({"include_usage": False}, {"include_usage": None, "continuous_usage_stats": True}):
        events = _events(http, path, {**body, "stream_options": off})
        assert events[-1]["choices"] and all("usage" not in event for event in events)


def test_top_logprobs_zero_without_logprobs_asks_for_nothing(http, healthy_stream):
    # vLLM's chat requests carry top_logprobs 0 by default and refuse only a count above it without
    # logprobs; 0 was a 400 here, so a client that always sends the field could not chat.
    want = http.post("/v1/chat/completions", json=_chat()).json()["choices"]
    for logprobs in (False, None):
        response = http.post("/v1/chat/completions", json=_chat(top_logprobs=0, logprobs=logprobs))
        assert response.status_code == 200, response.text
        assert response.json()["choices"] == want and want[0]["logprobs"] is None
    openai_error(http.post("/v1/chat/completions", json=_chat(top_logprobs=1)), 400, "top_logprobs")
    openai_error(http.post("/v1/chat/completions", json=_chat(top_logprobs=1, logprobs=False)), 400, "top_logprobs")


def test_load_counts_the_generation_requests_in_flight_as_vllm_does(http, server, healthy):
    # vLLM's GET /load ({"server_load": N}, outside /v1) counts the completions and chat completions
    # being answered, a stream until its last event; it was a 404 here.
    healthy.check()                   # the healthy streams of earlier tests have ended: none in flight

    def load() -> int:
        response = http.get("/load")
        assert response.status_code == 200 and set(response.json()) == {"server_load"}
        return response.json()["server_load"]

    assert load() == 0
    openai_error(http.post("/v1/completions", json=_completion(max_tokens=0)), 400, "max_tokens")
    assert http.post("/v1/chat/completions", json=_chat()).status_code == 200
    assert http.post("/tokenize", json={"prompt": "Once"}).status_code == 200
    assert load() == 0
    body = _completion(max_tokens=200, ignore_eos=True, stream=True)
    socks = [raw_stream(server[0], body, num_chunks=2) for _ in range(2)]
    assert wait_for(lambda: load() == 2)
    for sock in socks:
        sock.close()                  # the client leaves: its stream ends, and with it its count
    assert wait_for(lambda: load() == 0)
    assert http.head("/load").status_code == 200
