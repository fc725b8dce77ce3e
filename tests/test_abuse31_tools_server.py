"""Tool calling through the server as vLLM's users drive it, at the edges: calls cut short by
max_output_tokens, and what an item or a block says of a call it could not finish."""
from __future__ import annotations

import json

import httpx
import pytest
from test_server_helpers import chat_model_dir, running_server, sse_events

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
           "additionalProperties": False}


@pytest.fixture(scope="module")
def url(stories_path, tmp_path_factory):
    """The base URL of a server of stories260K with a chat template, on the CPU."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    with running_server(model, max_model_len=256) as (base_url, _):
        yield base_url


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


# ---- /v1/responses ------------------------------------------------------------------------------------

def responses(url: str, **body) -> dict:
    response = httpx.post(f"{url}/v1/responses", timeout=60, json={
        "model": "stories", "input": "Weather?", "temperature": 0,
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
        "tool_choice": {"type": "function", "name": "get_weather"}, **body})
    assert response.status_code == 200, response.text
    return response.json()


def streamed_responses(url: str, **body) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/responses", timeout=60, json={
            "model": "stories", "input": "Weather?", "temperature": 0, "stream": True,
            "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
            "tool_choice": {"type": "function", "name": "get_weather"}, **body}) as response:
        assert response.status_code == 200
        return [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]


def test_a_named_call_cut_by_max_output_tokens_is_an_incomplete_function_call(url):
    # The item said "completed" over arguments that stop mid-JSON ('{"cit').
    reply = responses(url, max_output_tokens=4)
    [call] = reply["output"]
    assert reply["status"] == "incomplete" and call["type"] == "function_call"
    assert not is_json(call["arguments"]) and call["status"] == "incomplete"
    events = streamed_responses(url, max_output_tokens=4)
    [done] = [e for e in events if e["type"] == "response.output_item.done"]
    assert done["item"]["status"] == "incomplete" and done["item"]["arguments"] == call["arguments"]
    final = events[-1]
    assert final["type"] == "response.incomplete" and final["response"]["output"] == [done["item"]]


def test_a_named_call_that_ends_is_a_completed_function_call(url):
    reply = responses(url, max_output_tokens=60)
    [call] = reply["output"]
    assert reply["status"] == "completed" and call["status"] == "completed" and is_json(call["arguments"])
    events = streamed_responses(url, max_output_tokens=60)
    [done] = [e for e in events if e["type"] == "response.output_item.done"]
    assert done["item"]["status"] == "completed" and events[-1]["type"] == "response.completed"


def test_the_chat_stream_of_the_same_cut_call_finishes_with_length(url):
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
            "model": "stories", "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 4,
            "temperature": 0, "stream": True,
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}) as response:
        events = sse_events(response.iter_lines())
    choices = [c for e in events for c in e["choices"]]
    arguments = "".join(d["function"]["arguments"] for c in choices for d in c["delta"].get("tool_calls", []))
    assert choices[-1]["finish_reason"] == "length"
    assert arguments == responses(url, max_output_tokens=4)["output"][0]["arguments"]


# ---- tool_choice "required" over tools whose parameters refer inside themselves -----------------------

DRAFT7 = {"definitions": {"City": {"enum": ["Paris", "Rome"]}}, "type": "object",
          "properties": {"city": {"$ref": "#/definitions/City"}}, "required": ["city"], "additionalProperties": False}


def test_every_api_forces_a_call_of_a_tool_with_draft7_definitions(url):
    # Each was a 400 "Pointer '/definitions/City' does not exist" under "required" ("any").
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "stories", "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 40,
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": DRAFT7}}],
        "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0})
    assert chat.status_code == 200, chat.text
    for call in chat.json()["choices"][0]["message"].get("tool_calls", []):     # none: vLLM leaves the key out
        assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
    reply = responses(url, max_output_tokens=40, tool_choice="required",
                      tools=[{"type": "function", "name": "get_weather", "parameters": DRAFT7}])
    assert all(json.loads(item["arguments"])["city"] in ("Paris", "Rome") for item in reply["output"])
    message = httpx.post(f"{url}/v1/messages", timeout=60, json={
        "model": "stories", "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 40,
        "tools": [{"name": "get_weather", "input_schema": DRAFT7}], "tool_choice": {"type": "any"}})
    assert message.status_code == 200, message.text
    assert all(block["input"]["city"] in ("Paris", "Rome") for block in message.json()["content"]
               if block["type"] == "tool_use")
