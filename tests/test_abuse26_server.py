"""`minillm serve` under inputs earlier rounds did not try.

A real server on loopback with a chat template; each test runs with a healthy greedy stream in
flight, and every such stream must end with the text of the same request made alone.
"""
from __future__ import annotations

import pytest
from test_server_helpers import openai_error
from test_server_helpers import chat_template_server, story_streams  # noqa: F401 (the server and healthy fixtures)

MODEL = "stories"
CONVERSATION = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


@pytest.mark.parametrize("stop_sequences", [[""], ["a"] * 65, ["x" * 257]], ids=["empty", "too many", "too long"])
def test_a_bad_stop_sequence_is_named_stop_sequences_in_the_message_too(http, healthy_stream, stop_sequences):
    # The Messages API's stop_sequences is the chat request's stop: the error named the right param,
    # but its message spoke of "stop", a field an Anthropic client never sends.
    error = openai_error(http.post("/v1/messages", json={**CONVERSATION, "stop_sequences": stop_sequences}),
                         400, "stop_sequences")
    assert "stop_sequences" in error["message"] and not error["message"].startswith("stop "), error
