"""--reasoning-parser and --tool-call-parser on whole replies and on streams cut at every point."""
from __future__ import annotations

import json

import pytest

from minillm.server.output_parsers import OutputParsers
from minillm.server.reasoning_parsers import ReasoningParser
from minillm.server.tool_parsers import ToolParser


def calls_of(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("name, text, reasoning, content", [
    ("deepseek_r1", "<think>a plan</think>The answer", "a plan", "The answer"),
    ("deepseek_r1", "a plan</think>The answer", "a plan", "The answer"),     # <think> opened in the prompt
    ("deepseek_r1", "\n<think>\nx\n</think>\n\nY", "\n\nx\n", "\n\nY"),   # text before <think>: reasoning
    ("deepseek_r1", "still thinking", "still thinking", None),               # cut short: all reasoning
    ("deepseek_r1", "plan</think>", "plan", None),
    ("deepseek_r1", "</think>only an answer", "", "only an answer"),      # empty reasoning: "", as in vLLM
    ("deepseek_r1", "a</think>b</think>c", "a", "b</think>c"),
    ("deepseek_r1", "", "", None),
    ("qwen3", "<think>hmm</think>\n\nHello", "hmm", "\n\nHello"),
    ("qwen3", "Hello <think> is a tag", "Hello  is a tag", None),      # <think> tags are no reasoning
])
def test_reasoning_split(name, text, reasoning, content):
    assert ReasoningParser(name).split(text) == (reasoning, content)


def test_qwen3_without_thinking_is_all_content():
    parser = ReasoningParser.for_request("qwen3", {"enable_thinking": False})
    assert parser.split("<think>x</think>y") == (None, "<think>x</think>y")
    assert ReasoningParser.for_request("qwen3", {"enable_thinking": True}).split("x</think>y") == ("x", "y")
    # deepseek_r1 has no such switch
    assert ReasoningParser.for_request("deepseek_r1", {"enable_thinking": False}).split("x") == ("x", None)


@pytest.mark.parametrize("name, text, content, calls", [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.\n", [("weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
               '{"x": [1, 2]}}</tool_call> trailing', None, [("a", {}), ("b", {"x": [1, 2]})]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"q": "é"}}', None, [("a", {"q": "é"})]),   # cut short, whole JSON
    ("hermes", '<tool_call>{"name": "a", "arguments": {"q"', '<tool_call>{"name": "a", "arguments": {"q"', []),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("hermes", "no calls here", "no calls here", []),
    ("llama3_json", '{"name": "weather", "parameters": {"city": "Paris"}}', None, [("weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "arguments": {"n": 1}}; {"name": "b", "parameters": {}}', None,
     [("a", {"n": 1}), ("b", {})]),
    ("llama3_json", ' {"name": "a", "parameters": {}} and text', ' {"name": "a", "parameters": {}} and text', []),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    ("llama3_json", 'The answer is {"name": "x"}', 'The answer is {"name": "x"}', []),
])
def test_tool_call_split(name, text, content, calls):
    got_content, got_calls = ToolParser(name).split(text)
    assert got_content == content
    assert calls_of(got_calls) == calls
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in got_calls)


def test_unknown_parsers_are_refused():
    with pytest.raises(ValueError, match="reasoning parser must be one of deepseek_r1, qwen3"):
        ReasoningParser("r1")
    with pytest.raises(ValueError, match="tool call parser must be one of hermes, llama3_json"):
        ToolParser("mistral")


def streamed(parsers: OutputParsers, text: str, cuts: list[int], finish: str = "stop") -> tuple[dict, str]:
    """The deltas of text streamed in pieces cut at `cuts`, joined: (content/reasoning/calls, finish)."""
    stream, joined, pieces = parsers.stream(), {"content": "", "reasoning": "", "tool_calls": []}, []
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    final = None
    for i, piece in enumerate(pieces):
        delta, reason = stream.delta(piece, finish if i == len(pieces) - 1 else None)
        assert delta.get("reasoning") == delta.get("reasoning_content")
        joined["content"] += delta.get("content", "")
        joined["reasoning"] += delta.get("reasoning", "")
        joined["tool_calls"] += delta.get("tool_calls", [])
        final = reason
    return joined, final


TEXTS = {
    "reasoning and calls": '<think>I should call it.</think>\nSure.<tool_call>{"name": "f", "arguments": '
                           '{"a": "</tool_call> in a string?"}}</tool_call>',
    "two calls": 'x<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": '
                 '{"k": 1}}</tool_call>',
    "no tags": "Once upon a time <thin",
    "cut short": "thinking <tool_call> maybe </th",
}


@pytest.mark.parametrize("key", ["reasoning and calls", "two calls", "no tags", "cut short"])
def test_a_stream_cut_anywhere_gives_the_whole_replys_parts(key):
    text = TEXTS[key]
    parsers = OutputParsers(ReasoningParser("deepseek_r1"), ToolParser("hermes"))
    message, finish = parsers.message("assistant", "", text, "stop")
    for cuts in ([], *([i] for i in range(1, len(text))), list(range(1, len(text)))):
        joined, stream_finish = streamed(parsers, text, cuts)
        assert joined["reasoning"] == (message["reasoning"] or "")
        assert joined["content"] == (message["content"] or ""), cuts
        assert calls_of(joined["tool_calls"]) == calls_of(message.get("tool_calls", []))
        assert [c["index"] for c in joined["tool_calls"]] == list(range(len(joined["tool_calls"])))
        assert stream_finish == finish


def test_the_finish_reason_is_tool_calls_with_calls_only():
    parsers = OutputParsers(None, ToolParser("hermes"))
    message, finish = parsers.message("assistant", "", '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
                                      "stop")
    assert finish == "tool_calls" and message["content"] is None and "reasoning" not in message
    assert parsers.message("assistant", "", "plain", "length") == ({"role": "assistant", "content": "plain"},
                                                                   "length")
    joined, finish = streamed(parsers, "plain", [2])
    assert joined["content"] == "plain" and finish == "stop"


def test_llama3_json_streams_prose_at_once_and_holds_json_to_the_end():
    parsers = OutputParsers(None, ToolParser("llama3_json"))
    stream = parsers.stream()
    assert stream.delta("  ", None) == ({}, None)            # too early to say
    assert stream.delta("Hi", None) == ({"content": "  Hi"}, None)
    stream = parsers.stream()
    assert stream.delta('{"name": "f", ', None) == ({}, None)
    delta, finish = stream.delta('"parameters": {"x": 2}}', "stop")
    assert calls_of(delta["tool_calls"]) == [("f", {"x": 2})] and finish == "tool_calls"


def test_include_reasoning_false_drops_it_and_constrained_requests_get_no_parsers():
    parsers = OutputParsers.for_request("deepseek_r1", None, None, "none", False, include_reasoning=False)
    message, _ = parsers.message("assistant", "", "plan</think>answer", "stop")
    assert message == {"role": "assistant", "content": "answer"}
    delta, _ = parsers.stream().delta("plan</think>answer", "stop")
    assert delta == {"content": "answer"}
    assert OutputParsers.for_request("qwen3", "hermes", None, "auto", True, True) is None
    assert OutputParsers.for_request(None, "hermes", None, "none", False, True) is None   # tools not asked for
    assert OutputParsers.for_request(None, None, None, "auto", False, True) is None


def test_parallel_tool_calls_false_keeps_the_first_call_only():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}'
            '</tool_call>')
    parsers = OutputParsers.for_request(None, "hermes", None, "auto", False, True, parallel_tool_calls=False)
    message, finish = parsers.message("assistant", "", text, "stop")
    assert calls_of(message["tool_calls"]) == [("a", {})] and finish == "tool_calls"
    for cuts in ([], [50], list(range(1, len(text)))):
        joined, finish = streamed(parsers, text, cuts)
        assert calls_of(joined["tool_calls"]) == [("a", {})] and finish == "tool_calls"
    both = OutputParsers.for_request(None, "hermes", None, "auto", False, True, parallel_tool_calls=True)
    assert len(both.message("assistant", "", text, "stop")[0]["tool_calls"]) == 2
