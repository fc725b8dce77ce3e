"""Bad input gets an OpenAI-shaped 4xx naming the field, while a healthy stream runs to completion."""
from __future__ import annotations

import json

import httpx
import pytest
from test_server_helpers import HealthyStreams, running_server

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
def healthy(server):
    """Healthy streams the tests leave running; at the end of the module each must have completed intact."""
    streams = HealthyStreams(server[0], {"model": MODEL, "prompt": "Once upon a time", "max_tokens": HEALTHY_TOKENS},
                             headers=AUTH)
    yield streams
    streams.check()


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
    # Values that once reached the sampler and killed the engine (an int32 overflow, an index past the
    # vocabulary of 512 in the early-stop mask; a top_k past it is now the whole vocabulary, as in vLLM).
    ("stop-token-past-vocab", "/v1/completions", _completion(min_tokens=2, stop_token_ids=[100000]), 400,
     "stop_token_ids"),
    ("stop-token-past-int32", "/v1/completions", _completion(min_tokens=2, stop_token_ids=[2**40]), 400,
     "stop_token_ids"),
    ("chat-stop-token-past-vocab", "/v1/chat/completions", _chat(min_tokens=2, stop_token_ids=[512]), 400,
     "stop_token_ids"),
    # NaN and infinity (Python's JSON reader takes NaN, Infinity and 1e400), and "inf" as a string.
    ("temperature-nan", "/v1/completions", b'{"prompt": "Once", "max_tokens": 4, "temperature": NaN}', 400,
     "temperature"),
    ("temperature-infinity", "/v1/completions", b'{"prompt": "Once", "max_tokens": 4, "temperature": Infinity}',
     400, "temperature"),
    ("temperature-1e400", "/v1/completions", b'{"prompt": "Once", "max_tokens": 4, "temperature": 1e400}', 400,
     "temperature"),
    ("temperature-inf-string", "/v1/completions", _completion(temperature="inf"), 400, "temperature"),
    ("repetition-penalty-nan", "/v1/completions",
     b'{"prompt": "Once", "max_tokens": 4, "repetition_penalty": NaN}', 400, "repetition_penalty"),
    ("top-p-nan", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "top_p": NaN}', 400,
     "top_p"),
    # Values read as vLLM's pydantic models read them (lax: "8" is 8, "true" and 1 are true), and no further:
    # a fraction is no integer, 2 or "sure" no boolean (test_abuse38_coercion.py has what is taken).
    ("max-tokens-fraction", "/v1/completions", _completion(max_tokens=8.5), 400, "max_tokens"),
    ("logprobs-word", "/v1/completions", _completion(logprobs="all"), 400, "logprobs"),
    ("n-fraction", "/v1/completions", _completion(n=1.5), 400, "n"),
    ("stream-two", "/v1/completions", _completion(stream=2), 400, "stream"),
    ("echo-word", "/v1/completions", _completion(echo="sure"), 400, "echo"),
    ("seed-fraction-string", "/v1/completions", _completion(seed="4.2"), 400, "seed"),
    ("seed-past-int64", "/v1/completions", _completion(seed=2**63), 400, "seed"),
    ("seed-below-int64", "/v1/completions", _completion(seed=-2**63 - 1), 400, "seed"),
    ("seed-past-64-bits", "/v1/completions", _completion(seed=2**64), 400, "seed"),
    ("prompt-ids-fraction", "/v1/completions", _completion(prompt=[1.5, 2]), 400, "prompt"),
    ("include-usage-word", "/v1/completions",
     _completion(stream=True, stream_options={"include_usage": "sometimes"}), 400, "stream_options.include_usage"),
    # Text that is not valid Unicode (a lone surrogate) anywhere a string goes.
    ("surrogate-prompt", "/v1/completions", b'{"prompt": "abc \\ud800 def", "max_tokens": 4}', 400, "prompt"),
    ("surrogate-prompt-batch", "/v1/completions", b'{"prompt": ["ok", "abc \\udfff"], "max_tokens": 4}', 400,
     "prompt.1"),
    ("surrogate-model", "/v1/completions", b'{"model": "x\\ud800", "prompt": "abc", "max_tokens": 4}', 400,
     "model"),
    ("surrogate-stop", "/v1/completions", b'{"prompt": "abc", "stop": ["\\ud800"], "max_tokens": 4}', 400,
     "stop.0"),
    ("surrogate-content", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', 400,
     "messages.0.content"),
    ("surrogate-content-part", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc80"}]}]}', 400,
     "messages.0.content.0.text"),
    ("surrogate-role", "/v1/chat/completions", b'{"messages": [{"role": "us\\ud800er", "content": "a"}]}', 400,
     "messages.0.role"),
    ("content-part-type-not-a-string", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": 5, "text": "a"}]}]}', 400, "messages.0.content.0.type"),
    ("surrogate-name", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "a", "name": "\\ud800"}]}', 400, "messages.0.name"),
    # ... and as an object's key: the param is the object's field, not the key read as U+FFFD.
    ("surrogate-logit-bias-key", "/v1/completions", b'{"prompt": "abc", "logit_bias": {"\\ud800": 1}}', 400,
     "logit_bias"),
    ("surrogate-template-kwargs-key", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"\\ud800": 1}}', 400,
     "chat_template_kwargs"),
    # logit_bias: OpenAI's shape (token ids as object keys, biases in [-100, 100]), ids inside the vocabulary.
    ("logit-bias-key-not-an-id", "/v1/completions", _completion(logit_bias={"the": 1}), 400, "logit_bias"),
    ("logit-bias-negative-key", "/v1/completions", _completion(logit_bias={"-3": 1}), 400, "logit_bias"),
    ("logit-bias-past-vocab", "/v1/completions", _completion(logit_bias={"512": 1}), 400, "logit_bias"),
    ("logit-bias-nan", "/v1/completions", b'{"prompt": "Once", "max_tokens": 4, "logit_bias": {"5": NaN}}', 400,
     "logit_bias.5"),
    ("logit-bias-string-value", "/v1/completions", _completion(logit_bias={"5": "high"}), 400, "logit_bias.5"),
    # vLLM's allowed_token_ids and bad_words: a non-empty list of ids in the vocabulary, words that tokenize.
    ("allowed-token-ids-empty", "/v1/completions", _completion(allowed_token_ids=[]), 400, "allowed_token_ids"),
    ("allowed-token-ids-negative", "/v1/completions", _completion(allowed_token_ids=[1, -1]), 400,
     "allowed_token_ids"),
    ("allowed-token-ids-past-vocab", "/v1/completions", _completion(allowed_token_ids=[1, 512]), 400,
     "allowed_token_ids"),
    ("allowed-token-ids-not-ints", "/v1/completions", _completion(allowed_token_ids=[1, "two"]), 400,
     "allowed_token_ids.1"),
    ("bad-words-not-a-list", "/v1/chat/completions", _chat(bad_words="the"), 400, "bad_words"),
    ("bad-words-not-strings", "/v1/completions", _completion(bad_words=["the", 5]), 400, "bad_words.1"),
    ("bad-words-of-no-tokens", "/v1/completions", _completion(bad_words=["the", " "]), 400, "bad_words"),
    ("bad-words-too-many", "/v1/completions", _completion(bad_words=["the"] * 129), 400, "bad_words"),
    # Beam search's steps are single-token requests: refused where they cannot honour the field.
    ("use-beam-search-stream", "/v1/completions", _completion(use_beam_search=True, stream=True), 400, "stream"),
    # Chat fields this server refuses rather than ignores.
    ("role-empty", "/v1/chat/completions", _chat(messages=[{"role": "", "content": "hi"}]), 400, "messages.0.role"),
    ("functions", "/v1/chat/completions", _chat(functions=[{"name": "f", "parameters": {}}]), 400, "functions"),
    ("function-call", "/v1/chat/completions", _chat(function_call={"name": "f"}), 400, "function_call"),
    ("tools-auto", "/v1/chat/completions", _chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "tool_choice"),
    ("request-chat-template-untrusted", "/v1/chat/completions", _chat(chat_template="{{ messages }}"), 400,
     "chat_template"),
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
        assert "chat template" in error["message"] and "--chat-template" in error["message"]
        assert error["code"] == "no_chat_template"


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
                         ("GET", "/v1/stats"), ("GET", "/v1/stats/stream"), ("GET", "/v1/nothing-here")):
        response = http.request(method, path, headers=headers, json=_completion())
        error = _check_error_shape(response, 401, None)
        assert error["code"] == "invalid_api_key"
    # As vLLM: the key guards /v1; a health probe and a Prometheus scrape need none.
    assert http.get("/health").status_code == 200
    assert http.get("/metrics").status_code == 200
    assert http.get("/v1/models", headers=AUTH).status_code == 200


def test_bad_stats_query(http, healthy_stream):
    _check_error_shape(http.get("/v1/stats?cells=0", headers=AUTH), 400, "cells")
    _check_error_shape(http.get("/v1/stats?cells=abc", headers=AUTH), 400, "cells")
    _check_error_shape(http.get("/v1/stats/stream?interval=0", headers=AUTH), 400, "interval")
    _check_error_shape(http.get("/v1/nothing-here", headers=AUTH), 404, None)
