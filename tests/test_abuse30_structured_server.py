"""Structured outputs abused through the server (stories260K, CPU): vLLM's structured_outputs
options beside the constraint, while a greedy stream beside them finishes with its alone text."""
from __future__ import annotations

import json

import pytest

from test_server_helpers import long_story_streams, openai_error, running_server  # noqa: F401 (the healthy fixture)

MODEL = "stories"
PROMPT = "Once upon a time"
OPEN = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}


@pytest.fixture(scope="module")
def server(stories_path):
    with running_server(stories_path, served_model_name=MODEL) as (url, engine):
        yield url, engine


def complete(http, structured_outputs: dict):
    return http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 24,
                                              "temperature": 0, "structured_outputs": structured_outputs})


def test_vllms_options_at_their_defaults_are_taken(http, healthy_stream):
    # A client that sends vLLM's StructuredOutputsParams whole (its options at their defaults) got a
    # 400 naming the first of them.
    plain = complete(http, {"json": OPEN})
    assert plain.status_code == 200, plain.text
    full = complete(http, {"json": OPEN, "disable_additional_properties": False, "whitespace_pattern": None,
                           "structural_tag": None})
    assert full.status_code == 200, full.text
    assert full.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


def test_disable_additional_properties_keeps_other_keys_out(http, healthy_stream):
    response = complete(http, {"json": OPEN, "disable_additional_properties": True})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and set(json.loads(choice["text"])) <= {"a"}, choice


@pytest.mark.parametrize("name,value", [("structural_tag", "{}"), ("whitespace_pattern", " *"),
                                        ("disable_additional_properties", "maybe")])
def test_an_option_minillm_does_not_do_is_a_400_naming_it(http, healthy_stream, name, value):
    openai_error(complete(http, {"json": OPEN, name: value}), 400, f"structured_outputs.{name}")
