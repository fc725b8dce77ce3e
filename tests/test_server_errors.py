"""Bad input gets an OpenAI-shaped 4xx naming the field, while a healthy stream runs to completion."""
from __future__ import annotations

import json
import threading

import httpx
import pytest
from test_server_helpers import running_server, sse_events

MODEL = "stories"
KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 64 * 1024
MAX_MODEL_LEN = 256
HEALTHY_TOKENS = 240     # long enough to stay in flight while a test sends its bad request


@pytest.fixture(scope="module")
def server(stories_path):
    # stories260K has no chat template, so chat requests must be refused here.
    with running_server(stories_path, api_key=KEY, served_model_name=MODEL, max_body_bytes=BODY_LIMIT,
                        max_model_len=MAX_MODEL_LEN) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def http(server):
    """One client for the module: building a client per request costs more than the request."""
    with httpx.Client(base_url=server[0], timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def healthy_reference(server):
    url, _ = server
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=30,
                   json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": HEALTHY_TOKENS, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def finished_streams(healthy_reference):
    """Streams the tests leave running; at the end of the module each must have completed intact."""
    runs: list[tuple[threading.Thread, dict]] = []
    yield runs
    for thread, result in runs:
        thread.join(60)
        assert not thread.is_alive()
        assert result == {"text": healthy_reference, "finish": ["length"], "done": True}


@pytest.fixture
def healthy_stream(server, finished_streams):
    """A greedy stream in flight for the whole test; it is checked when the module ends."""
    url, _ = server
    started, result = threading.Event(), {}

    def run():
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": HEALTHY_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, json=body, timeout=60) as response:
            lines = []
            for line in response.iter_lines():
                lines.append(line)
                started.set()
        events = sse_events(lines)
        result["text"] = "".join(e["choices"][0]["text"] for e in events)
        result["finish"] = [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]]
        result["done"] = [line for line in lines if line][-1:] == ["data: [DONE]"]

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(30)
    yield
    assert thread.is_alive(), "the healthy stream had already finished: the test did not overlap it"
    finished_streams.append((thread, result))


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, **fields}


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **fields}


def _without(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


# (id, path, body (dict -> JSON, bytes -> raw), status, param the error must name or None)
CASES = [
    ("malformed-json", "/v1/completions", b'{"model": "stories", "prompt": ', 400, None),
    ("body-not-object", "/v1/completions", b"[1, 2, 3]", 400, None),
    ("wrong-type-max-tokens", "/v1/completions", _completion(max_tokens="many"), 400, "max_tokens"),
    ("wrong-type-temperature", "/v1/completions", _completion(temperature="hot"), 400, "temperature"),
    ("wrong-type-prompt", "/v1/completions", _completion(prompt={"text": "x"}), 400, "prompt"),
    ("wrong-type-stream", "/v1/completions", _completion(stream="maybe"), 400, "stream"),
    ("wrong-type-messages", "/v1/chat/completions", _chat(messages="hello"), 400, "messages"),
    ("missing-prompt", "/v1/completions", _without(_completion(), "prompt"), 400, "prompt"),
    ("missing-messages", "/v1/chat/completions", _without(_chat(), "messages"), 400, "messages"),
    ("empty-messages", "/v1/chat/completions", _chat(messages=[]), 400, "messages"),
    ("empty-prompt", "/v1/completions", _completion(prompt=""), 400, "prompt"),
    ("token-id-out-of-vocab", "/v1/completions", _completion(prompt=[1, 99999]), 400, "prompt"),
    ("unknown-model", "/v1/completions", _completion(model="gpt-7"), 404, "model"),
    ("unknown-model-chat", "/v1/chat/completions", _chat(model="gpt-7"), 404, "model"),
    ("over-context", "/v1/completions", _completion(max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
    ("prompt-over-context", "/v1/completions", _completion(prompt=[1] + [400] * MAX_MODEL_LEN), 400, "prompt"),
    ("temperature-negative", "/v1/completions", _completion(temperature=-0.5), 400, "temperature"),
    ("top-p-zero", "/v1/completions", _completion(top_p=0), 400, "top_p"),
    ("top-k-negative", "/v1/completions", _completion(top_k=-7), 400, "top_k"),
    ("min-p-over-one", "/v1/completions", _completion(min_p=1.5), 400, "min_p"),
    ("n-zero", "/v1/completions", _completion(n=0), 400, "n"),
    ("max-tokens-zero", "/v1/completions", _completion(max_tokens=0), 400, "max_tokens"),
    ("presence-penalty", "/v1/completions", _completion(presence_penalty=3), 400, "presence_penalty"),
    ("frequency-penalty", "/v1/chat/completions", _chat(frequency_penalty=-9), 400, "frequency_penalty"),
    ("repetition-penalty", "/v1/completions", _completion(repetition_penalty=0), 400, "repetition_penalty"),
    ("logprobs-too-many", "/v1/completions", _completion(logprobs=50), 400, "logprobs"),
    ("top-logprobs-without-logprobs", "/v1/chat/completions", _chat(top_logprobs=2), 400, "top_logprobs"),
    ("stop-token-negative", "/v1/completions", _completion(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("no-chat-template", "/v1/chat/completions", _chat(), 400, "messages"),
    ("body-too-large", "/v1/completions", _completion(prompt="x " * BODY_LIMIT), 413, None),
]


def _check_error_shape(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("path,body,status,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_a_clear_error(http, healthy_stream, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = http.post(path, content=content,
                         headers={**AUTH, "Content-Type": "application/json"})
    _check_error_shape(response, status, param)


def test_chat_without_template_says_so(http, healthy_stream):
    for stream in (False, True):
        response = http.post("/v1/chat/completions", headers=AUTH, json=_chat(stream=stream))
        error = _check_error_shape(response, 400, "messages")
        assert "chat template" in error["message"]


def test_streaming_bad_input_is_an_error_status_not_a_stream(http, healthy_stream):
    response = http.post("/v1/completions", headers=AUTH, json=_completion(stream=True, temperature=-1))
    _check_error_shape(response, 400, "temperature")


def test_chunked_body_over_limit_is_413(http, healthy_stream):

    def chunks():
        yield b'{"model": "stories", "prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    response = http.post("/v1/completions", content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    _check_error_shape(response, 413, None)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}],
                         ids=["missing", "wrong", "not-bearer"])
def test_api_key_is_required(http, healthy_stream, headers):
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                         ("GET", "/v1/stats"), ("GET", "/v1/stats/stream"), ("GET", "/metrics")):
        response = http.request(method, path, headers=headers, json=_completion())
        error = _check_error_shape(response, 401, None)
        assert error["code"] == "invalid_api_key"
    assert http.get("/health").status_code == 200
    assert http.get("/v1/models", headers=AUTH).status_code == 200


def test_bad_stats_query(http, healthy_stream):
    _check_error_shape(http.get("/v1/stats?cells=0", headers=AUTH), 400, "cells")
    _check_error_shape(http.get("/v1/stats?cells=abc", headers=AUTH), 400, "cells")
    _check_error_shape(http.get("/v1/stats/stream?interval=0", headers=AUTH), 400, "interval")
    _check_error_shape(http.get("/v1/nothing-here", headers=AUTH), 404, None)
