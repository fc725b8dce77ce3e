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
