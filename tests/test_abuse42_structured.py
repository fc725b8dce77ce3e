"""Structured outputs abused (stories260K, CPU): a response_format schema sent as its JSON text, and
constraints of every kind under n-gram drafts and under preemption, whose greedy outputs must be those
of a plain engine."""
from __future__ import annotations

import json

import httpx
import pytest

from minillm import LLM, SamplingParams
from minillm.structured_output import StructuredOutputsParams
from test_server_helpers import chat_model_dir, openai_error, running_server

MODEL = "stories"
MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def client(stories_path, tmp_path_factory):
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    with running_server(model, max_model_len=256) as (url, _), httpx.Client(base_url=url, timeout=120) as c:
        yield c


@pytest.mark.parametrize("schema,kind", [(json.dumps(SCHEMA), "a string"), ("{}", "a string"), ([SCHEMA], "an array"),
                                         (True, "a boolean"), (1, "a number")])
def test_a_response_format_schema_that_is_not_an_object_is_a_400(client, schema, kind):
    # OpenAI's and vLLM's json_schema.schema is an object; its JSON text was parsed and obeyed here
    # ("{}" gave "false"), where both refuse it.
    response = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    error = openai_error(response, 400, "response_format.json_schema.schema")
    assert kind in error["message"], error


def test_a_text_format_schema_that_is_not_an_object_is_a_400_naming_it(client):
    response = client.post("/v1/responses", json={
        "model": MODEL, "input": "hi", "max_output_tokens": 8,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": json.dumps(SCHEMA)}}})
    openai_error(response, 400, "text.format.schema")


def test_an_object_schema_is_still_obeyed(client):
    response = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"].startswith('{"a":')


# ---- the Python API: drafts and preemption ---------------------------------------------------------------

GRAMMAR = 'start: item ("," item)*\nitem: "once" | "upon" | "a" | "time"'
CONSTRAINTS = [{"json": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                          "age": {"type": "integer"}}, "required": ["name", "age"]}},
               {"choice": ["yes", "no"]}, {"regex": "(ab|cd){3,9}"}, {"grammar": GRAMMAR}, None, {"json_object": True}]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def greedy_outputs(stories_path, **engine_kwargs) -> list[tuple[str, str]]:
    """(text, finish_reason) of twelve greedy requests, two of each constraint, in one batch."""
    prompts = ["Once upon a time" + " there was a" * i for i in range(12)]
    params = [SamplingParams(max_tokens=64, temperature=0, structured_outputs=(
        None if (c := CONSTRAINTS[i % len(CONSTRAINTS)]) is None else StructuredOutputsParams(**c)))
        for i in range(12)]
    with LLM(str(stories_path), device="cpu", max_model_len=256, **engine_kwargs) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        num_preemptions = llm.llm_engine.scheduler.num_preemptions if engine_kwargs.get("num_kv_blocks") else None
    assert num_preemptions is None or num_preemptions > 0, "the small pool preempted nothing"
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs]


def test_constraints_under_ngram_drafts_and_preemption_keep_their_greedy_outputs(stories_path):
    plain = greedy_outputs(stories_path)
    assert all(text in ("yes", "no") and reason == "stop" for text, reason in plain[1::6]), plain
    assert all(reason == "stop" and len(text) >= 6 for text, reason in plain[2::6]), plain
    assert greedy_outputs(stories_path, speculative_config=NGRAM) == plain
    assert greedy_outputs(stories_path, num_kv_blocks=17, block_size=16, speculative_config=NGRAM) == plain
