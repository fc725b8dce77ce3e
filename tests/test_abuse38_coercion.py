"""Request values read as vLLM's pydantic models read them (lax mode): "5" and 5.0 are the integer 5, "0.7"
and 1 are numbers, 0, 1, "true" and "false" are booleans, nested fields (stream_options.include_usage,
response_format.json_schema.strict, ...) and fields read by hand (a Messages thinking budget) alike; what
pydantic refuses (5.5 or "abc" for an integer, 2 for a boolean, a number for a string) is a 400 naming the field.
Each of these was a 400 (the server read its models in pydantic's strict mode)."""
from __future__ import annotations

import json

import httpx
import pytest
from test_abuse37_openai_params import post, url  # noqa: F401  (the module's server fixture)
from test_server_helpers import openai_error

from minillm.server.errors import APIError
from minillm.server.protocol import lax_value

MESSAGES = [{"role": "user", "content": "Once upon"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}




def sse_data(response: httpx.Response) -> list[dict]:
    """The JSON events of a data-only SSE stream (OpenAI's), [DONE] left out."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


# ---- the rule itself, against pydantic's conversion table --------------------------------------------

@pytest.mark.parametrize("value, kind, expected", [
    ("5", int, 5), (" 5 ", int, 5), (5.0, int, 5), ("5.0", int, 5), (True, int, 1), ("1_000", int, 1000),
    ("0.7", float, 0.7), (1, float, 1.0), ("1e3", float, 1000.0), (False, float, 0.0),
    (0, bool, False), (1, bool, True), (1.0, bool, True), ("true", bool, True), ("False", bool, False),
    ("yes", bool, True), ("off", bool, False), ("1", bool, True), ("0", bool, False),
    ("5", str, "5"),
])
def test_the_rule_takes_what_pydantic_lax_mode_takes(value, kind, expected):
    result = lax_value(value, kind, "field")
    assert result == expected and type(result) is kind


@pytest.mark.parametrize("value, kind", [
    (5.5, int), ("5.5", int), ("abc", int), ("", int), ("0x10", int), ("1e3", int), ("true", int), ([5], int),
    ("hot", float), ("nan", float), (float("inf"), float), ("", float),
    (2, bool), (0.5, bool), ("2", bool), ("maybe", bool), ("", bool), ([], bool),
    (5, str), (True, str), (1.5, str),
])
def test_the_rule_refuses_what_pydantic_lax_mode_refuses_naming_the_field(value, kind):
    with pytest.raises(APIError) as caught:
        lax_value(value, kind, "a.b")
    assert caught.value.status == 400 and caught.value.param == "a.b" and caught.value.message.startswith("a.b ")


# ---- through the server -----------------------------------------------------------------------------

def test_completion_takes_numbers_and_booleans_as_strings(url):
    body = {"prompt": "Once upon a time", "max_tokens": "3", "ignore_eos": "true", "temperature": "0",
            "logprobs": 1.0, "echo": 0, "n": 1.0, "seed": "7"}
    choice = post(url, "/v1/completions", body).json()
    assert choice["usage"]["completion_tokens"] == 3
    assert len(choice["choices"][0]["logprobs"]["top_logprobs"][0]) == 1
    plain = post(url, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 3, "ignore_eos": True,
                                          "temperature": 0}).json()
    assert choice["choices"][0]["text"] == plain["choices"][0]["text"]


def test_chat_takes_logprobs_as_0_or_1_and_max_tokens_as_a_whole_float(url):
    body = {"messages": MESSAGES, "max_tokens": 4.0, "ignore_eos": 1, "top_logprobs": 2.0}
    with_logprobs = post(url, "/v1/chat/completions", {**body, "logprobs": 1}).json()
    assert with_logprobs["usage"]["completion_tokens"] == 4
    rows = with_logprobs["choices"][0]["logprobs"]["content"]
    assert len(rows) == 4 and all(len(row["top_logprobs"]) == 2 for row in rows)
    without = post(url, "/v1/chat/completions", {**body, "logprobs": 0, "top_logprobs": 0}).json()
    assert without["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("stream, is_stream", [("true", True), (1, True), ("false", False), (0, False)])
def test_stream_takes_pydantics_spellings_of_a_boolean(url, stream, is_stream):
    response = post(url, "/v1/completions", {"prompt": "Once", "max_tokens": 2, "stream": stream})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream") == is_stream


@pytest.mark.parametrize("include_usage, has_usage", [("true", True), ("false", False), (0, False), (1, True)])
def test_stream_options_include_usage_is_read_as_a_boolean(url, include_usage, has_usage):
    events = sse_data(post(url, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 2, "stream": "true", "stream_options": {"include_usage": include_usage}}))
    assert (events[-1].get("usage") is not None) == has_usage


def test_json_schema_strict_and_structured_output_options_take_boolean_strings(url):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": "true"}}
    response = post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 40, "response_format": fmt})
    assert response.status_code == 200, response.text
    response = post(url, "/v1/completions", {"prompt": "Once", "max_tokens": 40, "structured_outputs": {
        "json": SCHEMA, "disable_any_whitespace": "yes", "disable_additional_properties": 1}})
    assert response.status_code == 200, response.text
    assert " " not in response.json()["choices"][0]["text"]


def test_chat_tool_strict_of_any_spelling_is_taken_as_vllm_takes_it(url):
    tool = {"type": "function", "function": {"name": "f", "parameters": SCHEMA, "strict": "true"}}
    response = post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "tools": [tool],
                                                  "tool_choice": "none"})
    assert response.status_code == 200, response.text


def test_tokenize_and_detokenize_take_lax_values(url):
    plain = post(url, "/tokenize", {"prompt": "Once", "add_special_tokens": False}).json()["tokens"]
    assert post(url, "/tokenize", {"prompt": "Once", "add_special_tokens": "false"}).json()["tokens"] == plain
    text = post(url, "/detokenize", {"tokens": plain}).json()["prompt"]
    assert post(url, "/detokenize", {"tokens": [str(t) for t in plain]}).json()["prompt"] == text


def test_responses_takes_lax_values(url):
    reply = post(url, "/v1/responses", {"input": "Once upon", "max_output_tokens": "3", "stream": "false",
                                        "temperature": "0", "text": {"format": {
                                            "type": "json_schema", "name": "a", "schema": SCHEMA, "strict": "1"}}})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["output_tokens"] <= 3


def test_messages_takes_lax_values_in_nested_fields(url):
    tool = {"name": "f", "input_schema": SCHEMA}
    reply = post(url, "/v1/messages", {
        "messages": MESSAGES, "max_tokens": "5", "temperature": "0", "tools": [tool],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": "true"},
        "thinking": {"type": "enabled", "budget_tokens": "2"}})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["output_tokens"] <= 5


# (path, body, param the 400 names): values pydantic's lax mode refuses stay 400s naming the field.
CHAT = {"messages": MESSAGES, "max_tokens": 2}
COMPLETION = {"prompt": "Once", "max_tokens": 2}
REFUSED = {
    "max-tokens-fraction": ("/v1/completions", {**COMPLETION, "max_tokens": 5.5}, "max_tokens"),
    "max-tokens-fraction-string": ("/v1/completions", {**COMPLETION, "max_tokens": "5.5"}, "max_tokens"),
    "max-tokens-word": ("/v1/chat/completions", {**CHAT, "max_tokens": "abc"}, "max_tokens"),
    "n-empty-string": ("/v1/completions", {**COMPLETION, "n": ""}, "n"),
    "stream-two": ("/v1/completions", {**COMPLETION, "stream": 2}, "stream"),
    "logprobs-two": ("/v1/chat/completions", {**CHAT, "logprobs": 2}, "logprobs"),
    "temperature-word": ("/v1/chat/completions", {**CHAT, "temperature": "warm"}, "temperature"),
    "stop-number": ("/v1/completions", {**COMPLETION, "stop": 5}, "stop"),
    "include-usage-two": ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": 2}},
                          "stream_options.include_usage"),
    "schema-strict-word": ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": SCHEMA, "strict": "maybe"}}}, "response_format.json_schema.strict"),
    "whitespace-two": ("/v1/completions", {**COMPLETION, "structured_outputs": {
        "json": SCHEMA, "disable_any_whitespace": 2}}, "structured_outputs.disable_any_whitespace"),
    "tokenize-special-two": ("/tokenize", {"prompt": "Once", "add_special_tokens": 2}, "add_special_tokens"),
    "detokenize-fraction": ("/detokenize", {"tokens": [1, 2.5]}, "tokens.1"),
    "responses-max-fraction": ("/v1/responses", {"input": "x", "max_output_tokens": 2.5}, "max_output_tokens"),
    "responses-text-strict": ("/v1/responses", {"input": "x", "text": {"format": {
        "type": "json_schema", "name": "a", "schema": SCHEMA, "strict": 2}}}, "text.format.strict"),
    "responses-tool-strict": ("/v1/responses", {"input": "x", "tools": [{
        "type": "function", "name": "f", "parameters": SCHEMA, "strict": "maybe"}], "tool_choice": "none"},
        "tools[0].strict"),
}


@pytest.mark.parametrize("path, body, param", REFUSED.values(), ids=REFUSED)
def test_a_value_pydantic_refuses_is_a_400_naming_the_field(url, path, body, param):
    openai_error(post(url, path, body), 400, param)


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": "5.5"}, "max_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1.5}}, "thinking.budget_tokens"),
    ({"tools": [{"name": "f", "input_schema": SCHEMA}], "tool_choice": {"type": "any", "disable_parallel_tool_use": 2}},
     "tool_choice.disable_parallel_tool_use"),
])
def test_a_messages_value_pydantic_refuses_is_a_400_naming_the_field(url, body, param):
    response = post(url, "/v1/messages", {"messages": MESSAGES, "max_tokens": 5, **body})
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["param"] == param, error


@pytest.mark.parametrize("name, value", [("use_beam_search", "false"), ("use_beam_search", 0), ("length_penalty", "1"),
                                         ("length_penalty", True), ("thinking_token_budget", "-1")])
def test_an_unsupported_vllm_field_at_its_default_in_any_lax_spelling_passes(url, name, value):
    # vLLM's model reads "false" and 0 as use_beam_search false: no beam search asked for (it was a 400).
    response = post(url, "/v1/completions", {**COMPLETION, name: value})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("name, value", [("use_beam_search", "maybe"), ("use_beam_search", 2),
                                         ("length_penalty", "0.5"), ("thinking_token_budget", "16")])
def test_an_unsupported_vllm_field_set_in_any_spelling_is_a_400_naming_it(url, name, value):
    openai_error(post(url, "/v1/completions", {**COMPLETION, name: value}), 400, name)
