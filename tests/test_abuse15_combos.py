"""Per-request features used together and at their bounds: a valid combination works, an invalid
one is an OpenAI-shaped 4xx naming the field, with the value the client sent."""
from __future__ import annotations

import pytest
from test_server_helpers import running_server

MODEL = "stories"


@pytest.fixture(scope="module")
def server(stories_path):
    """One real server, max_model_len 128."""
    with running_server(stories_path, served_model_name=MODEL, engine_core="thread", max_model_len=128) as running:
        yield running


@pytest.mark.parametrize("extra", [{}, {"logprobs": 20, "n": 3}, {"stream": True}])
def test_echo_without_generation_refuses_min_tokens_against_the_max_tokens_sent(http, extra):
    # max_tokens 0 with echo generates one token and drops it; the error named that 1 ("must not
    # exceed max_tokens (1)"), a value the client never sent.
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon", "echo": True,
                                                  "max_tokens": 0, "min_tokens": 5, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "min_tokens" and error["type"] == "invalid_request_error", error
    assert "max_tokens (0)" in error["message"] and "got 5" in error["message"], error
    # min_tokens 0 is the echo it was, and the server goes on.
    ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon", "echo": True,
                                            "max_tokens": 0, "min_tokens": 0, "logprobs": 2})
    assert ok.status_code == 200, ok.text
    choice = ok.json()["choices"][0]
    assert choice["text"] == "Once upon" and ok.json()["usage"]["completion_tokens"] == 0
