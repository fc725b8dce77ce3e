"""Tool calls whose arguments hold numbers JSON carries but a Python float does not (1e400), and the
work a streamed call costs the API server as it grows: each character read a bounded number of
times, not once for every delta that follows it."""
from __future__ import annotations

import json

import pytest

from minillm.server import tool_calls, tool_parsers
from minillm.server.output_parsers import OutputParsers
from minillm.server.serving_messages import _tool_use
from minillm.server.tool_calls import forced_tool_calls
from minillm.server.tool_parsers import ToolParser

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def required_calls(text: str) -> list[dict]:
    return forced_tool_calls("required", TOOLS, None).calls(text)


# ---- numbers past a float's range --------------------------------------------------------------------

def test_required_arguments_past_floats_range_are_the_text_the_model_wrote():
    # They came back as '{"x": Infinity}': no JSON, where the model wrote JSON.
    [call] = required_calls('[{"name": "f", "parameters": {"x": 1e400, "y": [-2E+999]}}]')
    assert call["function"]["arguments"] == '{"x": 1e400, "y": [-2E+999]}'
    json.loads(call["function"]["arguments"])
    [call] = required_calls('[{"name": "f", "parameters": {"x": 1.5}}]')      # others as vLLM writes them
    assert call["function"]["arguments"] == '{"x": 1.5}'


def test_required_arguments_with_an_integer_past_pythons_digit_limit_are_a_call():
    # The item never decoded (ValueError: "Exceeds the limit (4300 digits)"), so the call and every
    # call after it were lost.
    big = "9" * 5000
    calls = required_calls(f'[{{"name": "f", "parameters": {{"n": {big}}}}}, {{"name": "f", "parameters": {{}}}}]')
    assert [c["function"]["arguments"] for c in calls] == [f'{{"n": {big}}}', "{}"]


def test_required_streamed_calls_match_the_whole_reply():
    text = '[{"name": "f", "parameters": {"x": 1e400}}, {"name": "f", "parameters": {"s": "]}\\"{"}}]'
    whole = [c["function"]["arguments"] for c in required_calls(text)]
    for cut in range(len(text) + 1):
        stream = forced_tool_calls("required", TOOLS, None).stream()
        deltas = stream.deltas(text[:cut], text[:cut]) + stream.deltas(text[cut:], text)
        assert [d["function"]["arguments"] for d in deltas] == whole, cut
        assert [d["index"] for d in deltas] == [0, 1]


@pytest.mark.parametrize("arguments, expected", [
    ('{"x": 1e400, "y": 0}', {"x": None, "y": 0}),
    ('{"x": [-1E999, 2.5]}', {"x": [None, 2.5]}),
    ('{"n": ' + "1" * 5000 + "}", {"n": None}),
], ids=["1e400", "-1E999", "5000 digits"])
def test_a_tool_use_input_always_serialises(arguments, expected):
    # {"x": inf} made the response's JSON fail: /v1/messages answered 500 (the stream wrote "Infinity").
    block = _tool_use({"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "f", "arguments": arguments}})
    assert block["input"] == expected
    json.dumps(block, allow_nan=False)


# ---- streamed parsing is linear -----------------------------------------------------------------------

class CountingDecoder(json.JSONDecoder):
    """A JSONDecoder that counts the characters it reads: those of each value it decodes, and all those
    after the start of a value it could not decode (it read on to the end of the text)."""

    def __init__(self, decoder: json.JSONDecoder) -> None:
        super().__init__(parse_int=decoder.parse_int, parse_float=decoder.parse_float,
                         parse_constant=decoder.parse_constant)
        self.num_chars = 0

    def raw_decode(self, s, idx=0):
        try:
            value, end = super().raw_decode(s, idx)
        except ValueError:
            self.num_chars += len(s) - idx
            raise
        self.num_chars += end - idx
        return value, end


def long_arguments(n: int) -> dict:
    return {"items": [{"k": i, "s": 'a "quoted" \\ <tool_call> {[' * 3} for i in range(n)]}


def hermes_work(monkeypatch, n: int) -> tuple[int, list[dict], str, int]:
    decoder = CountingDecoder(tool_parsers._DECODER)
    monkeypatch.setattr(tool_parsers, "_DECODER", decoder)
    call = json.dumps({"name": "f", "arguments": long_arguments(n)})
    text = f"Sure.<tool_call>\n{call}\n</tool_call>\n<tool_call>{call}</tool_call>"
    stream = OutputParsers(None, ToolParser("hermes")).stream()
    deltas = [stream.delta(text[i:i + 3], None)[0] for i in range(0, len(text), 3)]
    deltas.append(stream.delta("", "stop")[0])
    content = "".join(d.get("content", "") for d in deltas)
    return decoder.num_chars, [c for d in deltas for c in d.get("tool_calls", [])], content, len(text)


def test_a_streamed_hermes_call_is_parsed_once(monkeypatch):
    # Each delta reparsed the open call from its start: a 56 KB call cost about 1 s of CPU.
    num_chars, calls, content, length = hermes_work(monkeypatch, 400)
    assert content == "Sure." and [c["index"] for c in calls] == [0, 1]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [long_arguments(400)] * 2
    assert num_chars <= 2 * length


def required_work(monkeypatch, n: int) -> tuple[int, list[dict], int]:
    decoder = CountingDecoder(tool_calls._DECODER)
    monkeypatch.setattr(tool_calls, "_DECODER", decoder)
    item = json.dumps({"name": "f", "parameters": long_arguments(n)})
    text = f"[{item}, {item}]"
    stream = forced_tool_calls("required", TOOLS, None).stream()
    deltas = [d for i in range(0, len(text), 3) for d in stream.deltas(text[i:i + 3], text[:i + 3])]
    return decoder.num_chars, deltas, len(text)


def test_a_streamed_required_call_is_parsed_once(monkeypatch):
    num_chars, deltas, length = required_work(monkeypatch, 400)
    assert [json.loads(d["function"]["arguments"]) for d in deltas] == [long_arguments(400)] * 2
    assert num_chars <= 3 * length


# ---- a call nested past the JSON reader's recursion limit ---------------------------------------------

DEEP = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize("name, text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": ' + DEEP + "}}</tool_call>"),
    ("llama3_json", '{"name": "f", "parameters": {"a": ' + DEEP + "}}"),
], ids=["hermes", "llama3_json"])
def test_a_call_nested_too_deep_to_read_is_content(name, text):
    # json raised RecursionError out of the parser: a chat reply with tools answered 500.
    parsers = OutputParsers(None, ToolParser(name))
    message, finish = parsers.message("assistant", "", text, "stop")
    assert message == {"role": "assistant", "content": text} and finish == "stop"
    stream = parsers.stream()
    first, _ = stream.delta(text[:100], None)
    last, _ = stream.delta(text[100:], "stop")
    assert first.get("content", "") + last.get("content", "") == text


# ---- a stream never copies what it holds for each delta -----------------------------------------------

class Piece(str):
    """A delta that counts the characters copied when a held text is joined to it (text + piece)."""

    num_copied = 0

    def __radd__(self, other: str) -> str:
        Piece.num_copied += len(other)
        return str.__add__(other, self)


@pytest.mark.parametrize("name, text", [
    ("llama3_json", json.dumps({"name": "f", "parameters": long_arguments(300)})),
    ("hermes", "<tool_call>" + json.dumps({"name": "f", "arguments": long_arguments(300)}) + "</tool_call>"),
], ids=["llama3_json", "hermes"])
def test_a_streamed_call_is_held_without_copying_it_for_each_delta(monkeypatch, name, text):
    # llama3_json held the call as one string and appended each delta to it: O(n^2) characters copied.
    monkeypatch.setattr(Piece, "num_copied", 0)
    stream = ToolParser(name).stream()
    calls = [c for i in range(0, len(text), 3) for c in stream.feed(Piece(text[i:i + 3]))[1]]
    content, more = stream.finish()
    assert content == "" and [json.loads(c["function"]["arguments"]) for c in calls + more] == [long_arguments(300)]
    assert Piece.num_copied <= len(text)


# ---- a lone surrogate (JSON's "\ud800", which no UTF-8 text holds) in a call's arguments ---------------

LONE = '{"x": "\\ud800", "y": "\\ud83d\\ude00 é"}'


def test_hermes_arguments_with_a_lone_surrogate_keep_its_escape():
    # json.dumps(ensure_ascii=False) wrote the surrogate itself: the reply could not be encoded (a 500).
    text = f'<tool_call>{{"name": "f", "arguments": {LONE}}}</tool_call>'
    parsers = OutputParsers(None, ToolParser("hermes"))
    message, _ = parsers.message("assistant", "", text, "stop")
    stream = parsers.stream()
    streamed = stream.delta(text[:20], None)[0].get("tool_calls", []) + stream.delta(text[20:], "stop")[0]["tool_calls"]
    for call in message["tool_calls"] + streamed:
        arguments = call["function"]["arguments"]
        arguments.encode()
        assert json.loads(arguments) == json.loads(LONE)


def test_required_arguments_with_a_lone_surrogate_are_the_text_as_written():
    [call] = required_calls(f'[{{"name": "f", "parameters": {LONE}}}]')
    assert call["function"]["arguments"] == LONE


def test_a_tool_use_input_with_a_lone_surrogate_is_valid_unicode():
    block = _tool_use({"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "f", "arguments": LONE}})
    assert block["input"] == {"x": "\ufffd", "y": "\U0001F600 é"}
    json.dumps(block, ensure_ascii=False).encode()
