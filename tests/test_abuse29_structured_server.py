"""Structured outputs abused through the server and the openai client (stories260K, CPU): fields of
response_format of the wrong type, grammars past the parser's limits; each is a 400 naming the
field while a greedy stream beside them finishes with its alone text."""
from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")

from test_server_helpers import chat_model_dir, long_story_streams, running_server  # noqa: E402, F401 (healthy)

MODEL = "stories"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat-model"))
    with running_server(model, served_model_name=MODEL) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.mark.parametrize("description", [5, ["a"], {"text": "a"}, True])
def test_a_json_schema_description_that_is_no_string_is_a_400_naming_it(client, healthy_stream, description):
    # It was taken and dropped: vLLM (and OpenAI) refuse it.
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "a", "description": description, "schema": SCHEMA}})
    assert err.value.body["param"] == "response_format.json_schema.description", err.value.body


def test_a_text_format_description_that_is_no_string_is_a_400_naming_it(server, http, healthy_stream):
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4, "text": {"format": {
        "type": "json_schema", "name": "a", "description": 5, "schema": SCHEMA}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.description", r.text


def test_a_string_description_is_taken(client, healthy_stream):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=16,
                                         response_format={"type": "json_schema", "json_schema": {
                                             "name": "a", "description": "an object", "schema": SCHEMA}})
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.content.startswith('{"a":')


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("body,param", [
    ({"structured_outputs": {"grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(2500))}},
     "structured_outputs.grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "form", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(700)},
        "additionalProperties": False}}}}, "response_format.json_schema.schema"),
])
def test_a_grammar_past_the_parsers_row_limit_is_a_400_not_an_empty_error_choice(server, healthy_stream, body,
                                                                                   param, stream):
    # It was a 200 whose choice had no text and finish_reason "error", for every request.
    r = httpx.post(f"{server[0]}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": stream, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "too large to match" in error["message"], error
