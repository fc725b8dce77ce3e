"""A forced tool call whose arguments hold a number past a float's range (1e400: JSON, and what a
model may write), through every API: the text as written where arguments are a string, null where
Messages' tool_use input must be an object; never a 500."""
from __future__ import annotations

import json

import httpx
import pytest
from test_server_helpers import chat_model_dir, running_server, sse_events

# llguidance writes the key separator as given: the forced output is {"x": 1e400, "y": 0} whatever
# the model would pick.
HUGE = {"type": "object", "properties": {"x": {"const": 0}}, "required": ["x"], "additionalProperties": False,
        "x-guidance": {"key_separator": ': 1e400, "y": '}}
ARGUMENTS = '{"x": 1e400, "y": 0}'


@pytest.fixture(scope="module")
def url(stories_path, tmp_path_factory):
    """The base URL of a server of stories260K with a chat template, on the CPU."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    with running_server(model, max_model_len=256) as (base_url, _):
        yield base_url


def post(url: str, path: str, body: dict) -> dict:
    response = httpx.post(f"{url}{path}", timeout=60, json={"model": "stories", **body})
    assert response.status_code == 200, response.text
    return response.json()


def stream(url: str, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{url}{path}", timeout=60, json={"model": "stories", "stream": True, **body}) as response:
        assert response.status_code == 200
        return list(response.iter_lines())


MESSAGES = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
            "tools": [{"name": "f", "input_schema": HUGE}], "tool_choice": {"type": "tool", "name": "f"}}


def test_messages_answers_a_call_with_1e400_with_null_in_its_input(url):
    # A 500: "Out of range float values are not JSON compliant".
    reply = post(url, "/v1/messages", MESSAGES)
    [block] = reply["content"]
    assert block["type"] == "tool_use" and block["input"] == {"x": None, "y": 0}
    assert reply["stop_reason"] == "tool_use"
    lines = stream(url, "/v1/messages", MESSAGES)
    events = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]   # all JSON
    partial = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")
    assert json.loads(partial) == {"x": None, "y": 0}


def test_chat_and_responses_pass_the_arguments_on_as_written(url):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": HUGE}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}}}
    [call] = post(url, "/v1/chat/completions", chat)["choices"][0]["message"]["tool_calls"]
    assert call["function"]["arguments"] == ARGUMENTS
    chunks = sse_events(stream(url, "/v1/chat/completions", chat))
    assert "".join(d["function"]["arguments"] for c in chunks for ch in c["choices"]
                   for d in ch["delta"].get("tool_calls", [])) == ARGUMENTS
    responses = {"input": "hi", "max_output_tokens": 40, "tools": [{"type": "function", "name": "f", "parameters": HUGE}],
                 "tool_choice": {"type": "function", "name": "f"}}
    [item] = post(url, "/v1/responses", responses)["output"]
    assert item["arguments"] == ARGUMENTS and item["status"] == "completed"


def test_messages_answers_a_call_with_a_lone_surrogate_with_valid_unicode(url):
    # A 500: "'utf-8' codec can't encode character '\ud800'".
    lone = dict(HUGE, **{"x-guidance": {"key_separator": ': "\\\\ud800", "y": '}})   # a regex: \\ is one backslash
    body = dict(MESSAGES, tools=[{"name": "f", "input_schema": lone}])
    [block] = post(url, "/v1/messages", body)["content"]
    assert block["input"] == {"x": "\ufffd", "y": 0}
    events = [json.loads(line[len("data: "):]) for line in stream(url, "/v1/messages", body) if line.startswith("data: ")]
    partial = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")
    assert json.loads(partial) == {"x": "\ufffd", "y": 0}


def test_messages_refuses_two_tools_of_one_name_as_anthropic_does(url):
    # Taken: a tool_choice naming it, or a tool_use of it, went to whichever came first.
    weather = {"type": "object", "properties": {"city": {"type": "string"}}}
    body = dict(MESSAGES, tools=[{"name": "f", "input_schema": weather}, {"name": "g", "input_schema": weather},
                                 {"name": "f", "input_schema": HUGE}])
    response = httpx.post(f"{url}/v1/messages", timeout=60, json={"model": "stories", **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tools[2].name" and "unique" in error["message"]
