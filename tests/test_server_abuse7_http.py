"""HTTP-level abuse: methods a route does not take, Authorization casing, compressed bodies, bodies
the JSON reader refuses for reasons other than syntax, and a logit_bias key too long to be a token id.

A real server on loopback with an API key; each test runs with a healthy greedy stream in flight,
and every such stream must end with the text of the same request made alone.
"""
from __future__ import annotations

import gzip
import json

import pytest
from test_server_helpers import HealthyStreams, openai_error, running_server

MODEL = "stories"
KEY = "sk-abuse7"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(stories_path):
    with running_server(stories_path, api_key=KEY, served_model_name=MODEL, max_model_len=256) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def healthy(server):
    streams = HealthyStreams(server[0], {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200},
                             headers=AUTH)
    yield streams
    streams.check()


@pytest.mark.parametrize("method,path,allowed", [
    ("GET", "/v1/completions", {"POST"}),
    ("PUT", "/v1/chat/completions", {"POST"}),
    ("DELETE", "/v1/models", {"GET", "HEAD"}),
    ("POST", "/health", {"GET", "HEAD"}),
])
def test_method_not_allowed_names_the_allowed_methods(http, healthy_stream, method, path, allowed):
    response = http.request(method, path, headers=AUTH)
    openai_error(response, 405)
    # RFC 9110 15.5.6: a 405 must say which methods the resource takes.
    assert {m.strip() for m in response.headers["allow"].split(",")} == allowed


@pytest.mark.parametrize("path", ["/health", "/v1/models", f"/v1/models/{MODEL}", "/metrics"])
def test_head_answers_as_get_without_a_body(http, healthy_stream, path):
    got = http.get(path, headers=AUTH)
    head = http.head(path, headers=AUTH)
    assert got.status_code == head.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == got.headers["content-type"]


@pytest.mark.parametrize("authorization", [f"bearer {KEY}", f"BEARER {KEY}", f"Bearer  {KEY}"])
def test_bearer_scheme_is_case_insensitive(http, healthy_stream, authorization):
    assert http.get("/v1/models", headers={"Authorization": authorization}).status_code == 200


@pytest.mark.parametrize("authorization", [f"bearer {KEY}x", f"Basic {KEY}", KEY, "Bearer", f"Bearer{KEY}",
                                           f"Bearer {KEY.upper()}"])
def test_other_credentials_are_still_refused(http, healthy_stream, authorization):
    openai_error(http.get("/v1/models", headers={"Authorization": authorization}), 401, code="invalid_api_key")


def test_compressed_body_is_refused_by_name(http, healthy_stream):
    body = gzip.compress(b'{"model": "stories", "prompt": "Once", "max_tokens": 2}')
    response = http.post("/v1/completions", content=body,
                         headers={**AUTH, "Content-Type": "application/json", "Content-Encoding": "gzip"})
    error = openai_error(response, 415, code="unsupported_content_encoding")
    assert "gzip" in error["message"]
    plain = http.post("/v1/completions", content=gzip.decompress(body),
                      headers={**AUTH, "Content-Type": "application/json", "Content-Encoding": "identity"})
    assert plain.status_code == 200, plain.text


@pytest.mark.parametrize("body,reason", [
    (b'{"prompt": "a\xff\xfeb", "max_tokens": 2}', "not UTF-8"),
    (b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", "too many digits"),
    (b'{"prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b'{"prompt": "a", "max_tokens": }', "Expecting value at character 30"),
], ids=["invalid-utf8", "huge-integer", "deep-nesting", "syntax"])
def test_unreadable_json_says_why(http, healthy_stream, body, reason):
    response = http.post("/v1/completions", content=body, headers={**AUTH, "Content-Type": "application/json"})
    error = openai_error(response, 400, code="json_invalid")
    assert error["message"].startswith("malformed JSON in request body: ") and reason in error["message"], error


def test_logit_bias_key_of_thousands_of_digits_names_the_field(http, healthy_stream):
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 2, "logit_bias": {"9" * 5000: 1.0}}
    error = openai_error(http.post("/v1/completions", json=body, headers=AUTH), 400, "logit_bias")
    assert "5000 digits" in error["message"]


def test_logit_bias_naming_one_token_twice_is_refused(http, healthy_stream):
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 2, "logit_bias": {"5": 1.0, "0005": -100}}
    error = openai_error(http.post("/v1/completions", json=body, headers=AUTH), 400, "logit_bias")
    assert error["message"] == "logit_bias names token 5 twice ('5' and '0005')"


def test_field_name_that_is_not_unicode_is_called_a_field_name(http, healthy_stream):
    body = b'{"model": "stories", "prompt": "Once", "max_tokens": 2, "\\ud800": 1}'
    response = http.post("/v1/completions", content=body, headers={**AUTH, "Content-Type": "application/json"})
    error = openai_error(response, 400, None)
    assert "field name that is not valid Unicode" in error["message"], error


def test_json_schema_with_integers_past_64_bits(http, healthy_stream):
    # JSON has no integer limit and a schema may hold a large bound; the engine core is reached
    # through msgpack, which has one.
    schema = {"type": "object", "properties": {"id": {"const": 10**30}}, "required": ["id"],
              "additionalProperties": False}
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 64, "temperature": 0,
            "structured_outputs": {"json": schema}}
    response = http.post("/v1/completions", json=body, headers=AUTH)
    assert response.status_code == 200, response.text[:500]
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert json.loads(choice["text"]) == {"id": 10**30}


def test_truncate_prompt_tokens_keeps_the_last_tokens_of_a_prompt_past_the_context(http, healthy_stream):
    ids = [1] + [3 + (11 * i) % 400 for i in range(299)]             # 300 tokens, past max_model_len 256
    common = {"model": MODEL, "max_tokens": 5, "temperature": 0}
    cut = http.post("/v1/completions", json={**common, "prompt": ids, "truncate_prompt_tokens": 50}, headers=AUTH)
    alone = http.post("/v1/completions", json={**common, "prompt": ids[-50:]}, headers=AUTH)
    assert cut.status_code == 200 and alone.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == 50
    assert cut.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    echoed = http.post("/v1/completions", json={**common, "prompt": ids, "truncate_prompt_tokens": 50, "echo": True},
                       headers=AUTH).json()["choices"][0]["text"]
    assert len(echoed) > len(cut.json()["choices"][0]["text"]) and echoed.endswith(cut.json()["choices"][0]["text"])
    for bad in (0, -2):
        body = {**common, "prompt": ids, "truncate_prompt_tokens": bad}
        openai_error(http.post("/v1/completions", json=body, headers=AUTH), 400, "truncate_prompt_tokens")
