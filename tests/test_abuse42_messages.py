"""/v1/messages and /v1/responses at their edges: an empty tools list leaves the output text under tool_choice
"auto" (as vLLM reads it), the fields of a content block that are taken without effect still have their
types, and a tool_use id names one call only; a healthy stream in flight finishes unchanged meanwhile."""
from __future__ import annotations

import json

import httpx
import pytest
from test_abuse34_parsers import install_script
from test_server_helpers import CHAT_TEMPLATE, HealthyStreams, call_utility, running_server

from minillm.server.app import ServerOptions

CALL_TEXT = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
USER = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def server(stories_path):
    """(url, engine): stories260K with --tool-call-parser hermes, its outputs scripted (install_script)."""
    options = ServerOptions(chat_template=CHAT_TEMPLATE, tool_call_parser="hermes")
    with running_server(stories_path, max_model_len=512, options=options, core_hook=install_script) as running:
        yield running


@pytest.fixture(scope="module")
def healthy(server):
    streams = HealthyStreams(server[0], {"model": "stories", "prompt": "Once upon a time", "max_tokens": 200})
    yield streams
    streams.check()


@pytest.fixture
def scripted_call(server):
    """Every request of the test writes CALL_TEXT (a hermes call of f); later ones write freely again (a
    healthy stream must be started before it, as fixtures listed earlier are)."""
    call_utility(server[1], "script", "choice", [CALL_TEXT])
    yield
    call_utility(server[1], "script", None, None)


def sse_data(response: httpx.Response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]


def anthropic_error(response: httpx.Response, param: str) -> str:
    """The message of an Anthropic-shaped 400 naming param."""
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["param"] == param, body
    return body["error"]["message"]


# ---- tools: [] with tool_choice "auto": no tools, no calls ------------------------------------------------

def test_messages_with_no_tools_and_tool_choice_auto_answer_text(http, healthy_stream, scripted_call):
    # vLLM parses calls only where the request has tools (request.tools, truthy); the call was parsed into a
    # tool_use block of a tool the request never gave.
    body = {"model": "stories", "max_tokens": 100, "messages": [USER], "tools": [], "tool_choice": {"type": "auto"}}
    reply = http.post("/v1/messages", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["content"] == [{"type": "text", "text": CALL_TEXT}]
    assert reply.json()["stop_reason"] == "end_turn"
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as response:
        events = sse_data(response)
    assert "tool_use" not in json.dumps(events)
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == CALL_TEXT and events[-1]["type"] == "message_stop"


def test_chat_with_no_tools_and_tool_choice_auto_answers_content(http, healthy_stream, scripted_call):
    body = {"model": "stories", "max_tokens": 100, "messages": [USER], "tools": [], "tool_choice": "auto"}
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["message"]["content"] == CALL_TEXT and not choice["message"].get("tool_calls")
    assert choice["finish_reason"] == "stop"
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert not any(d.get("tool_calls") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == CALL_TEXT


def test_responses_with_no_tools_and_tool_choice_auto_answer_a_message(http, healthy_stream, scripted_call):
    body = {"model": "stories", "max_output_tokens": 100, "input": "hi", "tools": [], "tool_choice": "auto"}
    reply = http.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    output = reply.json()["output"]
    assert [item["type"] for item in output] == ["message"]
    assert output[0]["content"][0]["text"] == CALL_TEXT


def test_messages_with_a_tool_still_parse_its_call(http, scripted_call):
    # The parser still runs where tools are given.
    body = {"model": "stories", "max_tokens": 100, "messages": [USER], "tool_choice": {"type": "auto"},
            "tools": [{"name": "f", "input_schema": {"type": "object"}}]}
    reply = http.post("/v1/messages", json=body).json()
    assert [(b["type"], b.get("input")) for b in reply["content"]] == [("tool_use", {"a": 1})]
    assert reply["stop_reason"] == "tool_use"


# ---- content blocks' fields ------------------------------------------------------------------------------

def _answered(result: dict) -> list[dict]:
    """A conversation whose last user message answers the call "a" with the tool_result block result."""
    call = {"type": "tool_use", "id": "a", "name": "f", "input": {}}
    return [USER, {"role": "assistant", "content": [call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "r", **result}]}]


@pytest.mark.parametrize("value", ["maybe", 2, {}, [True]])
@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_result_is_error_that_is_no_boolean_is_a_400_naming_it(http, value, stream, healthy_stream):
    # Anthropic's schema and vLLM's (bool | None) hold is_error a boolean; any value was taken.
    body = {"model": "stories", "max_tokens": 4, "messages": _answered({"is_error": value}), "stream": stream}
    message = anthropic_error(http.post("/v1/messages", json=body), "messages[2].content[0].is_error")
    assert "boolean" in message
    response = http.post("/v1/messages/count_tokens", json=body)
    assert anthropic_error(response, "messages[2].content[0].is_error") == message


@pytest.mark.parametrize("value", [True, False, None, "true", 0])
def test_a_tool_result_is_error_read_as_vllm_reads_it_is_served(http, value):
    # pydantic's lax booleans, as vLLM's request model reads them ("true" is true, 0 false).
    body = {"model": "stories", "max_tokens": 2, "messages": _answered({"is_error": value})}
    assert http.post("/v1/messages", json=body).status_code == 200


@pytest.mark.parametrize("block, field", [({"type": "thinking", "thinking": "x", "signature": 5}, "signature"),
                                          ({"type": "redacted_thinking", "data": ["x"]}, "data")])
def test_a_thinking_blocks_unread_field_of_the_wrong_type_is_a_400_naming_it(http, block, field):
    # vLLM's content block holds signature and data strings; they are sent back unread, but typed.
    body = {"model": "stories", "max_tokens": 2, "messages": [USER, {"role": "assistant", "content": [block]}, USER]}
    anthropic_error(http.post("/v1/messages", json=body), f"messages[1].content[0].{field}")


# ---- tool_use ids ----------------------------------------------------------------------------------------

def _calls(*ids: str) -> dict:
    return {"role": "assistant", "content": [{"type": "tool_use", "id": i, "name": "f", "input": {}} for i in ids]}


@pytest.mark.parametrize("messages, param", [
    ([USER, _calls("a", "a")], "messages[1].content[1].id"),
    ([USER, _calls("a"), {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a"}]}, _calls("b", "a")],
     "messages[3].content[1].id"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_use_id_given_twice_is_a_400_naming_the_second(http, messages, param, stream, healthy_stream):
    # Anthropic's API refuses it ("tool_use ids must be unique"): a tool_result with that id would answer
    # two calls. It was taken, both calls rendered with one id.
    body = {"model": "stories", "max_tokens": 4, "messages": messages, "stream": stream}
    assert "unique" in anthropic_error(http.post("/v1/messages", json=body), param)


def test_distinct_tool_use_ids_are_served(http):
    answer = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": i, "content": "r"} for i in "ab"]}
    body = {"model": "stories", "max_tokens": 2, "messages": [USER, _calls("a", "b"), answer]}
    assert http.post("/v1/messages", json=body).status_code == 200
