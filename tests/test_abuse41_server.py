"""Server: the client's request id as a hostile client sends it. Several X-Request-Id headers: the
first names the response and is the header echoed (vLLM's reading); one of UTF-8 bytes names the
response in the text the client sent; an id past MAX_REQUEST_ID_CHARS, in the header or the body's
request_id, is a 400 naming it (each of a stream's events carries the id); a chat stream of n > 1
hung up under an id a greedy stream also runs under leaves that stream its solo text. A body's
Content-Encoding is every such header's list: a gzipped body is a 415 whichever header says gzip,
and identity, however often, is no coding."""
from __future__ import annotations

import gzip
import json
import socket

import httpx
import pytest
from test_server_helpers import (  # noqa: F401 (story_streams: the healthy fixture)
    CHAT_TEMPLATE, get_stats, openai_error, running_server, story_streams, wait_for,
)

from minillm.server.app import ServerOptions
from minillm.server.serving import MAX_REQUEST_ID_CHARS

MODEL = "stories"
COMPLETION = {"model": MODEL, "prompt": "Tom had a red ball", "max_tokens": 3, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tom had a red ball"}], "max_tokens": 3,
        "temperature": 0}
RESPONSE = {"model": MODEL, "input": "Tom had a red ball", "max_output_tokens": 3, "temperature": 0}
ROUTES = [("/v1/completions", COMPLETION, "cmpl"), ("/v1/chat/completions", CHAT, "chatcmpl"),
          ("/v1/responses", RESPONSE, "resp")]


@pytest.fixture(scope="module")
def server(stories_path):
    """(url, engine): stories260K with the tests' chat template and X-Request-Id on every response."""
    options = ServerOptions(chat_template=CHAT_TEMPLATE, request_id_headers=True)
    with running_server(stories_path, max_model_len=256, options=options) as running:
        yield running


def post(url: str, path: str, body: dict, headers: list[tuple[bytes, bytes]]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)


def echoed(response: httpx.Response) -> list[bytes]:
    """The X-Request-Id values of a response, as bytes."""
    return [value for name, value in response.headers.raw if name.lower() == b"x-request-id"]


@pytest.mark.parametrize("path, body, prefix", ROUTES, ids=["completions", "chat", "responses"])
def test_several_request_id_headers_the_first_names_the_response_and_is_echoed(server, path, body, prefix):
    url, _ = server
    r = post(url, path, body, [(b"x-request-id", b"first"), (b"x-request-id", b"second")])
    assert r.status_code == 200, r.text
    assert r.json()["id"] == f"{prefix}-first" and echoed(r) == [b"first"]


def test_an_empty_first_request_id_header_is_no_id(server):
    url, _ = server
    r = post(url, "/v1/completions", COMPLETION, [(b"x-request-id", b""), (b"x-request-id", b"second")])
    assert r.status_code == 200, r.text
    assert "second" not in r.json()["id"] and echoed(r) != [b"second"] and len(echoed(r)) == 1


@pytest.mark.parametrize("sent, text", [("été".encode(), "été"), ("日本".encode(), "日本"), (b"caf\xe9", "café")],
                         ids=["utf-8", "utf-8-cjk", "latin-1"])
@pytest.mark.parametrize("path, body, prefix", ROUTES, ids=["completions", "chat", "responses"])
def test_a_non_ascii_request_id_header_names_the_response_as_sent(server, path, body, prefix, sent, text):
    url, _ = server
    r = post(url, path, body, [(b"x-request-id", sent)])
    assert r.status_code == 200, r.text
    assert r.json()["id"] == f"{prefix}-{text}" and echoed(r) == [sent]


def test_a_non_ascii_request_id_header_names_every_event_of_a_stream(server):
    url, _ = server
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**CHAT, "stream": True, "n": 2},
                      headers=[(b"x-request-id", "ид-1".encode())], timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events and {e["id"] for e in events} == {"chatcmpl-ид-1"}


@pytest.mark.parametrize("path, body, prefix", ROUTES, ids=["completions", "chat", "responses"])
def test_a_request_id_past_the_limit_is_a_400_naming_it(server, healthy, path, body, prefix):
    url, _ = server
    longest = "r" * MAX_REQUEST_ID_CHARS
    with healthy.in_flight():
        header = post(url, path, {**body, "stream": True}, [(b"x-request-id", longest.encode() + b"r")])
        field = post(url, path, {**body, "stream": True, "request_id": longest + "r"}, [])
        # The body's id is checked though the header's names the response.
        both = post(url, path, {**body, "request_id": "x" * 4_000_000}, [(b"x-request-id", b"short")])
    error = openai_error(header, 400, "X-Request-Id")
    assert str(MAX_REQUEST_ID_CHARS) in error["message"] and str(MAX_REQUEST_ID_CHARS + 1) in error["message"]
    assert echoed(header) == [longest.encode() + b"r"]
    openai_error(field, 400, "request_id")
    openai_error(both, 400, "request_id")
    for headers, extra in (([(b"x-request-id", longest.encode())], {}), ([], {"request_id": longest})):
        r = post(url, path, {**body, **extra}, headers)
        assert r.status_code == 200 and r.json()["id"] == f"{prefix}-{longest}", r.text[:300]


def test_a_chat_stream_of_n_hung_up_leaves_a_stream_under_the_same_id_its_solo_text(server, healthy):
    url, _ = server
    headers = {"X-Request-Id": "shared"}
    body = json.dumps({**CHAT, "max_tokens": 200, "n": 4, "temperature": 1, "stream": True, "logprobs": True,
                       "top_logprobs": 2, "stream_options": {"include_usage": True,
                                                             "continuous_usage_stats": True}}).encode()
    healthy.headers = headers
    try:
        with healthy.in_flight(fresh=True):
            for _ in range(3):
                host, port = url.removeprefix("http://").rsplit(":", 1)
                with socket.create_connection((host, int(port)), timeout=60) as sock:
                    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                 b"\r\nX-Request-Id: shared\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                    received = b""
                    while received.count(b"data: {") < 8:     # the hang-up comes mid-stream, every choice running
                        chunk = sock.recv(65536)
                        assert chunk, received[-300:]
                        received += chunk
        healthy.check()
    finally:
        healthy.headers = {}
    wait_for(lambda: get_stats(url)["num_running"] == 0 and get_stats(url)["num_waiting"] == 0, timeout=60)


@pytest.mark.parametrize("encodings, named", [([b"gzip", b"identity"], "gzip"), ([b"identity", b"br"], "br"),
                                              ([b"Identity , GZIP"], "gzip"), ([b"identity", b"x-gzip, identity"], "x-gzip")],
                         ids=["gzip-then-identity", "identity-then-br", "one-list", "coding-in-second-list"])
def test_a_compressed_body_is_a_415_whichever_content_encoding_header_names_it(server, healthy, encodings, named):
    url, _ = server
    headers = [(b"content-type", b"application/json"), *((b"content-encoding", e) for e in encodings)]
    with healthy.in_flight():
        r = httpx.post(f"{url}/v1/completions", content=gzip.compress(json.dumps(COMPLETION).encode()),
                       headers=headers, timeout=60)
    error = openai_error(r, 415, code="unsupported_content_encoding")
    assert repr(named) in error["message"]


@pytest.mark.parametrize("encodings", [[b"identity", b"identity"], [b"identity,identity"], [b"identity, ,identity", b""]],
                         ids=["two-headers", "one-list", "blank-entries"])
def test_identity_in_any_number_is_no_content_coding(server, encodings):
    url, _ = server
    headers = [(b"content-type", b"application/json"), *((b"content-encoding", e) for e in encodings)]
    r = httpx.post(f"{url}/v1/completions", content=json.dumps(COMPLETION).encode(), headers=headers, timeout=60)
    assert r.status_code == 200, r.text
