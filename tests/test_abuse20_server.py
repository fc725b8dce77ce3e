"""`minillm serve` held to vLLM's server for what users of vLLM and of the openai client send: the
request id a client chooses, and the stop reason of an EOS that stop_token_ids also list.

A real server on loopback with a chat template; each test runs with a healthy greedy stream in
flight, and every such stream must end with the text of the same request made alone.
"""
from __future__ import annotations

import threading

import httpx
import pytest
from test_server_helpers import sse_events
from test_server_helpers import chat_template_server, story_streams  # noqa: F401 (the server and healthy fixtures)

MODEL = "stories"
BODIES = {
    "completion": ("/v1/completions", "cmpl", {"model": MODEL, "prompt": "Once upon", "max_tokens": 3}),
    "chat": ("/v1/chat/completions", "chatcmpl", {"model": MODEL, "max_tokens": 3,
                                                  "messages": [{"role": "user", "content": "Hi"}]}),
}


def _ids(http, path: str, body: dict, headers: dict) -> set[str]:
    """The ids of a response, or of every chunk of a stream."""
    if not body.get("stream"):
        response = http.post(path, json=body, headers=headers)
        assert response.status_code == 200, response.text
        return {response.json()["id"]}
    with http.stream("POST", path, json=body, headers=headers) as response:
        assert response.status_code == 200
        return {event["id"] for event in sse_events(response.iter_lines())}


@pytest.mark.parametrize("kind", BODIES)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_the_clients_request_id_names_the_response_as_in_vllm(http, healthy_stream, kind, stream):
    # vLLM names a response prefix-<X-Request-Id>, else prefix-<the body's request_id>; the header
    # and the field were ignored (a fresh id came back, and request_id was logged as unknown).
    path, prefix, body = BODIES[kind]
    body = {**body, "stream": stream}
    assert _ids(http, path, body, {"X-Request-Id": "trace-42"}) == {f"{prefix}-trace-42"}
    assert _ids(http, path, {**body, "request_id": "mine-7"}, {}) == {f"{prefix}-mine-7"}
    assert _ids(http, path, {**body, "request_id": "mine-7"}, {"X-Request-Id": "hdr"}) == {f"{prefix}-hdr"}
    fresh = _ids(http, path, body, {})
    assert len(fresh) == 1 and fresh.pop().startswith(f"{prefix}-")


def test_requests_sharing_a_client_id_run_side_by_side(server, healthy_stream):
    # A client id is the response's name, not the engine's key: requests in flight with the same
    # one (a retry through a gateway) all complete.
    path, prefix, body = BODIES["completion"]
    body = {**body, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    results: list[set[str]] = []

    def run() -> None:
        with httpx.Client(base_url=server[0], timeout=60) as client:
            results.append(_ids(client, path, body, {"X-Request-Id": "same"}))

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == [{f"{prefix}-same"}] * 3


@pytest.mark.parametrize("kind", BODIES)
def test_eos_listed_in_stop_token_ids_ends_with_no_stop_reason_as_in_vllm(http, healthy_stream, kind):
    # vLLM checks EOS before stop_token_ids: an EOS the client also lists there (a common recipe:
    # stop_token_ids=[eos, eot]) ends the output with stop_reason null; it read 2, the EOS id.
    path, _, body = BODIES[kind]
    body = {**body, "max_tokens": 5, "min_tokens": 2, "temperature": 0, "logit_bias": {"2": 100}}

    def finish(**extra) -> tuple:
        response = http.post(path, json={**body, **extra})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["finish_reason"], choice["stop_reason"], response.json()["usage"]["completion_tokens"]

    assert finish() == finish(stop_token_ids=[2]) == finish(stop_token_ids=[5, 2]) == ("stop", None, 3)
    # Under ignore_eos only the listed id stops it, and names it.
    assert finish(stop_token_ids=[2], ignore_eos=True) == ("stop", 2, 3)
