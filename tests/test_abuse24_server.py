"""`minillm serve` under request shapes earlier rounds did not try, held to vLLM's server.

A real server on loopback with a chat template; each test runs with a healthy greedy stream in
flight, and every such stream must end with the text of the same request made alone.
"""
from __future__ import annotations

import pytest
from test_server_helpers import openai_error
from test_server_helpers import chat_template_server, story_streams  # noqa: F401 (the server and healthy fixtures)

MODEL = "stories"

# Requests of the endpoints whose bodies declare no stream_options: the field is an unknown one there.
NO_STREAM_OPTIONS = {
    "responses": ("/v1/responses", {"model": MODEL, "input": "Tom had a ball.", "max_output_tokens": 2,
                                    "stream": True}),
    "messages": ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    "tokenize": ("/tokenize", {"model": MODEL, "prompt": "Once upon a time"}),
    "tokenize_chat": ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
    "detokenize": ("/detokenize", {"model": MODEL, "tokens": [1, 403]}),
}


@pytest.mark.parametrize("value", [{"include_usage": True}, 5])
@pytest.mark.parametrize("kind", NO_STREAM_OPTIONS)
def test_stream_options_on_an_endpoint_without_them_is_an_unknown_field(http, healthy_stream, kind, value):
    # An OpenAI client sends stream_options with every stream (the Responses API has its own); on a
    # request that does not declare the field, logging the unknown fields read it as chat's
    # StreamOptions: a 500 (AttributeError), and the connection closed.
    path, body = NO_STREAM_OPTIONS[kind]
    reply = http.post(path, json={**body, "stream_options": value})
    assert reply.status_code == 200, reply.text[:500]
    assert http.get("/health").status_code == 200        # the same connection still serves
