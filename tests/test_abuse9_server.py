"""`minillm serve` given what hostile or careless OpenAI clients send: an echo without generation whose
constraint fails, an empty model name, numbers past 64 bits, content parts as vLLM takes them.

A real server on loopback with a chat template; each test runs with a healthy greedy stream in
flight, and every such stream must end with the text of the same request made alone.
"""
from __future__ import annotations

import pytest
from test_server_helpers import openai_error
from test_server_helpers import chat_template_server, story_streams  # noqa: F401 (the server and healthy fixtures)

MODEL = "stories"
MAX_MODEL_LEN = 256
# A constraint that passes the entry check but is too large for the engine to compile: the request
# finishes with "error" before its prompt is scored.
UNCOMPILABLE = {"regex": "a{1000000}"}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_an_echo_without_generation_that_failed_says_so(http, healthy_stream, stream):
    body = {"model": MODEL, "prompt": ["Once upon", "The dog"], "n": 2, "max_tokens": 0, "echo": True,
            "logprobs": 1, "structured_outputs": UNCOMPILABLE, "stream": stream}
    response = http.post("/v1/completions", json=body)
    # The answer (a stream's too: its status line waits for its first event) comes after the
    # compile's outcome: the client's error, named. Never "length", which would pass the prompt's
    # echo off as scored.
    error = openai_error(response, 400, "structured_outputs.regex")
    assert "too large" in error["message"], error
    plain = http.post("/v1/completions", json={**body, "structured_outputs": None, "stream": False}).json()
    assert {c["finish_reason"] for c in plain["choices"]} == {"length"}


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Once upon", "max_tokens": 3, "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}),
], ids=["completion", "chat"])
def test_an_empty_model_name_is_the_served_model_as_in_vllm(http, healthy_stream, path, body):
    named = http.post(path, json={**body, "model": MODEL})
    empty = http.post(path, json={**body, "model": ""})
    assert named.status_code == empty.status_code == 200, empty.text
    assert empty.json()["model"] == MODEL and empty.json()["choices"] == named.json()["choices"]
    openai_error(http.post(path, json={**body, "model": " "}), 404, "model", "model_not_found")
    # /v1/models/ looks no model up: it is the list's URL with a trailing slash, redirected as vLLM's
    assert http.get("/v1/models/").status_code == 307


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Once upon", "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
], ids=["completion", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_truncate_prompt_tokens_past_the_context_is_named(http, healthy_stream, path, body, stream):
    for keep in (MAX_MODEL_LEN + 1, 2**64, 10**30):
        error = openai_error(http.post(path, json={**body, "model": MODEL, "stream": stream,
                                                   "truncate_prompt_tokens": keep}), 400, "truncate_prompt_tokens")
        assert f"at most max_model_len ({MAX_MODEL_LEN})" in error["message"], error
    for keep in (MAX_MODEL_LEN, -1):
        response = http.post(path, json={**body, "model": MODEL, "truncate_prompt_tokens": keep})
        assert response.status_code == 200, response.text


def _chat_reply(http, messages: list[dict]) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return {"usage": response.json()["usage"], "content": response.json()["choices"][0]["message"]["content"]}


def test_content_parts_read_as_vllm_reads_them(http, healthy_stream):
    # Text parts joined by newlines (as vLLM joins them for a template that reads a string), plain
    # string parts, and the other part types vLLM reads as text: each as the same text sent whole.
    parts = [{"role": "user", "content": ["Tell me", {"type": "input_text", "text": "a story"}, {"type": "text",
                                                                                             "text": "now."}]},
             {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
             {"role": "user", "content": [{"type": "output_text", "text": "Please?"}]}]
    whole = [{"role": "user", "content": "Tell me\na story\nnow."}, {"role": "assistant", "content": "No."},
             {"role": "user", "content": "Please?"}]
    assert _chat_reply(http, parts) == _chat_reply(http, whole)
    for part, param in [({"type": "image_url", "image_url": {"url": "http://x"}}, "messages.0.content.0.type"),
                        ({"type": "refusal", "text": "No."}, "messages.0.content.0.refusal")]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": [part]}], "max_tokens": 2}
        openai_error(http.post("/v1/chat/completions", json=body), 400, param)
