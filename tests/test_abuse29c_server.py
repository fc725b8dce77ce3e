"""/v1/messages and /v1/responses speak their own API in their refusals: tool_choice "auto" on a
server without a tool call parser names the API's own ways to force a call, and /v1/responses
refuses a reasoning.effort (or summary) that OpenAI's API does not take."""
from __future__ import annotations

import pytest
from test_server_helpers import chat_template_server, openai_error  # noqa: F401 (server)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}


def test_messages_auto_tool_choice_names_anthropic_choices(http):
    body = {"model": "stories", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "get_weather", "input_schema": WEATHER}]}
    for choice in ({}, {"tool_choice": {"type": "auto"}}):
        response = http.post("/v1/messages", json={**body, **choice})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "tool_choice"
        message = error["message"]
        assert '{"type": "any"}' in message and '{"type": "tool", "name": ' in message, message
        assert '"required"' not in message and '"function"' not in message, message


def test_responses_auto_tool_choice_names_responses_choices(http):
    body = {"model": "stories", "max_output_tokens": 4, "input": "hi",
            "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}]}
    for choice in ({}, {"tool_choice": "auto"}):
        message = openai_error(http.post("/v1/responses", json={**body, **choice}), 400, "tool_choice")["message"]
        assert '"required"' in message and '{"type": "function", "name": ' in message, message
        assert '"function": {' not in message, message


def test_chat_auto_tool_choice_keeps_chat_choices(http):
    body = {"model": "stories", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]}
    message = openai_error(http.post("/v1/chat/completions", json=body), 400, "tool_choice")["message"]
    assert '"required"' in message and '{"type": "function", "function": {"name": ' in message, message


RESPONSES = {"model": "stories", "max_output_tokens": 2, "input": "hi"}


@pytest.mark.parametrize("reasoning,param", [
    ({"effort": "bogus"}, "reasoning.effort"),
    ({"effort": 3}, "reasoning.effort"),
    ({"effort": "HIGH"}, "reasoning.effort"),
    ({"summary": "verbose"}, "reasoning.summary"),
    ({"generate_summary": "yes"}, "reasoning.generate_summary"),
    ("high", "reasoning"),
])
def test_responses_refuses_unknown_reasoning(http, reasoning, param):
    response = http.post("/v1/responses", json={**RESPONSES, "reasoning": reasoning})
    error = openai_error(response, 400, param)
    assert error["message"].startswith(param), error["message"]


@pytest.mark.parametrize("effort", [None, "none", "minimal", "low", "medium", "high", "xhigh"])
def test_responses_takes_openai_reasoning_efforts(http, effort):
    reasoning = {"effort": effort, "summary": "auto"}
    response = http.post("/v1/responses", json={**RESPONSES, "reasoning": reasoning})
    assert response.status_code == 200, response.text
    assert response.json()["reasoning"] == reasoning
