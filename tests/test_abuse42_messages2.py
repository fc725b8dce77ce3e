"""/v1/messages against vLLM's reading of it: `system` joins its text blocks as they are and, empty, adds no
system message; a tool_choice {"type": "any"} call that max_tokens or a stop sequence cuts short is a tool_use
block holding its input so far, as a named tool's is (whole and streamed alike); a healthy stream in flight
finishes unchanged meanwhile."""
from __future__ import annotations

import json

import anthropic
import pytest
from test_server_helpers import CHAT_TEMPLATE, HealthyStreams, running_server

from minillm.server.app import ServerOptions

MODEL = "stories"
USER = {"role": "user", "content": "Weather?"}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"name": "weather", "input_schema": SCHEMA}]
ANY = {"type": "any", "disable_parallel_tool_use": True}      # one call: the array is written whole sooner
NAMED = {"type": "tool", "name": "weather"}


@pytest.fixture(scope="module")
def server(stories_path):
    options = ServerOptions(chat_template=CHAT_TEMPLATE)
    with running_server(stories_path, served_model_name=MODEL, max_model_len=512, options=options) as running:
        yield running


@pytest.fixture(scope="module")
def healthy(server):
    streams = HealthyStreams(server[0], {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200})
    yield streams
    streams.check()


def sdk(http) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=str(http.base_url), api_key="none", max_retries=0)


def events(http, body: dict) -> list[dict]:
    """The data of each event of the body's stream."""
    reply = http.post("/v1/messages", json={**body, "stream": True})
    assert reply.status_code == 200, reply.text
    return [json.loads(line[len("data: "):]) for line in reply.text.splitlines() if line.startswith("data: ")]


def tokenized(http, messages: list[dict]) -> int:
    """The prompt tokens of a chat conversation."""
    reply = http.post("/tokenize", json={"model": MODEL, "messages": messages})
    assert reply.status_code == 200, reply.text
    return reply.json()["count"]


# ---- system: its blocks' texts joined as they are; empty, no system message ---------------------------

@pytest.mark.parametrize("system", ["", [], [{"type": "text", "text": ""}], [{"type": "text", "text": ""}] * 3])
def test_an_empty_system_adds_no_system_message(http, healthy_stream, system):
    # vLLM adds the system message only where its text is not empty; "system: \n" was rendered before the turn.
    expected = tokenized(http, [USER])
    body = {"model": MODEL, "messages": [USER], "system": system}
    counted = http.post("/v1/messages/count_tokens", json=body)
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] == expected
    reply = http.post("/v1/messages", json={**body, "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["input_tokens"] + reply.json()["usage"]["cache_read_input_tokens"] == expected


def test_system_text_blocks_are_joined_as_they_are(http, healthy_stream):
    # vLLM joins them with "" (a client splits one prompt into blocks to mark a cache breakpoint); "\n" was put
    # between them, so the prompt was another than the same text given as one string.
    blocks = [{"type": "text", "text": "Tom had"}, {"type": "text", "text": ""}, {"type": "text", "text": " a cat."}]
    expected = tokenized(http, [{"role": "system", "content": "Tom had a cat."}, USER])
    assert expected != tokenized(http, [{"role": "system", "content": "Tom had\n\n a cat."}, USER])
    body = {"model": MODEL, "messages": [USER], "system": blocks}
    assert http.post("/v1/messages/count_tokens", json=body).json()["input_tokens"] == expected
    as_one = {**body, "system": "Tom had a cat.", "max_tokens": 8, "temperature": 0}
    assert http.post("/v1/messages", json={**as_one, "system": blocks}).json()["content"] == \
        http.post("/v1/messages", json=as_one).json()["content"]


@pytest.mark.parametrize("system, param", [([{"type": "text", "text": "a"}, {"type": "image"}], "system[1]"),
                                           ([{"type": "text"}], "system[0]"), (7, "system")])
def test_a_system_block_that_is_no_text_block_is_still_a_400_naming_it(http, system, param):
    reply = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 1, "messages": [USER], "system": system})
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert error["error"]["param"] == param, error


# ---- tool_choice "any" cut short: the call so far, as a named tool's --------------------------------------

def forced(tool_choice: dict, max_tokens: int, **fields) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "messages": [USER], "tools": TOOLS, "tool_choice": tool_choice,
            "temperature": 0, **fields}


def streamed_blocks(http, body: dict) -> tuple[list[dict], dict]:
    """(the tool_use blocks of the body's stream, each with the partial_json it was sent, the message_delta)."""
    data = events(http, body)
    kinds = [event["type"] for event in data]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    blocks = {}
    for event in data:
        if event["type"] == "content_block_start":
            blocks[event["index"]] = {**event["content_block"], "partial_json": ""}
        elif event["type"] == "content_block_delta" and event["delta"]["type"] == "input_json_delta":
            blocks[event["index"]]["partial_json"] += event["delta"]["partial_json"]
    return [blocks[i] for i in sorted(blocks)], data[-2]


def whole_call(http) -> str:
    """The parameters of the greedy "any" call, written whole."""
    [block], delta = streamed_blocks(http, forced(ANY, 200))
    assert delta["delta"]["stop_reason"] == "tool_use", delta
    return block["partial_json"]


@pytest.mark.parametrize("tool_choice", [ANY, NAMED])
def test_a_forced_call_cut_by_max_tokens_is_a_tool_use_block_whole_and_streamed(http, healthy_stream, tool_choice):
    # Under "any" the call max_tokens cut was dropped (content [], as vLLM's whole chat reply drops a required
    # array that does not parse), while a named tool's was kept; vLLM streams both calls' arguments as they
    # grow, and Anthropic's API keeps a forced tool_use that max_tokens cut.
    body = forced(tool_choice, 40)
    whole = http.post("/v1/messages", json=body)
    assert whole.status_code == 200, whole.text
    message = whole.json()
    assert message["stop_reason"] == "max_tokens" and message["stop_sequence"] is None, message
    [use] = message["content"]
    assert (use["type"], use["name"], use["id"][:6]) == ("tool_use", "weather", "toolu_"), use
    [block], delta = streamed_blocks(http, body)
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 40, delta
    assert (block["type"], block["name"]) == ("tool_use", "weather")
    assert block["partial_json"].startswith('{"city"'), block      # the input as generated, cut
    with pytest.raises(ValueError):
        json.loads(block["partial_json"])
    fields = {key: value for key, value in body.items() if key != "temperature"}
    with sdk(http).messages.stream(**fields, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "weather", use["input"])]
    assert final.stop_reason == "max_tokens"


def test_an_any_call_cut_inside_its_parameters_keeps_their_text(http, healthy_stream):
    parameters = whole_call(http)
    value = json.loads(parameters)["city"]
    assert len(value) > 12, parameters
    # max_tokens past the call's name: what it streams is a prefix of the whole call's parameters
    [block], _ = streamed_blocks(http, forced(ANY, 40))
    assert parameters.replace(" ", "").startswith(block["partial_json"].replace(" ", "")), (block, parameters)


def test_an_any_call_cut_before_its_parameters_is_a_tool_use_with_no_input(http, healthy_stream):
    # The name is whole; the array's item ends before "parameters": a tool_use with {} that did not end.
    for max_tokens in range(4, 40):
        message = http.post("/v1/messages", json=forced(ANY, max_tokens)).json()
        if message["content"]:
            break
        assert message["stop_reason"] == "max_tokens", message
    else:
        pytest.fail("no call began within 40 tokens")
    [use] = message["content"]
    assert (use["name"], use["input"], message["stop_reason"]) == ("weather", {}, "max_tokens"), message
    [block], delta = streamed_blocks(http, forced(ANY, max_tokens))
    assert (block["name"], delta["delta"]["stop_reason"]) == ("weather", "max_tokens")
    assert json.loads(block["partial_json"] or "{}") == {}


def test_an_any_call_cut_before_its_name_is_whole_is_no_block(http, healthy_stream):
    message = http.post("/v1/messages", json=forced(ANY, 3)).json()
    assert (message["content"], message["stop_reason"]) == ([], "max_tokens"), message
    blocks, delta = streamed_blocks(http, forced(ANY, 3))
    assert (blocks, delta["delta"]["stop_reason"]) == ([], "max_tokens")


def test_an_any_call_cut_by_a_stop_sequence_keeps_its_input_so_far(http, healthy_stream):
    value = json.loads(whole_call(http))["city"]
    words = [word for word in value.split() if word.isalpha() and len(word) > 2]
    assert len(words) > 1, value
    stop = words[1]
    body = forced(ANY, 200, stop_sequences=[stop])
    message = http.post("/v1/messages", json=body).json()
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", stop), message
    [use] = message["content"]
    assert use["name"] == "weather", use
    [block], delta = streamed_blocks(http, body)
    assert (delta["delta"]["stop_reason"], delta["delta"]["stop_sequence"]) == ("stop_sequence", stop)
    assert stop not in block["partial_json"] and block["partial_json"].startswith('{"city"'), block
