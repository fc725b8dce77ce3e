"""The OpenAI-compatible API as vLLM's clients meet it, checked against vLLM's request models: a count
of log-probabilities sent as text ("logprobs": "2") is a 400 naming the field, as vLLM's
check_logprobs refuses it (pydantic's lax reading made it the number)."""
from __future__ import annotations

import pytest
from test_server_helpers import chat_template_server, openai_error  # noqa: F401 (the server fixture)

USER = {"role": "user", "content": "Once upon"}
COMPLETION = {"model": "stories", "prompt": "Once upon", "max_tokens": 2, "temperature": 0}
CHAT = {"model": "stories", "messages": [USER], "max_tokens": 2, "temperature": 0}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {**COMPLETION, "logprobs": "2"}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "prompt_logprobs": "1"}, "prompt_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": "2"}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "prompt_logprobs": "0"}, "prompt_logprobs"),
], ids=["completions_logprobs", "completions_prompt_logprobs", "chat_top_logprobs", "chat_prompt_logprobs"])
def test_a_logprobs_count_sent_as_text_is_a_400_naming_it(http, path, body, param):
    error = openai_error(http.post(path, json=body), 400, param)
    assert "must be an integer" in error["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {**COMPLETION, "logprobs": 2.0, "prompt_logprobs": 1}),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2.0, "prompt_logprobs": 0}),
], ids=["completions", "chat"])
def test_a_logprobs_count_sent_as_a_number_is_taken(http, path, body):
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    tops = logprobs["top_logprobs"] if path == "/v1/completions" else \
        [entry["top_logprobs"] for entry in logprobs["content"]]
    assert [len(top) for top in tops] == [2, 2]
