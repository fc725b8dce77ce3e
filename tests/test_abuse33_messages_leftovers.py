"""POST /v1/messages refuses what Anthropic's API refuses as a malformed conversation or thinking object:
a tool_result that answers no tool_use of an earlier assistant message, and `thinking` enabled without a
budget, with one below 1 or one that leaves max_tokens no room; each a 400 in Anthropic's error shape
naming the field, while a real tool round trip (its call split over consecutive assistant messages
too) is served as before."""
from __future__ import annotations

import httpx
import pytest
from test_server_helpers import CHAT_TEMPLATE, running_server

from minillm.server.app import ServerOptions

MODEL = "stories"
USER = {"role": "user", "content": "hi"}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
OTHER_CALL = {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}


def result(tool_use_id: str, content: str = "sunny") -> dict:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": content}


@pytest.fixture(scope="module")
def server(stories_path):
    options = ServerOptions(chat_template=CHAT_TEMPLATE)
    with running_server(stories_path, served_model_name=MODEL, max_model_len=256, options=options) as running:
        yield running


def post(http, messages: list[dict], path: str = "/v1/messages", **fields) -> httpx.Response:
    return http.post(path, json={"model": MODEL, "max_tokens": 4, "messages": messages, **fields})


def anthropic_400(response: httpx.Response) -> dict:
    """The error object of a 400 in Anthropic's shape."""
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    return body["error"]


# ---- tool_result blocks answer a tool_use ---------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_a_tool_result_with_no_tool_use_is_a_400_naming_its_tool_use_id(http, path):
    # It was rendered as a tool message answering a call nobody made, and the model answered it (200).
    error = anthropic_400(post(http, [USER, {"role": "user", "content": [result("toolu_x")]}], path))
    assert error["param"] == "messages[1].content[0].tool_use_id", error
    assert "toolu_x" in error["message"] and "tool_use" in error["message"], error


def test_a_tool_result_naming_another_calls_id_is_a_400(http):
    messages = [USER, {"role": "assistant", "content": [CALL]},
                {"role": "user", "content": [result("toolu_1"), {"type": "text", "text": "and"}, result("toolu_9")]}]
    error = anthropic_400(post(http, messages))
    assert error["param"] == "messages[2].content[2].tool_use_id", error


def test_a_tool_result_before_its_tool_use_is_a_400(http):
    messages = [USER, {"role": "user", "content": [result("toolu_1")]}, {"role": "assistant", "content": [CALL]},
                {"role": "user", "content": "go on"}]
    assert anthropic_400(post(http, messages))["param"] == "messages[1].content[0].tool_use_id"


@pytest.mark.parametrize("messages", [
    [USER, {"role": "assistant", "content": [CALL]}, {"role": "user", "content": [result("toolu_1")]}],
    [USER, {"role": "assistant", "content": [CALL, OTHER_CALL]},
     {"role": "user", "content": [result("toolu_2"), result("toolu_1")]}],
    # one turn of the assistant over consecutive messages, and of the user likewise
    [USER, {"role": "assistant", "content": "Let me look."}, {"role": "assistant", "content": [CALL]},
     {"role": "assistant", "content": [OTHER_CALL]}, {"role": "user", "content": [result("toolu_1")]},
     {"role": "user", "content": [result("toolu_2")]}, {"role": "user", "content": "And tomorrow?"}],
    # a second round trip after the first
    [USER, {"role": "assistant", "content": [CALL]}, {"role": "user", "content": [result("toolu_1")]},
     {"role": "assistant", "content": [OTHER_CALL]}, {"role": "user", "content": [result("toolu_2")]}],
], ids=["one", "parallel", "split-turns", "two-rounds"])
def test_tool_round_trips_are_served(http, messages):
    response = post(http, messages)
    assert response.status_code == 200, response.text
    assert post(http, messages, "/v1/messages/count_tokens").status_code == 200


# ---- thinking -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("thinking,max_tokens,words", [
    ({"type": "enabled"}, 8, "required"),
    ({"type": "enabled", "budget_tokens": None}, 8, "required"),
    ({"type": "enabled", "budget_tokens": 0}, 8, "at least 1"),
    ({"type": "enabled", "budget_tokens": -5}, 8, "at least 1"),
    ({"type": "enabled", "budget_tokens": 8}, 8, "max_tokens must be greater"),
    ({"type": "enabled", "budget_tokens": 1024}, 8, "max_tokens must be greater"),
    ({"type": "enabled", "budget_tokens": 2**64}, 8, "max_tokens must be greater"),
])
def test_an_enabled_thinking_budget_that_is_missing_or_does_not_fit_is_a_400(http, thinking, max_tokens, words):
    # Each was taken (the budget logged as ignored) where Anthropic's API answers 400.
    error = anthropic_400(post(http, [USER], thinking=thinking, max_tokens=max_tokens))
    assert error["param"] == "thinking.budget_tokens", error
    assert words in error["message"], error


@pytest.mark.parametrize("thinking,param", [
    ("enabled", "thinking"),
    ({"type": "enabled", "budget_tokens": 2.5}, "thinking.budget_tokens"),
    ({"budget_tokens": 4}, "thinking.type"),
])
def test_a_malformed_thinking_object_is_a_400_naming_its_field(http, thinking, param):
    assert anthropic_400(post(http, [USER], thinking=thinking, max_tokens=8))["param"] == param


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 7}, {"type": "enabled", "budget_tokens": 1},
                                      {"type": "adaptive"}, {"type": "disabled"}])
def test_a_thinking_object_that_fits_is_served(http, thinking):
    response = post(http, [USER], thinking=thinking, max_tokens=8)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["output_tokens"] <= 8
