"""vLLM's /invocations (SageMaker's route beside /ping): a chat completion or a completion by its body,
guarded by the API key as /v1 is."""
from __future__ import annotations

import httpx
import pytest
from test_server_helpers import running_server, sse_events

from minillm.server.app import ServerOptions

KEY = {"Authorization": "Bearer k"}


@pytest.fixture(scope="module")
def url(stories_path):
    options = ServerOptions(chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with running_server(stories_path, api_key="k", max_model_len=256, options=options) as (base, _):
        yield base


def invoke(url: str, body, headers=KEY) -> httpx.Response:
    return httpx.post(f"{url}/invocations", json=body, headers=headers, timeout=60)


def test_messages_are_a_chat_completion_as_on_its_own_route(url):
    body = {"messages": [{"role": "user", "content": "Lily"}], "max_tokens": 5, "temperature": 0}
    reply = invoke(url, body).json()
    alone = httpx.post(f"{url}/v1/chat/completions", json=body, headers=KEY, timeout=60).json()
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]


def test_a_prompt_is_a_completion_and_streams(url):
    body = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}
    reply = invoke(url, body).json()
    assert reply["object"] == "text_completion" and reply["usage"]["completion_tokens"] == 5
    with httpx.stream("POST", f"{url}/invocations", json={**body, "stream": True}, headers=KEY, timeout=60) as r:
        events = sse_events(r.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events) == reply["choices"][0]["text"]


@pytest.mark.parametrize("body, status, param", [
    ({"input": "x"}, 400, None),                                      # neither messages nor a prompt
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),        # the completion's own check names it
    ({"messages": "x"}, 400, "messages"),
])
def test_what_neither_route_takes_is_a_400(url, body, status, param):
    response = invoke(url, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    if param is None:
        assert "Cannot find suitable handler" in error["message"]


def test_without_the_key_it_is_a_401(url):
    response = invoke(url, {"prompt": "x", "max_tokens": 1}, headers={})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_a_body_that_is_no_object_is_a_400(url):
    response = httpx.post(f"{url}/invocations", content=b"[1]", headers={**KEY, "content-type": "application/json"},
                          timeout=60)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
