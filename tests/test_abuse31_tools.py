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
