"""Tool choices that name no tool to call, function_call_output items without their call, a forced
call's arguments streamed as they are generated on /v1/responses, and truncate_prompt_tokens -1 as
vLLM takes it (the context less max_tokens)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_server_helpers import chat_model_dir, openai_error, running_server

from minillm.outputs import CompletionOutput
from minillm.server.protocol import ChatCompletionRequest
from minillm.server.serving import validate_request
from minillm.server.serving_responses import ResponsesJob, ResponsesRequest, chat_body

MAX_MODEL_LEN = 256
LONG = "Once upon a time there was a cat. " * 60        # past the context
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}},
                                                         "required": ["a"]}}


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    """A server of stories260K with a chat template, on the CPU: (base URL, its ServingContext)."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    with running_server(model, max_model_len=MAX_MODEL_LEN) as running:
        yield running[0], running.http.server.config.app.state.ctx


@pytest.fixture(scope="module")
def url(server):
    return server[0]


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": "stories", **body}, timeout=60)


def events_of(url: str, path: str, body: dict) -> list[dict]:
    """The data of each server-sent event of a stream."""
    with httpx.stream("POST", f"{url}{path}", json={"model": "stories", "stream": True, **body}, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        return [json.loads(line[len("data: "):]) for line in reply.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


# ---- a tool_choice that forces a call of no tool --------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
RESPONSES = {"input": "hi", "max_output_tokens": 4}
FORCING = [
    ("chat-required-empty-tools", "/v1/chat/completions", {**CHAT, "tools": [], "tool_choice": "required"}),
    ("chat-required-no-tools", "/v1/chat/completions", {**CHAT, "tool_choice": "required"}),
    ("chat-named-empty-tools", "/v1/chat/completions",
     {**CHAT, "tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("chat-named-other-tool", "/v1/chat/completions",
     {**CHAT, "tools": [{"type": "function", "function": {"name": "g"}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("responses-required-empty-tools", "/v1/responses", {**RESPONSES, "tools": [], "tool_choice": "required"}),
    ("responses-required-no-tools", "/v1/responses", {**RESPONSES, "tool_choice": "required"}),
    ("responses-named-empty-tools", "/v1/responses",
     {**RESPONSES, "tools": [], "tool_choice": {"type": "function", "name": "f"}}),
    ("responses-named-other-tool", "/v1/responses",
     {**RESPONSES, "tools": [{**TOOL, "name": "g"}], "tool_choice": {"type": "function", "name": "f"}}),
]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("path,body", [c[1:] for c in FORCING], ids=[c[0] for c in FORCING])
def test_a_tool_choice_that_forces_a_call_with_no_tool_to_call_is_a_400_naming_tool_choice(url, path, body, stream):
    # tools [] with "required" was answered with plain text, as if tool_choice were "none".
    error = openai_error(post(url, path, {**body, "stream": stream}), 400, "tool_choice")
    assert "tools" in error["message"]


MESSAGES = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("body", [{"tools": [], "tool_choice": {"type": "any"}}, {"tool_choice": {"type": "any"}},
                                  {"tools": [], "tool_choice": {"type": "tool", "name": "f"}},
                                  {"tools": [{"name": "g", "input_schema": {"type": "object"}}],
                                   "tool_choice": {"type": "tool", "name": "f"}}],
                         ids=["any-empty-tools", "any-no-tools", "tool-empty-tools", "tool-other-tool"])
def test_messages_tool_choice_any_or_tool_with_no_tool_to_call_is_a_400_naming_tool_choice(url, body):
    response = post(url, "/v1/messages", {**MESSAGES, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tool_choice" and "tools" in error["message"]


def test_empty_tools_without_a_forcing_tool_choice_still_pass(url):
    assert post(url, "/v1/chat/completions", {**CHAT, "tools": []}).status_code == 200
    assert post(url, "/v1/chat/completions", {**CHAT, "tools": [], "tool_choice": "none"}).status_code == 200
    assert post(url, "/v1/messages", {**MESSAGES, "tools": [], "tool_choice": {"type": "none"}}).status_code == 200


# ---- function_call_output items and their calls ---------------------------------------------------------------

CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": "x"}'}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
QUESTION = {"role": "user", "content": "weather?"}


@pytest.mark.parametrize("items,index", [([QUESTION, OUTPUT], 1), ([QUESTION, OUTPUT, CALL], 1),
                                         ([QUESTION, CALL, {**OUTPUT, "call_id": "call_2"}], 2)],
                         ids=["no-call", "call-after-it", "other-call"])
def test_a_function_call_output_without_its_call_is_a_400_naming_input(url, items, index):
    # Accepted silently: the template rendered a tool result that answers no call.
    error = openai_error(post(url, "/v1/responses", {"input": items, "max_output_tokens": 4}), 400, "input")
    call_id = items[index]["call_id"]
    assert f"No tool call found for function call output with call_id {call_id}" in error["message"]


def test_a_function_call_output_after_its_call_passes(url):
    items = [QUESTION, CALL, OUTPUT, {**CALL, "call_id": "call_2"}, {**OUTPUT, "call_id": "call_2"}]
    reply = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0).responses.create(
        model="stories", input=items, max_output_tokens=4, tools=[TOOL], tool_choice="none")
    assert reply.status == "incomplete" and reply.output


# ---- a forced named call streamed on /v1/responses --------------------------------------------------------------

NAMED = {"input": "Tell me a story.", "max_output_tokens": 60, "temperature": 0, "tools": [TOOL],
         "tool_choice": {"type": "function", "name": "f"}}


def test_a_forced_calls_arguments_stream_as_they_are_generated(server):
    # The arguments came in one delta once the output was whole.
    job = ResponsesJob(server[1], req := validate_request(ResponsesRequest, {"model": "stories", **NAMED,
                                                                             "stream": True}),
                       validate_request(ChatCompletionRequest, chat_body(req)))
    writer = job.writer()

    def update(text: str, num_tokens: int, finish: str | None = None) -> list[dict]:
        events = writer.update(CompletionOutput(0, text, list(range(num_tokens)), finish_reason=finish))
        return [json.loads(line[len("data: "):]) for line in events.splitlines() if line.startswith("data: ")]

    first = update('{"a"', 2)
    assert [e["type"] for e in first] == ["response.output_item.added", "response.function_call_arguments.delta"]
    added = first[0]["item"]
    assert added["type"] == "function_call" and added["name"] == "f" and added["arguments"] == ""
    assert added["status"] == "in_progress" and first[1]["delta"] == '{"a"' and first[1]["item_id"] == added["id"]
    assert update('{"a"', 2) == []
    # A stream that fails now ends with the call as far as it came (response.failed's output).
    assert writer.output_so_far() == [{**added, "arguments": '{"a"', "status": "incomplete"}]
    second = update('{"a": "x', 4)
    assert [(e["type"], e["delta"]) for e in second] == [("response.function_call_arguments.delta", ': "x')]
    last = update('{"a": "x"}', 6, "stop")
    assert [e["type"] for e in last] == ["response.function_call_arguments.delta",
                                         "response.function_call_arguments.done", "response.output_item.done"]
    assert last[1]["arguments"] == '{"a": "x"}'
    item = last[2]["item"]
    assert item == {**added, "arguments": '{"a": "x"}', "status": "completed"} and writer.items == [item]


def test_a_streamed_forced_call_ends_as_the_whole_reply_has_it(url):
    whole = post(url, "/v1/responses", NAMED).json()
    events = events_of(url, "/v1/responses", NAMED)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    [item_done] = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    final = events[-1]["response"]
    assert deltas == done["arguments"] == item_done["arguments"] == whole["output"][0]["arguments"]
    assert final["output"] == [item_done] and final["status"] == whole["status"]

    def shape(item):
        return {k: v for k, v in item.items() if k not in ("id", "call_id")}
    assert shape(item_done) == shape(whole["output"][0])
    assert item_done["call_id"].startswith("call_") and done["item_id"] == item_done["id"]


# ---- truncate_prompt_tokens -1 ----------------------------------------------------------------------------------

@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": LONG, "max_tokens": 5}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}],
                                                                 "max_tokens": 5}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}],
                                                                 "max_completion_tokens": 5})],
                         ids=["completions", "chat", "chat-max-completion-tokens"])
def test_truncate_prompt_tokens_minus_one_keeps_room_for_max_tokens(url, path, body):
    # -1 kept max_model_len tokens, and the request was a 400 for leaving no room, where vLLM keeps
    # max_model_len - max_tokens.
    reply = post(url, path, {**body, "truncate_prompt_tokens": -1, "temperature": 0})
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] == MAX_MODEL_LEN - 5 and usage["completion_tokens"] == 5


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_truncate_prompt_tokens_minus_one_without_max_tokens_names_truncate_prompt_tokens(url, stream):
    # A chat's max_tokens null asks for the rest of the context: -1 keeps all of it, and nothing is left.
    body = {"messages": [{"role": "user", "content": LONG}], "truncate_prompt_tokens": -1, "stream": stream}
    error = openai_error(post(url, "/v1/chat/completions", body), 400, "truncate_prompt_tokens")
    assert "max_tokens" in error["message"]


def test_a_completions_default_max_tokens_is_kept_room_for(url):
    reply = post(url, "/v1/completions", {"prompt": LONG, "truncate_prompt_tokens": -1})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"] == {"prompt_tokens": MAX_MODEL_LEN - 16, "completion_tokens": 16,
                                     "total_tokens": MAX_MODEL_LEN, "prompt_tokens_details": None,
                                     "completion_tokens_details": None}


def test_truncate_prompt_tokens_minus_one_leaves_a_short_prompt_whole(url):
    reply = post(url, "/v1/completions", {"prompt": "Once upon", "truncate_prompt_tokens": -1, "max_tokens": 2})
    assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == 3, reply.text


def test_a_required_calls_items_stream_each_once_it_is_whole(server):
    # Every call came once the whole array was generated, where chat streams each call once whole.
    body = {"model": "stories", **NAMED, "tool_choice": "required", "stream": True}
    job = ResponsesJob(server[1], req := validate_request(ResponsesRequest, body),
                       validate_request(ChatCompletionRequest, chat_body(req)))
    writer = job.writer()

    def update(text: str, finish: str | None = None) -> list[dict]:
        events = writer.update(CompletionOutput(0, text, [0] * len(text), finish_reason=finish))
        return [json.loads(line[len("data: "):]) for line in events.splitlines() if line.startswith("data: ")]

    assert update('[{"name": "f", "parameters": {"a": "x"') == []
    first = update('[{"name": "f", "parameters": {"a": "x"}}, {"name": "f"')
    assert [e["type"] for e in first] == ["response.output_item.added", "response.function_call_arguments.delta",
                                          "response.function_call_arguments.done", "response.output_item.done"]
    assert first[-1]["item"]["arguments"] == '{"a": "x"}' and first[-1]["output_index"] == 0
    last = update('[{"name": "f", "parameters": {"a": "x"}}, {"name": "f", "parameters": {"a": "y"}}]', "stop")
    assert [e["item"]["arguments"] for e in last if e["type"] == "response.output_item.done"] == ['{"a": "y"}']
    assert [item["arguments"] for item in writer.items] == ['{"a": "x"}', '{"a": "y"}']
    assert writer.finish_reason == "tool_calls"
