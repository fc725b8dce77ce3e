"""Tool calling at its edges: a hermes call cut inside its closing tag reads as vLLM's parser reads it."""
from __future__ import annotations


import pytest

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
