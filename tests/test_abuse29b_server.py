"""Tool calling and reasoning abused over /v1/chat/completions, /v1/responses and /v1/messages: bad
items deep in a conversation are 400s naming the deepest place that is wrong (input[0], not input),
Anthropic's tool_use ids are its own (toolu_...) and come back through the template, and a healthy
stream of another client finishes unchanged after each."""
from __future__ import annotations

import json

import httpx
import pytest
from test_server_helpers import running_server, story_streams  # noqa: F401 (healthy)

from minillm.server.app import ServerOptions

# Renders tools, tool calls (id, name, arguments) and tool results (their tool_call_id), so that what a
# request says of them can be read back from the prompt.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}{% if m.tool_call_id is defined %}[{{ m.tool_call_id }}]{% endif %}: "
    "{{ m.content if m.content is string else m.content | tojson }}"
    "{% for c in m.tool_calls or [] %} call {{ c.id }} {{ c.function.name }}({{ c.function.arguments | tojson }})"
    "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def server(stories_path):
    """(url, engine): stories260K with TOOL_TEMPLATE, --tool-call-parser hermes, --reasoning-parser deepseek_r1;
    stories260K has no <think> token, so a forced call is held from the first token (enable_in_reasoning)."""
    options = ServerOptions(chat_template=TOOL_TEMPLATE, tool_call_parser="hermes", reasoning_parser="deepseek_r1",
                            structured_outputs_config={"enable_in_reasoning": True})
    with running_server(stories_path, max_model_len=256, options=options) as running:
        yield running


def error_of(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


# ---- a bad item names the item, not the field that holds it ---------------------------------------

@pytest.mark.parametrize("body,param", [
    ({"input": [None]}, "input[0]"),
    ({"input": [{"role": "user", "content": "hi"}, 7]}, "input[1]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
    ({"instructions": None, "input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "x"}]},
                                      {"type": "reasoning", "summary": []}]}, "input[1]"),
])
def test_responses_names_the_bad_input_item(http, healthy_stream, body, param):
    error = error_of(http.post("/v1/responses", json={"model": "stories", "max_output_tokens": 2, **body}))
    assert error["param"] == param
    assert error["message"].startswith(param), error["message"]
    assert "at least 1 item" not in error["message"]


@pytest.mark.parametrize("messages,param", [
    ([None], "messages[0]"),
    ([{"role": "user", "content": "hi"}, "x"], "messages[1]"),
    ([{"role": "user", "content": [None]}], "messages[0].content[0].type"),
])
def test_messages_names_the_bad_message(http, healthy_stream, messages, param):
    error = error_of(http.post("/v1/messages", json={"model": "stories", "max_tokens": 2, "messages": messages}))
    assert error["param"] == param
    assert error["message"].startswith(param), error["message"]


@pytest.mark.parametrize("messages,param", [
    ([None], "messages.0"),
    ([{"role": "user", "content": "hi"}, 3], "messages.1"),
    ([{"role": "user", "content": [None]}], "messages.0.content.0"),
    ([{"role": "assistant", "tool_calls": [None]}], "messages.0.tool_calls.0"),
])
def test_chat_names_the_bad_message(http, healthy_stream, messages, param):
    error = error_of(http.post("/v1/chat/completions", json={"model": "stories", "max_tokens": 2,
                                                             "messages": messages}))
    assert error["param"] == param
    assert error["message"].startswith(param), error["message"]
    assert "instance of" not in error["message"]       # pydantic's class names are not the API's


# ---- Anthropic's tool_use ids ---------------------------------------------------------------------

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                            "required": ["city"], "additionalProperties": False}}
ASK = {"model": "stories", "max_tokens": 40, "messages": [{"role": "user", "content": "Weather in Paris?"}],
       "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}


def _sse_data(lines) -> list[dict]:
    return [json.loads(line[5:]) for line in lines if line.startswith("data:")]


def test_tool_use_ids_are_anthropic_ids_and_round_trip(http, healthy_stream):
    """A tool_use block's id is toolu_..., streamed as whole; sent back as a tool_result's tool_use_id it
    reaches the template as the assistant call's id and the tool message's tool_call_id."""
    reply = http.post("/v1/messages", json=ASK)
    assert reply.status_code == 200, reply.text
    (use,) = [b for b in reply.json()["content"] if b["type"] == "tool_use"]
    assert use["id"].startswith("toolu_") and use["name"] == "get_weather"
    with http.stream("POST", "/v1/messages", json={**ASK, "stream": True}) as streamed:
        events = _sse_data(streamed.iter_lines())
    (started,) = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert started["type"] == "tool_use" and started["id"].startswith("toolu_") and started["id"] != use["id"]

    turns = [*ASK["messages"], {"role": "assistant", "content": [use]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "sunny"}]}]
    counted = http.post("/v1/messages/count_tokens", json={**ASK, "messages": turns})
    assert counted.status_code == 200, counted.text
    call = {"id": use["id"], "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(use["input"])}}
    chat = [*ASK["messages"], {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": use["id"], "content": "sunny"}]
    tokens = http.post("/tokenize", json={"model": "stories", "messages": chat, "tools": [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"]}}]}).json()
    assert counted.json()["input_tokens"] == tokens["count"]
    text = http.post("/detokenize", json={"model": "stories", "tokens": tokens["tokens"]}).json()["prompt"]
    assert f"call {use['id']} get_weather(" in text and f"tool[{use['id']}]: sunny" in text


# ---- tool_choice "required" names the tool whose schema is bad ------------------------------------

GOOD = {"type": "object", "properties": {"city": {"type": "string"}}}
BAD_SCHEMAS = [{"type": "frog"}, {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}]


@pytest.mark.parametrize("bad", BAD_SCHEMAS)
def test_required_tool_choice_names_the_tool_whose_schema_is_bad(http, healthy_stream, bad):
    chat_tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in (("a", GOOD), ("b", bad))]
    error = error_of(http.post("/v1/chat/completions", json={"model": "stories", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}], "tools": chat_tools, "tool_choice": "required"}))
    assert error["param"] == "tools.1.function.parameters", error
    responses_tools = [{"type": "function", "name": n, "parameters": p} for n, p in (("a", GOOD), ("b", bad))]
    error = error_of(http.post("/v1/responses", json={"model": "stories", "max_output_tokens": 2, "input": "hi",
                                                      "tools": responses_tools, "tool_choice": "required"}))
    assert error["param"] == "tools[1].parameters", error
    messages_tools = [{"name": n, "input_schema": p} for n, p in (("a", GOOD), ("b", bad))]
    error = error_of(http.post("/v1/messages", json={"model": "stories", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}], "tools": messages_tools, "tool_choice": {"type": "any"}}))
    assert error["param"] == "tools[1].input_schema", error


# ---- a Responses tool_choice is told in the Responses API's shape ---------------------------------

@pytest.mark.parametrize("choice,param", [
    ({"type": "function"}, "tool_choice.name"),
    ({"type": "function", "name": 5}, "tool_choice.name"),
    ({"type": "function", "function": {"name": "get_weather"}}, "tool_choice.name"),
    ({"type": "file_search"}, "tool_choice.type"),
    ({"name": "get_weather"}, "tool_choice.type"),
    ("sometimes", "tool_choice"),
    (5, "tool_choice"),
])
def test_responses_tool_choice_errors_speak_of_its_shape(http, healthy_stream, choice, param):
    tools = [{"type": "function", "name": "get_weather", "parameters": GOOD}]
    error = error_of(http.post("/v1/responses", json={"model": "stories", "max_output_tokens": 2, "input": "hi",
                                                      "tools": tools, "tool_choice": choice}))
    assert error["param"] == param, error
    assert '"function": {' not in error["message"], error      # the chat API's shape of a named tool


@pytest.mark.parametrize("thinking,param", [
    ({"type": "bogus"}, "thinking.type"),
    ({}, "thinking.type"),
    ({"type": "enabled", "budget_tokens": "lots"}, "thinking.budget_tokens"),
])
def test_messages_thinking_of_an_unknown_kind_is_a_400(http, healthy_stream, thinking, param):
    error = error_of(http.post("/v1/messages", json={"model": "stories", "max_tokens": 2, "thinking": thinking,
                                                     "messages": [{"role": "user", "content": "hi"}]}))
    assert error["param"] == param, error


# ---- tool call arguments that Python cannot read are told in JSON's terms -------------------------

@pytest.mark.parametrize("arguments,why", [
    ('{"a": ' + "9" * 5000 + "}", "a number has too many digits"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
])
def test_unreadable_tool_call_arguments_are_told_in_json_terms(http, healthy_stream, arguments, why):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    error = error_of(http.post("/v1/chat/completions", json={"model": "stories", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]}))
    assert error["param"] == "messages.1.tool_calls.0.function.arguments" and why in error["message"], error
    assert "sys." not in error["message"] and "unicode string" not in error["message"]
    item = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": arguments}
    error = error_of(http.post("/v1/responses", json={"model": "stories", "max_output_tokens": 2, "input": [
        {"role": "user", "content": "hi"}, item]}))
    assert error["param"] == "input[1].arguments" and why in error["message"], error
