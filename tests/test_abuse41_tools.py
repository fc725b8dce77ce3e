"""Tool calling when the model writes malformed calls: the parsers read them as vLLM's parsers of the
same name do (a call that does not parse leaves the output as content), whole and streamed alike,
and through the server no reply fails and every stream ends with its final event."""
from __future__ import annotations

import json

import httpx
import pytest
from test_abuse34_parsers import install_script
from test_server_helpers import CHAT_TEMPLATE, call_utility, running_server

from minillm.server.app import ServerOptions
from minillm.server.output_parsers import OutputParsers
from minillm.server.tool_parsers import ToolParser

CALL = '{"name": "f", "arguments": {"a": 1}}'
# hermes: (model output, (content, [(name, arguments)])) as vLLM's Hermes2ProToolParser.extract_tool_calls
# returns them: the text before the first <tool_call> is the content (None where empty), and a call
# region whose JSON does not load, or lacks its name or arguments, leaves the whole output as content.
HERMES = {
    "truncated JSON": ('Hi <tool_call>{"name": "f", "arguments": {"a": ', None),
    "truncated after a call": (f'<tool_call>{CALL}</tool_call><tool_call>{{"name":', None),
    "arguments a string": ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>', (None, [("f", '"x"')])),
    "arguments null": ('<tool_call>{"name": "f", "arguments": null}</tool_call>', (None, [("f", "null")])),
    "arguments a list": ('<tool_call>{"name": "f", "arguments": [1, "é"]}</tool_call>', (None, [("f", '[1, "é"]')])),
    "no arguments": ('<tool_call>{"name": "f"}</tool_call>', None),
    "name a number": ('<tool_call>{"name": 5, "arguments": {}}</tool_call>', None),
    "a list of calls": (f'<tool_call>[{CALL}]</tool_call>', None),
    "nested tags": (f'<tool_call><tool_call>{CALL}</tool_call></tool_call>', None),
    "closing tag twice": (f'pre <tool_call>{CALL}</tool_call></tool_call>', ("pre ", [("f", '{"a": 1}')])),
    "text after the JSON": (f'<tool_call>{CALL} and more</tool_call>', None),
    "empty call": ("<tool_call></tool_call>", None),
    "a lone tag": ("Sure <tool_call>", None),
    "a tool not in tools": ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', (None, [("nope", "{}")])),
    "text between calls": (f'a<tool_call>{CALL}</tool_call> b <tool_call>{CALL}</tool_call> c',
                           ("a", [("f", '{"a": 1}'), ("f", '{"a": 1}')])),
    "unclosed whole call": (f"<tool_call>{CALL}", (None, [("f", '{"a": 1}')])),
}
# llama3_json: an output that opens with a call (vLLM's stream reads no other): a call that does not
# parse, or lacks its name, leaves the whole output as content.
LLAMA = {
    "truncated JSON": ('{"name": "f", "parameters": {"a": ', None),
    "second truncated": (f'{CALL}; {{"name": "g", "parame', None),
    "parameters a number": ('<|python_tag|>{"name": "f", "parameters": 3}', (None, [("f", "3")])),
    "no name": ('{"parameters": {}}', None),
    "a tool not in tools": ('{"name": "nope", "arguments": {}}', (None, [("nope", "{}")])),
    "two calls": (f'{CALL}; {{"name": "g", "parameters": {{}}}}', (None, [("f", '{"a": 1}'), ("g", "{}")])),
}


def names_and_arguments(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def streamed(parsers: OutputParsers, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """(content, calls, finish reason) of a stream whose output came in pieces (the last with finish "stop")."""
    stream, content, calls, finish = parsers.stream(), "", [], None
    for i, piece in enumerate(pieces):
        delta, finish = stream.delta(piece, "stop" if i == len(pieces) - 1 else None)
        content += delta.get("content", "")
        calls += names_and_arguments(delta.get("tool_calls", []))
    return content or None, calls, finish


def pieces_of(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


@pytest.mark.parametrize("parser, text, expected", [
    *(("hermes", text, expected) for text, expected in HERMES.values()),
    *(("llama3_json", text, expected) for text, expected in LLAMA.values())],
    ids=[*(f"hermes-{k}" for k in HERMES), *(f"llama3_json-{k}" for k in LLAMA)])
def test_a_malformed_call_reads_as_vllms_parser_reads_it(parser, text, expected):
    content, calls = expected if expected is not None else (text, [])
    got_content, got_calls = ToolParser(parser).split(text)
    assert (got_content, names_and_arguments(got_calls)) == (content, calls)
    parsers = OutputParsers(None, ToolParser(parser))
    message, finish = parsers.message("assistant", "", text, "stop")
    assert message["content"] == content and finish == ("tool_calls" if calls else "stop")
    # Streamed in pieces of every size from one character on (tags and JSON cut anywhere), it reads
    # as the whole reply; a stream that sent a whole call before one that does not parse sends that
    # one's text as content (as vLLM's stream, the earlier call cannot be taken back).
    sent_before = text.startswith(f"<tool_call>{CALL}</tool_call><tool_call>") and expected is None
    for size in (1, 2, 3, 5, 11, len(text)):
        want = (text[len(f"<tool_call>{CALL}</tool_call>"):], [("f", '{"a": 1}')], "tool_calls") \
            if sent_before else (content, calls, finish)
        assert streamed(parsers, pieces_of(text, size)) == want, size


def test_a_huge_call_is_read_whole_and_streamed_in_linear_time():
    arguments = {"text": "ab\\\"é" * 200_000, "n": list(range(10_000))}
    text = f'<tool_call>{{"name": "f", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}</tool_call>'
    parsers = OutputParsers(None, ToolParser("hermes"))
    content, calls, finish = streamed(parsers, pieces_of(text, 7))
    assert content is None and finish == "tool_calls"
    [(name, got)] = calls
    assert name == "f" and json.loads(got) == arguments
    cut = text[:-len("</tool_call>") - 1]       # its JSON one brace short: no call, the output as content
    assert streamed(parsers, pieces_of(cut, 7))[:2] == (cut, [])


# ---- through the server --------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CHOICES = {"auto": "auto", "required": "required", "named": {"type": "function", "function": {"name": "f"}}}
SERVED = {
    "truncated": 'Hi <tool_call>{"name": "f", "arguments": {"a": "é',
    "arguments a string": 'é <tool_call>{"name": "f", "arguments": "x"}</tool_call>',
    "unknown tool": '<tool_call>{"name": "nope", "arguments": {"a": "ü"}}</tool_call>',
    "nested": f'<tool_call><tool_call>{CALL}</tool_call></tool_call>',
    "required array, bad items": '[{"name": "nope", "parameters": 5}, 7, {"name": "f"',
    "long": '<tool_call>{"name": "f", "arguments": {"s": "' + "ab" * 60 + '"}}</tool_call>',
}


@pytest.fixture(scope="module")
def server(stories_path):
    """(url, engine): stories260K with --tool-call-parser hermes, its outputs scripted (install_script)."""
    options = ServerOptions(chat_template=CHAT_TEMPLATE, tool_call_parser="hermes")
    with running_server(stories_path, max_model_len=512, options=options, core_hook=install_script) as running:
        yield running


def sse_data(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def chat_checked(url: str, body: dict) -> dict:
    """A chat reply and a chat stream of body: 200 both, the stream ends with the reply's finish reason
    and [DONE], and its deltas join to the reply's content and calls. The reply's choice."""
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    [choice] = reply.json()["choices"]
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        data = sse_data(response)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all("error" not in c for c in chunks), chunks
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert deltas[-1]["finish_reason"] == choice["finish_reason"]
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for call in delta["delta"].get("tool_calls", []):
            entry = calls.setdefault(call["index"], ["", ""])
            entry[0] += call["function"].get("name") or ""
            entry[1] += call["function"].get("arguments") or ""
    assert "".join(d["delta"].get("content") or "" for d in deltas) == (choice["message"]["content"] or "")
    assert [tuple(calls[i]) for i in sorted(calls)] == names_and_arguments(choice["message"].get("tool_calls") or [])
    return choice


@pytest.mark.parametrize("choice", list(CHOICES), ids=list(CHOICES))
@pytest.mark.parametrize("output", list(SERVED.values()), ids=list(SERVED))
def test_a_malformed_call_is_a_chat_reply_and_a_whole_stream(server, output, choice):
    url, engine = server
    call_utility(engine, "script", "choice", [output])
    reply = chat_checked(url, {"model": "stories", "messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 400, "tools": TOOLS, "tool_choice": CHOICES[choice]})
    if choice == "auto":        # the parser's reading, as vLLM's hermes reads the same output
        content, calls = ToolParser("hermes").split(output)
        assert reply["message"]["content"] == content
        assert names_and_arguments(reply["message"].get("tool_calls") or []) == names_and_arguments(calls)


@pytest.mark.parametrize("output", list(SERVED.values()), ids=list(SERVED))
def test_a_malformed_call_is_a_responses_and_a_messages_reply_and_stream(server, output):
    url, engine = server
    call_utility(engine, "script", "choice", [output])
    body = {"model": "stories", "input": "hi", "max_output_tokens": 400,
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}
    reply = httpx.post(f"{url}/v1/responses", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True}, timeout=60) as response:
        events = [json.loads(d) for d in sse_data(response)]
    assert events[-1]["type"] == "response.completed", events[-1]
    assert [item["type"] for item in events[-1]["response"]["output"]] == \
        [item["type"] for item in reply.json()["output"]]
    body = {"model": "stories", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400,
            "tools": [{"name": "f", "input_schema": {"type": "object"}}]}
    reply = httpx.post(f"{url}/v1/messages", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    with httpx.stream("POST", f"{url}/v1/messages", json={**body, "stream": True}, timeout=60) as response:
        events = [json.loads(d) for d in sse_data(response)]
    assert events[-1]["type"] == "message_stop", events[-2:]
    assert [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"] == \
        [block["type"] for block in reply.json()["content"]]
