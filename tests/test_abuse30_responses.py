"""POST /v1/responses as real clients send it: fields the response echoes must be ones JSON can carry
back, the openai SDK's own reading of a reply and of a stream (plain, streamed, and its stream helper's
final response), and the fields OpenAI's API bounds refused with a 400 that names them."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_server_helpers import chat_model_dir, openai_error, running_server

from minillm.server.protocol import unknown_fields
from minillm.server.serving_responses import ResponsesRequest, chat_body

STORY = "Tom had a red ball."


@pytest.fixture(scope="module")
def url(stories_path, tmp_path_factory):
    """The base URL of a server of stories260K with a chat template, on the CPU."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    with running_server(model, max_model_len=256) as (base_url, _):
        yield base_url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def post_text(url: str, text: str, stream: bool) -> httpx.Response:
    """POST a body written as JSON text (bare NaN, escapes of lone surrogates) to /v1/responses."""
    body = f'{{"model": "stories", "input": "Hi", "max_output_tokens": 2, "stream": {json.dumps(stream)}, {text}}}'
    return httpx.post(f"{url}/v1/responses", content=body.encode(), timeout=60,
                      headers={"Content-Type": "application/json"})


# A field the response echoes, with a value JSON cannot carry back (a lone surrogate, NaN, Infinity):
# (the field as JSON text, the param of the 400).
UNWRITABLE = {
    "metadata surrogate value": ('"metadata": {"k": "\\ud800"}', "metadata.k"),
    "metadata surrogate key": ('"metadata": {"\\udfff": "v"}', "metadata"),
    "metadata NaN": ('"metadata": {"k": NaN}', "metadata.k"),
    "metadata 1e999": ('"metadata": {"k": 1e999}', "metadata.k"),
    "tools Infinity": ('"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", '
                       '"properties": Infinity}}], "tool_choice": "none"', "tools[0].parameters.properties"),
    "tools surrogate": ('"tools": [{"type": "function", "name": "f", "description": "\\ud800"}], '
                        '"tool_choice": "none"', "tools[0].description"),
    "tool_choice NaN": ('"tools": [{"type": "function", "name": "f"}], '
                        '"tool_choice": {"type": "function", "name": "f", "x": NaN}', "tool_choice.x"),
    "reasoning NaN": ('"reasoning": {"effort": "low", "x": NaN}', "reasoning.x"),
    "reasoning surrogate": ('"reasoning": {"effort": "low", "x": ["\\udc00"]}', "reasoning.x[0]"),
    "text NaN": ('"text": {"format": {"type": "text"}, "verbosity": NaN}', "text.verbosity"),
    "text.format.schema -Infinity": ('"text": {"format": {"type": "json_schema", "name": "n", "schema": '
                                     '{"type": "number", "maximum": -Infinity}}}', "text.format.schema.maximum"),
    "instructions surrogate": ('"instructions": "\\ud800"', "instructions"),
    "user surrogate": ('"user": "a\\udfffb"', "user"),
    "include surrogate": ('"include": ["\\ud800"]', "include[0]"),
    "previous_response_id surrogate": ('"previous_response_id": "\\ud800"', "previous_response_id"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("field, param", list(UNWRITABLE.values()), ids=list(UNWRITABLE))
def test_an_echoed_field_json_cannot_carry_back_is_a_400_naming_it(url, field, param, stream):
    # The response echoed metadata, tools, tool_choice, reasoning and text as sent: a 500 (a lone
    # surrogate cannot be encoded, NaN cannot be written), or a stream cut after its headers.
    openai_error(post_text(url, field, stream), 400, param)


def test_metadata_values_are_strings_as_in_openai_and_vllm(url):
    # OpenAI's metadata (and vLLM's Metadata type) maps strings to strings; other values were echoed.
    for value in (5, None, ["a"], {"b": "c"}, True):
        response = httpx.post(f"{url}/v1/responses", timeout=60, json={
            "model": "stories", "input": "Hi", "max_output_tokens": 1, "metadata": {"k": value}})
        openai_error(response, 400, "metadata.k")
    reply = client(url).responses.create(model="stories", input="Hi", max_output_tokens=1,
                                         metadata={"topic": "ball", "ünï": "çödé"})
    assert reply.metadata == {"topic": "ball", "ünï": "çödé"}


# ---- the openai SDK's reading of a reply ---------------------------------------------------------------

def test_a_reply_that_stopped_is_completed_and_one_cut_by_max_output_tokens_incomplete(url):
    c = client(url)
    stopped = c.responses.create(model="stories", input=STORY, temperature=0, extra_body={"stop": ["."]})
    assert stopped.status == "completed" and stopped.incomplete_details is None and stopped.error is None
    assert stopped.output_text and "." not in stopped.output_text
    usage = stopped.usage
    assert usage.output_tokens > 0 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    cut = c.responses.create(model="stories", input=STORY, temperature=0, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and cut.output_text


def test_a_stream_ends_with_response_completed_when_the_reply_stopped(url):
    c = client(url)
    request = dict(model="stories", input=STORY, temperature=0, extra_body={"stop": ["."]})
    whole = c.responses.create(**request)
    events = list(c.responses.create(stream=True, **request))
    assert [e.type for e in events][-1] == "response.completed"
    final = events[-1].response
    assert (final.status, final.output_text, final.usage.output_tokens) == (
        "completed", whole.output_text, whole.usage.output_tokens)
    assert final.id == events[0].response.id and [e.sequence_number for e in events] == list(range(len(events)))
    # The SDK's stream helper finds its final response in response.completed (it raises without one).
    with c.responses.stream(**request) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        helper = stream.get_final_response()
    assert helper.status == "completed" and helper.output_text == text == whole.output_text


def test_a_stream_cut_by_max_output_tokens_ends_with_response_incomplete(url):
    events = list(client(url).responses.create(model="stories", input=STORY, temperature=0, max_output_tokens=3,
                                               stream=True))
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.status == "incomplete"
    assert final.response.incomplete_details.reason == "max_output_tokens" and final.response.usage.output_tokens == 3


# ---- fields OpenAI's API bounds, and vLLM's extensions ---------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"text": {"verbosity": "loud"}}, "text.verbosity"),
    ({"text": {"format": {"type": "text"}, "verbosity": 3}}, "text.verbosity"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 1.5}, "top_logprobs"),
    ({"top_logprobs": "three"}, "top_logprobs"),
])
def test_a_value_outside_what_openai_takes_is_a_400_naming_the_field(url, body, param):
    # Taken without a word before: text.verbosity of any value, and top_logprobs of any type (logged as ignored).
    response = httpx.post(f"{url}/v1/responses", timeout=60, json={"model": "stories", "input": "Hi",
                                                                   "max_output_tokens": 1, **body})
    openai_error(response, 400, param)


def test_verbosity_and_top_logprobs_in_range_are_taken(url):
    reply = client(url).responses.create(model="stories", input="Hi", max_output_tokens=1, top_logprobs=20,
                                         text={"verbosity": "low"})
    assert reply.status == "incomplete" and reply.top_logprobs == 20 and reply.text.verbosity == "low"


def test_vllms_sampling_extensions_are_used_and_not_logged_as_ignored():
    # stop, top_k, ... reach the chat request, but the log said "fields ... ignored: 'stop'".
    extras = {"stop": ["."], "top_k": 5, "seed": 7, "repetition_penalty": 1.1}
    req = ResponsesRequest.model_validate({"model": "stories", "input": "Hi", **extras})
    assert unknown_fields(req) == []
    assert {k: chat_body(req)[k] for k in extras} == extras
    unused = ResponsesRequest.model_validate({"input": "Hi", "service_tier": "auto"})
    assert unknown_fields(unused) == ["service_tier"] and "top_k" not in chat_body(unused)


# ---- what a server without a response store cannot do ---------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_previous_response_id_is_a_404_as_openai_and_vllm_answer_an_unknown_one(url, stream):
    # No response is stored, so none is found: OpenAI (and vLLM without its store) answer 404
    # previous_response_not_found; this was a 400, which clients read as a bad request, not a lost response.
    response = httpx.post(f"{url}/v1/responses", timeout=60, json={
        "model": "stories", "input": "Hi", "max_output_tokens": 1, "stream": stream, "previous_response_id": "resp_1"})
    error = openai_error(response, 404, "previous_response_id", "previous_response_not_found")
    assert "'resp_1' not found" in error["message"] and error["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client(url).responses.create(model="stories", input="Hi", previous_response_id="resp_1", stream=stream)


@pytest.mark.parametrize("store", [True, False])
def test_background_is_a_400_naming_it_with_or_without_store(url, store):
    response = httpx.post(f"{url}/v1/responses", timeout=60, json={
        "model": "stories", "input": "Hi", "background": True, "store": store})
    openai_error(response, 400, "background")
    assert client(url).responses.create(model="stories", input="Hi", max_output_tokens=1, store=True).store is False


# ---- a tool-calling round trip, as the openai SDK's users write it ------------------------------------------

TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
        "parameters": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["unit"], "additionalProperties": False}}


def test_a_required_call_without_parallel_calls_completes_and_its_output_goes_back_as_input(url):
    c = client(url)
    with c.responses.stream(model="stories", input="Weather?", tools=[TOOL], tool_choice="required",
                            parallel_tool_calls=False, max_output_tokens=100, temperature=0) as stream:
        reply = stream.get_final_response()
    [call] = reply.output
    assert reply.status == "completed" and call.type == "function_call" and reply.parallel_tool_calls is False
    assert json.loads(call.arguments)["unit"] in ("celsius", "fahrenheit")
    # The reply's items go back as input, with the call's output after them.
    follow = c.responses.create(model="stories", tools=[TOOL], tool_choice="none", max_output_tokens=4, temperature=0,
                                input=[{"role": "user", "content": "Weather?"}, *reply.output,
                                       {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.output_text and follow.usage.input_tokens > reply.usage.input_tokens


def test_an_unwritable_echoed_field_of_a_large_body_is_a_400_too(url):
    # A body past 64 KiB is read in the preprocessing pool: the refusal comes back from there.
    field, param = UNWRITABLE["tool_choice NaN"]
    openai_error(post_text(url, f'"instructions": "{"x" * 70_000}", {field}', stream=True), 400, param)
