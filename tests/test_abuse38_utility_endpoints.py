"""vLLM's endpoints beside generation, as vLLM answers them: /v1/models under a trailing slash, /metrics
restricted by name[] and gzipped, and which endpoints --api-key leaves open.

One server for the module: an API key, two served names and a --root-path prefix.
"""
from __future__ import annotations

import gzip

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server_helpers import running_server

from minillm.server.app import ServerOptions

NAMES = ("stories", "alias")
KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROOT = "/llm"


@pytest.fixture(scope="module")
def server(stories_path):
    with running_server(stories_path, api_key=KEY, served_model_name=NAMES,
                        options=ServerOptions(root_path=ROOT), max_model_len=256) as (url, engine):
        yield url, engine


@pytest.mark.parametrize("prefix", ["", ROOT])
def test_models_with_a_trailing_slash_redirect_to_the_list(http, prefix):
    response = http.get(f"{prefix}/v1/models/?x=1", headers=AUTH)
    assert response.status_code == 307, response.text
    assert response.headers["location"].endswith(f"{prefix}/v1/models?x=1")
    listed = http.get(response.headers["location"], headers=AUTH).json()
    assert [card["id"] for card in listed["data"]] == list(NAMES)
    followed = http.get(f"{prefix}/v1/models/", headers=AUTH, follow_redirects=True).json()
    assert followed["object"] == "list" and [card["id"] for card in followed["data"]] == list(NAMES)
    assert http.get(f"{prefix}/v1/models/", follow_redirects=False).status_code == 401


def _families(text: str) -> dict[str, set[str]]:
    """Family name -> the names of its samples."""
    return {family.name: {sample.name for sample in family.samples}
            for family in text_string_to_metric_families(text)}


def test_metrics_name_parameters_keep_only_those_series(http):
    wanted = ["minillm:num_requests_running", "minillm:prompt_tokens_total",
              "minillm:time_to_first_token_seconds_count"]
    response = http.get("/metrics", params=[("name[]", name) for name in wanted])
    assert response.status_code == 200
    assert _families(response.text) == {"minillm:num_requests_running": {"minillm:num_requests_running"},
                                        "minillm:prompt_tokens": {"minillm:prompt_tokens_total"},
                                        "minillm:time_to_first_token_seconds":
                                            {"minillm:time_to_first_token_seconds_count"}}
    assert http.get("/metrics", params={"name[]": "minillm:no_such_series"}).text == ""
    everything = _families(http.get("/metrics").text)
    assert {"minillm:num_requests_waiting", "minillm:kv_cache_usage_perc"} <= set(everything)


def test_metrics_are_gzipped_only_for_a_scraper_that_accepts_it(http):
    plain = http.get("/metrics", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in plain.headers
    assert plain.text.startswith("# HELP minillm:")
    with http.stream("GET", "/metrics", headers={"Accept-Encoding": "gzip"}) as zipped:
        assert zipped.headers["content-encoding"] == "gzip"
        raw = b"".join(zipped.iter_raw())
    assert _families(gzip.decompress(raw).decode()).keys() == _families(plain.text).keys()


# (method, path, body): each open without the key as vLLM leaves it (its guard is /v1's);
# /invocations generates, so minillm guards it as /v1.
OPEN = [("GET", "/health", None), ("GET", "/ping", None), ("POST", "/ping", None), ("GET", "/version", None),
        ("GET", "/load", None), ("GET", "/metrics", None), ("GET", "/openapi.json", None),
        ("POST", "/tokenize", {"prompt": "Once"}), ("POST", "/detokenize", {"tokens": [1, 403]})]
GUARDED = [("GET", "/v1/models", None), ("GET", "/v1/models/stories", None), ("GET", "/v1/stats", None),
           ("POST", "/invocations", {"prompt": "Once", "max_tokens": 1})]


@pytest.mark.parametrize("prefix", ["", ROOT])
@pytest.mark.parametrize(("method", "path", "body"), OPEN + GUARDED)
def test_the_api_key_guards_v1_and_invocations_only(http, prefix, method, path, body):
    bare = http.request(method, prefix + path, json=body)
    if (method, path, body) in OPEN:
        assert bare.status_code == 200, bare.text
        return
    assert bare.status_code == 401
    assert bare.json()["error"]["code"] == "invalid_api_key"
    assert http.request(method, prefix + path, json=body, headers=AUTH).status_code == 200


@pytest.mark.parametrize(("method", "path", "allow"), [("POST", "/health", "GET, HEAD"), ("GET", "/tokenize", "POST"),
                                                      ("DELETE", "/v1/models", "GET, HEAD"), ("PUT", "/ping", None)])
def test_a_wrong_method_is_a_json_405_naming_the_allowed_ones(http, method, path, allow):
    response = http.request(method, path, headers=AUTH)
    assert response.status_code == 405
    assert response.json()["error"]["message"] == "Method Not Allowed"
    if allow is not None:
        assert set(response.headers["allow"].split(", ")) == set(allow.split(", "))


def test_openapi_names_each_operation_once(http):
    spec = http.get(f"{ROOT}/openapi.json").json()
    ids = {(path, method): operation["operationId"] for path, operations in spec["paths"].items()
           for method, operation in operations.items()}
    assert len(set(ids.values())) == len(ids)
    assert ids["/health", "get"] == "health_health_get" and ids["/health", "head"] == "health_health_head"
    assert ids["/ping", "post"] == "health_ping_post"


@pytest.mark.parametrize(("body", "reason"), [(b'{"prompt": "\xff"}', "not UTF-8 text (byte 0xff at 12)"),
                                              (b"\xff\xfe{", "not UTF-16-LE text (byte 0x7b at 2)")])
def test_a_body_that_does_not_decode_names_the_encoding_it_was_read_in(http, body, reason):
    response = http.post("/tokenize", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == f"malformed JSON in request body: the body is {reason}"
