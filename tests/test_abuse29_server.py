"""`minillm serve` under inputs earlier rounds did not try.

A real server on loopback with a chat template; each test runs with a healthy greedy stream in
flight, and every such stream must end with the text of the same request made alone.
"""
from __future__ import annotations

import json

from test_server_helpers import openai_error
from test_server_helpers import chat_template_server, story_streams  # noqa: F401 (the server and healthy fixtures)

MODEL = "stories"
BODY = json.dumps({"model": MODEL, "prompt": "Once upon", "max_tokens": 2}).encode()


def test_a_body_without_a_content_type_is_said_to_have_none(http, healthy_stream):
    # The message read "got Content-Type 'none'", as if the client had sent the value 'none'.
    error = openai_error(http.post("/v1/completions", content=BODY), 400)
    assert "no Content-Type" in error["message"] and "'none'" not in error["message"], error
    error = openai_error(http.post("/v1/completions", content=BODY, headers={"content-type": "text/plain"}), 400)
    assert "got Content-Type 'text/plain'" in error["message"], error


def test_a_messages_usage_counts_cached_input_tokens_once_as_anthropic_does(http, healthy_stream):
    # Anthropic's input_tokens are the prompt tokens not read from the cache (the whole input is
    # input_tokens + cache_read_input_tokens, as its clients add them up); input_tokens counted the
    # whole prompt, so a cached prefix was counted twice.
    body = {"model": MODEL, "max_tokens": 2, "system": "You tell short stories about a cat. " * 4,
            "messages": [{"role": "user", "content": "Tell me one."}]}
    num_prompt = http.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
    http.post("/v1/messages", json=body).raise_for_status()      # the prompt's blocks are in the cache now
    usage = http.post("/v1/messages", json=body).json()["usage"]
    assert usage["cache_read_input_tokens"] > 0, usage
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == num_prompt, usage
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as response:
        start = json.loads(next(line for line in response.iter_lines() if line.startswith("data:"))[5:])
    usage = start["message"]["usage"]
    assert usage["cache_read_input_tokens"] > 0, usage
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == num_prompt, usage
