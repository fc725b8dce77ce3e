"""Tool calling at its edges: a hermes call cut inside its closing tag reads as vLLM's parser reads
it, and /v1/messages keeps a call's arguments that are no JSON object (a text block) and takes only
object input_schemas (a tool_use input is an object)."""
from __future__ import annotations

import json

import httpx
import pytest
import test_abuse41_tools
from test_server_helpers import call_utility

from minillm.server.output_parsers import OutputParsers
from minillm.server.tool_parsers import ToolParser

CALL = '{"name": "f", "arguments": {"a": 1}}'


def names_and_arguments(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def streamed(parsers: OutputParsers, text: str, size: int, finish: str) -> tuple[str | None, list, str | None]:
    """(content, calls, finish reason) of text streamed in pieces of size characters."""
    stream, content, calls, reason = parsers.stream(), "", [], None
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for i, piece in enumerate(pieces):
        delta, reason = stream.delta(piece, finish if i == len(pieces) - 1 else None)
        content += delta.get("content", "")
        calls += names_and_arguments(delta.get("tool_calls", []))
    return content or None, calls, reason


# ---- hermes: a call whose </tool_call> was cut ----------------------------------------------------------

# vLLM's extract_tool_calls loads the text after an unclosed <tool_call> as JSON: a whole call with
# nothing after it is a call, one followed by part of its closing tag does not load (the output is content).
@pytest.mark.parametrize("tail", ["<", "</", "</tool_", "</tool_call", " \n</tool_cal"])
def test_a_call_cut_inside_its_closing_tag_is_content_whole_and_streamed(tail):
    text = f"Sure.<tool_call>{CALL}{tail}"
    assert ToolParser("hermes").split(text) == (text, [])
    parsers = OutputParsers(None, ToolParser("hermes"))
    message, finish = parsers.message("assistant", "", text, "length")
    assert message["content"] == text and "tool_calls" not in message and finish == "length"
    for size in (1, 2, 3, 7, len(text)):
        assert streamed(parsers, text, size, "length") == (text, [], "length"), size


@pytest.mark.parametrize("tail", ["", "\n", " \n "])
def test_a_whole_call_whose_closing_tag_never_came_is_still_a_call(tail):
    text = f"<tool_call>{CALL}{tail}"
    content, calls = ToolParser("hermes").split(text)
    assert content is None and names_and_arguments(calls) == [("f", '{"a": 1}')]
    parsers = OutputParsers(None, ToolParser("hermes"))
    for size in (1, 4, len(text)):
        assert streamed(parsers, text, size, "length") == (None, [("f", '{"a": 1}')], "length"), size


def test_a_second_call_cut_inside_its_closing_tag_leaves_the_whole_output_as_content():
    text = f"x<tool_call>{CALL}</tool_call><tool_call>{CALL}</tool_c"
    assert ToolParser("hermes").split(text) == (text, [])
    # A stream has sent the first call by then: the second's text follows as content.
    parsers = OutputParsers(None, ToolParser("hermes"))
    second = text[len(f"x<tool_call>{CALL}</tool_call>"):]
    assert streamed(parsers, text, 3, "length") == ("x" + second, [("f", '{"a": 1}')], "length")


# ---- through the server ------------------------------------------------------------------------------------

server = test_abuse41_tools.server          # a fixture: stories260K with hermes, its outputs scripted
sse_data = test_abuse41_tools.sse_data


MESSAGES_BODY = {"model": "stories", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                 "tools": [{"name": "f", "input_schema": {"type": "object"}}]}


def message_and_stream(url: str, body: dict) -> tuple[dict, list[dict]]:
    """A /v1/messages reply and the events of the same request streamed."""
    reply = httpx.post(f"{url}/v1/messages", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    with httpx.stream("POST", f"{url}/v1/messages", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        events = [json.loads(d) for d in sse_data(response)]
    assert events[-1]["type"] == "message_stop", events[-2:]
    return reply.json(), events


def streamed_blocks(events: list[dict]) -> list[dict]:
    """The content blocks a stream's events build, as Anthropic's SDK joins them."""
    blocks: dict[int, dict] = {}
    for event in events:
        if event["type"] == "content_block_start":
            blocks[event["index"]] = dict(event["content_block"], partial="")
        elif event["type"] == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "input_json_delta":
                block["partial"] += delta["partial_json"]
    out = []
    for i in sorted(blocks):
        block = blocks[i]
        partial = block.pop("partial")
        if block["type"] == "tool_use":
            block["input"] = json.loads(partial) if partial else {}
        out.append(block)
    return out


def stop_reason(events: list[dict]) -> str:
    return next(e for e in events if e["type"] == "message_delta")["delta"]["stop_reason"]


@pytest.mark.parametrize("arguments", ['[1, "é"]', '"x"', "null", "3"])
def test_a_messages_call_whose_arguments_are_no_object_keeps_them_as_text(server, arguments):
    url, engine = server
    output = f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>'
    call_utility(engine, "script", "choice", [output])
    reply, events = message_and_stream(url, MESSAGES_BODY)
    # Anthropic's tool_use input is an object: no tool_use block, the call as the text the model wrote.
    want = [{"type": "text", "text": json.dumps({"name": "f", "arguments": json.loads(arguments)}, ensure_ascii=False)}]
    assert reply["content"] == want and reply["stop_reason"] == "end_turn"
    assert [{k: b[k] for k in ("type", "text")} for b in streamed_blocks(events)] == want
    assert stop_reason(events) == "end_turn"


def test_a_messages_object_call_beside_one_with_list_arguments(server):
    url, engine = server
    output = f'<tool_call>{CALL}</tool_call><tool_call>{{"name": "f", "arguments": [2]}}</tool_call>'
    call_utility(engine, "script", "choice", [output])
    reply, events = message_and_stream(url, MESSAGES_BODY)
    kinds = [(b["type"], b.get("input"), b.get("text")) for b in reply["content"]]
    assert kinds == [("tool_use", {"a": 1}, None), ("text", None, '{"name": "f", "arguments": [2]}')]
    assert reply["stop_reason"] == "tool_use"
    assert [(b["type"], b.get("input"), b.get("text")) for b in streamed_blocks(events)] == kinds
    assert stop_reason(events) == "tool_use"


@pytest.mark.parametrize("schema_type", ["array", "string", ["object", "null"], None])
def test_a_messages_tool_whose_input_schema_is_no_object_is_a_400(server, schema_type):
    # Anthropic's input_schema is an object schema (its type "object"): a forced call of any other
    # could never be a tool_use block.
    url, _ = server
    body = dict(MESSAGES_BODY, tools=[{"name": "f", "input_schema": {"type": schema_type}}],
                tool_choice={"type": "tool", "name": "f"})
    reply = httpx.post(f"{url}/v1/messages", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "tools[0].input_schema" and '"object"' in error["message"], error


def test_a_messages_tool_whose_input_schema_has_no_type_takes_objects(server):
    # As vLLM reads it: an input_schema without a type is an object schema, so a forced call is a tool_use.
    url, engine = server
    call_utility(engine, "script", None, None)
    schema = {"properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}
    body = dict(MESSAGES_BODY, tools=[{"name": "f", "input_schema": schema}], tool_choice={"type": "tool", "name": "f"})
    reply, events = message_and_stream(url, body)
    [block] = reply["content"]
    assert block["type"] == "tool_use" and block["input"] in ({"a": 1}, {"a": 2}), reply
    [block] = streamed_blocks(events)
    assert block["type"] == "tool_use" and block["input"] in ({"a": 1}, {"a": 2}), events
