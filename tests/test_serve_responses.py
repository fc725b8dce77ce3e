"""POST /v1/responses through the official openai client: replies equal to the chat completion of the
same conversation, the event stream, structured and forced-tool outputs, reasoning items, 400s that
name the Responses field, and a stream that fails after it began ending with response.failed."""
from __future__ import annotations

import contextlib
import json

import httpx
import jsonschema
import openai
import pytest
from test_server_helpers import chat_model_dir, openai_error, running_server

from minillm.server.app import ServerOptions, ServerThread, create_app
from minillm.server.errors import APIError, EngineDeadError, RequestFailedError
from minillm.server.serving_responses import ResponsesJob

TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["unit"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def servers(stories_path, tmp_path_factory):
    """{"plain", "r1"}: URLs of two apps over one engine, the second with --reasoning-parser deepseek_r1."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    with running_server(model, max_model_len=256) as (url, engine):
        r1 = ServerThread(create_app(engine, ServerOptions(served_model_name="stories",
                                                           reasoning_parser="deepseek_r1"))).start()
        yield {"plain": url, "r1": r1.url}
        r1.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def chat_text(url: str, messages: list[dict], max_tokens: int) -> dict:
    response = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "stories", "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_reply_is_the_chat_completion_of_the_same_conversation(servers):
    url = servers["plain"]
    response = client(url).responses.create(model="stories", instructions="Tell a story.", max_output_tokens=12,
                                            input="Tom had a red ball.", temperature=0)
    chat = chat_text(url, [{"role": "system", "content": "Tell a story."},
                           {"role": "user", "content": "Tom had a red ball."}], 12)
    assert response.output_text == chat["choices"][0]["message"]["content"] and response.output_text
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.id.startswith("resp_") and response.object == "response" and response.store is False
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat["usage"]["prompt_tokens"], 12)
    assert response.usage.total_tokens == response.usage.input_tokens + 12


def test_input_items_render_as_the_chat_messages_they_stand_for(servers):
    url = servers["plain"]
    items = [{"role": "developer", "content": "Be kind."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"unit": "celsius"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
             {"role": "user", "content": "Thanks."}]
    response = client(url).responses.create(model="stories", input=items, max_output_tokens=10, temperature=0,
                                            tools=[TOOL], tool_choice="none")
    chat = chat_text(url, [
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": [{"type": "text", "text": "It is sunny."}]},
        {"role": "user", "content": "Thanks."}], 10)
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"]


def test_the_event_stream_carries_the_reply_in_order(servers):
    url = servers["plain"]
    events = list(client(url).responses.create(model="stories", input="Lily saw a cat.", max_output_tokens=8,
                                               temperature=0, stream=True))
    whole = client(url).responses.create(model="stories", input="Lily saw a cat.", max_output_tokens=8, temperature=0)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 8


def test_text_format_json_schema_holds_the_output(servers):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    response = client(servers["plain"]).responses.create(
        model="stories", input="Tom", max_output_tokens=40, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "digit", "schema": schema, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_is_a_function_call_item(servers, stream):
    c = client(servers["plain"])
    kwargs = dict(model="stories", input="Weather?", max_output_tokens=40, tools=[TOOL],
                  tool_choice={"type": "function", "name": "get_weather"})
    if stream:
        events = list(c.responses.create(stream=True, **kwargs))
        assert "response.function_call_arguments.done" in [e.type for e in events]
        response = events[-1].response
    else:
        response = c.responses.create(**kwargs)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["unit"] in ("celsius", "fahrenheit")
    assert response.status == "completed"


def test_reasoning_comes_as_a_reasoning_item(servers):
    c = client(servers["r1"])
    response = c.responses.create(model="stories", input="Tom had a red ball.", max_output_tokens=10, temperature=0)
    plain = client(servers["plain"]).responses.create(model="stories", input="Tom had a red ball.",
                                                      max_output_tokens=10, temperature=0)
    [item] = response.output            # no </think>: all of it reasoning
    assert item.type == "reasoning" and item.content[0].text == plain.output_text
    events = list(c.responses.create(model="stories", input="Tom had a red ball.", max_output_tokens=10,
                                     temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == plain.output_text


@pytest.mark.parametrize("body, param", [
    ({"background": True}, "background"),
    ({"truncation": "bogus"}, "truncation"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "computer_call"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input[0].content[0].type"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10 ** 6}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}}, "text.format.schema"),
    ({"tool_choice": "auto", "tools": [TOOL]}, "tool_choice"),
    ({"input": 5}, "input"),
])
def test_bad_requests_are_400s_naming_the_responses_field(servers, body, param):
    response = httpx.post(f"{servers['plain']}/v1/responses", timeout=60,
                          json={"model": "stories", "input": "Tom", **body})
    error = openai_error(response, 400, param)
    assert "max_completion_tokens" not in error["message"] and "response_format" not in error["message"]


def test_responses_are_not_stored(servers):
    assert client(servers["plain"]).responses.create(model="stories", input="Tom", max_output_tokens=2).store is False
    openai_error(httpx.get(f"{servers['plain']}/v1/responses/resp_1", timeout=10), 404, "response_id",
                 "response_not_found")
    with pytest.raises(openai.NotFoundError):
        client(servers["plain"]).responses.retrieve("resp_1")


@pytest.mark.parametrize("failure, code, message", [
    (RequestFailedError("r", RuntimeError("injected kernel fault")), "server_error",
     "the request failed in the engine: RuntimeError: injected kernel fault"),
    (EngineDeadError("the engine loop has stopped: injected"), "server_error",
     "the engine loop has stopped: injected"),
    (APIError(400, "injected: a bad request found late", param="input"), "invalid_prompt",
     "injected: a bad request found late"),
], ids=["request failed", "engine dead", "request error"])
def test_a_stream_that_fails_after_it_began_ends_with_response_failed(servers, monkeypatch, failure, code, message):
    # The failure came as chat's data-only error and [DONE]: not an event of the Responses API (the
    # openai client raised a bare APIError), and the response that had begun never ended.
    events_of = ResponsesJob.events

    async def failing_after_the_first(self, streams):
        async with contextlib.aclosing(events_of(self, streams)) as events:
            yield await anext(events)     # response.created, in_progress, and the reply's first text
            raise failure

    monkeypatch.setattr(ResponsesJob, "events", failing_after_the_first)
    request = dict(model="stories", input="Lily saw a cat.", max_output_tokens=100, temperature=0)
    events = list(client(servers["plain"]).responses.create(stream=True, **request))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.failed", kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    failed = events[-1].response
    assert failed.id == events[0].response.id and failed.status == "failed" and failed.usage is None
    assert (failed.error.code, failed.error.message) == (code, message)
    # The message item as far as it came, cut short.
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    [item] = failed.output
    assert item.type == "message" and item.status == "incomplete" and item.content[0].text == text and text
    with httpx.stream("POST", f"{servers['plain']}/v1/responses", json={**request, "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-2] == "event: response.failed"
    assert json.loads(lines[-1].removeprefix("data: "))["response"]["error"] == {"code": code, "message": message}
    assert not any(line.startswith(("data: {\"error\"", "data: [DONE]")) for line in lines)
