"""Tool calls parsed out of replies that max_tokens cut short: the finish reason says "length" (as
OpenAI and vLLM's streaming path report a truncated turn), whole and streamed alike, so a client
never takes a cut turn for a finished call."""
from __future__ import annotations

import json

import pytest

from minillm.server.output_parsers import OutputParsers
from minillm.server.reasoning_parsers import ReasoningParser
from minillm.server.tool_parsers import ToolParser

CALL_F = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'

# Replies cut by max_tokens (finish "length"), each with at least one whole call before the cut.
CUT_REPLIES = {
    "a second call cut mid-JSON": CALL_F + '<tool_call>{"name": "g", "argu',
    "a call whose closing tag never came": '<tool_call>{"name": "f", "arguments": {"a": 1}}',
    "text after a whole call": CALL_F + "\nNow I w",
    "a second call cut at its tag": CALL_F + "<tool_",
}


def names(calls: list[dict]) -> list[str]:
    return [c["function"]["name"] for c in calls]


def streamed(parsers: OutputParsers, text: str, cut: int, finish: str) -> tuple[list[dict], str | None]:
    """(tool call deltas, finish reason) of text streamed in two pieces split at cut."""
    stream = parsers.stream()
    first, _ = stream.delta(text[:cut], None)
    last, reason = stream.delta(text[cut:], finish)
    return first.get("tool_calls", []) + last.get("tool_calls", []), reason


@pytest.mark.parametrize("key", list(CUT_REPLIES))
@pytest.mark.parametrize("reasoning", [None, "deepseek_r1"])
def test_a_reply_cut_by_max_tokens_finishes_with_length_whole_and_streamed(key, reasoning):
    # The finish was "tool_calls" once a call was parsed (streamed: once one was sent), hiding the cut.
    text = ("plan</think>" if reasoning else "") + CUT_REPLIES[key]
    parsers = OutputParsers(ReasoningParser(reasoning) if reasoning else None, ToolParser("hermes"))
    _, finish = parsers.message("assistant", "", text, "length")
    assert finish == "length"
    for cut in range(len(text) + 1):
        _, stream_finish = streamed(parsers, text, cut, "length")
        assert stream_finish == "length", cut


def test_a_whole_reply_with_calls_still_finishes_with_tool_calls():
    parsers = OutputParsers(None, ToolParser("hermes"))
    message, finish = parsers.message("assistant", "", CALL_F + CALL_F, "stop")
    assert finish == "tool_calls" and names(message["tool_calls"]) == ["f", "f"]
    for cut in range(len(CALL_F) * 2 + 1):
        calls, stream_finish = streamed(parsers, CALL_F + CALL_F, cut, "stop")
        assert stream_finish == "tool_calls" and names(calls) == ["f", "f"]
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1}, {"a": 1}]


def test_llama3_json_cut_by_max_tokens_finishes_with_length():
    parsers = OutputParsers(None, ToolParser("llama3_json"))
    text = '{"name": "f", "parameters": {"a": 1}}'     # whole JSON; the ";" and the next call never came
    message, finish = parsers.message("assistant", "", text, "length")
    assert names(message["tool_calls"]) == ["f"] and finish == "length"
    calls, stream_finish = streamed(parsers, text, 5, "length")
    assert names(calls) == ["f"] and stream_finish == "length"


# ---- tool_choice "required": each tool's parameters keep their own references -----------------------

def function_tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def unit_tool(name: str, units: list[str], where: str = "$defs") -> dict:
    """A tool whose parameters refer to a definition of theirs (draft-07 and pydantic v1 write
    "definitions", pydantic v2 "$defs")."""
    return function_tool(name, {where: {"Unit": {"enum": units}}, "type": "object",
                                "properties": {"unit": {"$ref": f"#/{where}/Unit"}}, "required": ["unit"],
                                "additionalProperties": False})


def call_text(name: str, parameters) -> str:
    return json.dumps([{"name": name, "parameters": parameters}], separators=(",", ":"))


@pytest.fixture(scope="module")
def manager(tok):
    from minillm.structured_output import StructuredOutputManager
    mgr = StructuredOutputManager.from_tokenizer(tok, 512, max_num_seqs=2)
    yield mgr
    mgr.shutdown()


def accepts(manager, params, text: str) -> bool:
    """Whether the constraint takes text as a whole output."""
    matcher = manager.grammar_init(params).result().new_matcher()
    return matcher.accept_tokens(manager.ll_tokenizer.tokenize_str(text)) and matcher.can_terminate()


REFERRING = {
    # zod-to-json-schema's default: a schema used twice is a reference to its first place
    "a property": function_tool("f", {"type": "object", "properties": {"a": {"enum": ["x", "y"]},
                                                                       "b": {"$ref": "#/properties/a"}},
                                      "required": ["a", "b"], "additionalProperties": False}),
    "definitions": unit_tool("f", ["c", "k"], "definitions"),
    "the root": function_tool("f", {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
        "type": "array", "items": {"$ref": "#"}}}, "required": ["v"], "additionalProperties": False}),
}
GOOD_AND_BAD = {
    "a property": ({"a": "x", "b": "y"}, {"a": "x", "b": "z"}),
    "definitions": ({"unit": "k"}, {"unit": "f"}),
    "the root": ({"v": 1, "kids": [{"v": 2, "kids": []}]}, {"v": 1, "kids": [[{"name": "f", "parameters": {"v": 2}}]]}),
}


@pytest.mark.parametrize("key", list(REFERRING))
def test_required_takes_parameters_that_refer_inside_themselves_as_a_named_choice_does(manager, key):
    # Inside the array schema "#/..." pointed at the array's root: a 400 ("Pointer '/definitions/Unit'
    # does not exist") for parameters a named tool_choice took, or (a "#" of a recursive schema) a
    # constraint that let a call's arguments hold more calls.
    from minillm.server.tool_calls import forced_tool_calls
    good, bad = GOOD_AND_BAD[key]
    params = forced_tool_calls("required", [REFERRING[key]], None).constraint()
    assert accepts(manager, params, call_text("f", good))
    assert not accepts(manager, params, call_text("f", bad))


def test_two_tools_may_give_one_definition_name_different_schemas(manager):
    # Both definitions went to the array's top, one name for two schemas: refused with a 400.
    from minillm.server.tool_calls import forced_tool_calls
    params = forced_tool_calls("required", [unit_tool("a", ["c"]), unit_tool("b", ["f"])], None).constraint()
    assert accepts(manager, params, call_text("a", {"unit": "c"}))
    assert accepts(manager, params, call_text("b", {"unit": "f"}))
    assert not accepts(manager, params, call_text("a", {"unit": "f"}))
    assert not accepts(manager, params, call_text("b", {"unit": "c"}))


# ---- a call whose "JSON" only Python reads ------------------------------------------------------------

@pytest.mark.parametrize("name, text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": [1, -Infinity]}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1e400}}</tool_call>'),    # a float past float's range
    ("llama3_json", '{"name": "f", "parameters": {"x": Infinity}}'),
])
def test_a_call_with_nan_or_infinity_is_no_call(name, text):
    # Python's json read them, and the call's arguments came back as "NaN" (no JSON a client can read;
    # /v1/messages' tool_use input held a float NaN that its JSON response could not write: a 500).
    parsers = OutputParsers(None, ToolParser(name))
    message, finish = parsers.message("assistant", "", text, "stop")
    assert message == {"role": "assistant", "content": text} and finish == "stop"
    for cut in range(len(text) + 1):
        stream = parsers.stream()
        first, _ = stream.delta(text[:cut], None)
        last, stream_finish = stream.delta(text[cut:], "stop")
        assert "tool_calls" not in first and "tool_calls" not in last and stream_finish == "stop"
        assert first.get("content", "") + last.get("content", "") == text
