"""Structured outputs as users send them on stories260K (CPU): a constraint whose only sentence is
empty under min_tokens, and response_format keys that would carry a schema nobody reads."""
import json

import httpx
import pytest

from minillm import LLM, SamplingParams, StructuredOutputsParams

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm(stories_path):
    with LLM(str(stories_path), device="cpu", max_num_seqs=8) as engine:
        yield engine


def test_rules_that_exclude_every_token_the_grammar_allows_are_named_in_the_error(llm):
    # The message was "token 0 is not allowed by the grammar (Parser Error: ...)", naming a token
    # nobody asked for: a row with every token masked samples id 0.
    choice = StructuredOutputsParams(choice=["yes", "no"])
    params = SamplingParams(temperature=0.0, max_tokens=5, structured_outputs=choice, allowed_token_ids=[5])
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert out.finish_reason == "error"
    assert "no token the grammar allows is left to sample" in out.stop_reason
    assert "allowed_token_ids, bad_words or min_tokens" in out.stop_reason


@pytest.mark.parametrize("kwargs", [dict(regex=""), dict(regex="^$"), dict(grammar='start: ""')])
def test_a_constraint_of_only_the_empty_output_stops_under_min_tokens(llm, kwargs):
    # The grammar allows only EOS and min_tokens banned it: every logit was -inf, token 0 was
    # sampled and the request ended with finish_reason "error" ("token 0 is not allowed").
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3,
                            structured_outputs=StructuredOutputsParams(**kwargs))
    plain = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3)
    empty, other = (o.outputs[0] for o in llm.generate([PROMPT, PROMPT], [params, plain]))
    assert (empty.finish_reason, empty.text) == ("stop", ""), empty.stop_reason
    assert len(other.token_ids) >= 3


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    from test_server_helpers import chat_model_dir, running_server
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat-model"))
    with running_server(model, served_model_name="stories") as (url, _engine):
        yield url


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@pytest.mark.parametrize("response_format,param", [
    ({"type": "json_object", "schema": SCHEMA}, "response_format.schema"),
    ({"type": "json_object", "json_schema": {"name": "a", "schema": SCHEMA}}, "response_format.json_schema"),
    ({"type": "text", "json_schema": {"name": "a", "schema": SCHEMA}}, "response_format.json_schema"),
    ({"type": "json_schema", "schema": SCHEMA, "json_schema": {"name": "a", "schema": {}}}, "response_format.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a", "json_schema": SCHEMA}}, "response_format.json_schema.json_schema"),
    ({"type": "json_object", "x" * 200: 1}, "response_format"),
])
def test_a_response_format_key_that_is_not_read_is_a_400_naming_it(server, response_format, param):
    # These were 200s holding the output to any JSON object (or to no constraint): the schema was dropped.
    body = {"model": "stories", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
            "response_format": response_format}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and len(error["message"]) < 500, error


def test_the_keys_openai_defines_are_taken(server):
    body = {"model": "stories", "max_tokens": 24, "temperature": 0, "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "a", "description": "one integer", "strict": True,
                "schema": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                           "required": ["a"], "additionalProperties": False}}}}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and json.loads(choice["message"]["content"]).keys() == {"a"}
