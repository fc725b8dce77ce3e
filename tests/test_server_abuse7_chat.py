"""Chat requests whose errors must name the field the client sent: max_completion_tokens (which wins
over max_tokens) and a message holding a field name that is not Unicode.

A real server on loopback with a chat template (--chat-template); each test runs with a healthy
greedy stream in flight, and every such stream must end with the text of the same request made alone.
"""
from __future__ import annotations

import json

import pytest
from test_server_helpers import openai_error
from test_server_helpers import chat_template_server, story_streams  # noqa: F401 (the server and healthy fixtures)

MODEL = "stories"
MAX_MODEL_LEN = 256
MESSAGES = [{"role": "user", "content": "Tell me a story."}]


@pytest.mark.parametrize("value", [-1, 0])
def test_bad_max_completion_tokens_is_named(http, healthy_stream, value):
    body = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": value}
    error = openai_error(http.post("/v1/chat/completions", json=body), 400, "max_completion_tokens")
    assert error["message"].startswith("max_completion_tokens "), error
    # The deprecated field alone is still named as itself.
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": value}
    openai_error(http.post("/v1/chat/completions", json=body), 400, "max_tokens")


@pytest.mark.parametrize("value", [-5, 10 ** 30])
def test_a_bad_max_tokens_beside_max_completion_tokens_is_named(http, healthy_stream, value):
    # max_completion_tokens wins; the deprecated field beside it was not checked at all.
    body = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 3, "max_tokens": value}
    openai_error(http.post("/v1/chat/completions", json=body), 400, "max_tokens")


def test_max_completion_tokens_past_the_context_is_named(http, healthy_stream):
    body = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": MAX_MODEL_LEN, "max_tokens": 4}
    error = openai_error(http.post("/v1/chat/completions", json=body), 400, "max_completion_tokens",
                   "context_length_exceeded")
    # vLLM's words, which name no field (param does): never the max_tokens not read
    message = error["message"]
    assert f"requested {MAX_MODEL_LEN} output tokens" in message and "max_tokens" not in message, error


def test_message_field_name_that_is_not_unicode(http, healthy_stream):
    body = ('{"model": "stories", "max_tokens": 2, "messages": '
            '[{"role": "user", "content": "hi", "\\udc00": 1}]}').encode()
    json.loads(body)      # valid JSON: the escape reads as a lone surrogate
    response = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    error = openai_error(response, 400, "messages.0")
    assert "field name that is not valid Unicode" in error["message"], error


def test_truncate_prompt_tokens_keeps_the_last_tokens_of_a_conversation(http, healthy_stream):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a " * 400}], "max_tokens": 3,
            "truncate_prompt_tokens": 40}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 40, response.text
