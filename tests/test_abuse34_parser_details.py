"""Reasoning and tool-call parsers against vLLM's details: empty reasoning is "" (not null), text before
<think> is reasoning as vLLM streams it, llama3_json reads calls only where the output opens with one;
a stream cut anywhere joins to the whole reply's parts."""
from __future__ import annotations

import json

import httpx
import pytest
from test_abuse34_parsers import TEMPLATE, grammar_of, install_script
from test_server_helpers import call_utility, running_server

from minillm.server.app import ServerOptions
from minillm.server.output_parsers import OutputParsers
from minillm.server.reasoning_parsers import ReasoningParser
from minillm.server.tool_parsers import ToolParser


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text, reasoning, content", [
    ("</think>only an answer", "", "only an answer"),
    ("<think></think>x", "", "x"),
    ("", "", None),                            # vLLM: reasoning "" (the whole output, cut short), content null
    ("</think>", "", None),
    ("<think>", "", None),
    ("Hi <think>a</think>b", "Hi a", "b"),     # vLLM's stream: "Hi " is reasoning, the <think> token skipped
    ("Hi <think>a", "Hi a", None),
    ("\n<think>\nx\n</think>\n\nY", "\n\nx\n", "\n\nY"),
    ("<think>a<think>b</think>c", "ab", "c"),
    ("a</think>b<think>c</think>d", "a", "b<think>c</think>d"),
])
def test_reasoning_as_vllm_gives_it(name, text, reasoning, content):
    assert ReasoningParser(name).split(text) == (reasoning, content)


@pytest.mark.parametrize("text", ["", "x", "a</think>b"])
def test_qwen3_without_thinking_has_no_reasoning_not_even_empty(text):
    parser = ReasoningParser.for_request("qwen3", {"enable_thinking": False})
    assert parser.split(text) == (None, text)
    message, _ = OutputParsers(parser, None).message("assistant", "", text, "stop")
    assert message == {"role": "assistant", "content": text, "reasoning": None, "reasoning_content": None}


def test_a_whole_reply_carries_empty_reasoning_as_an_empty_string():
    parsers = OutputParsers(ReasoningParser("deepseek_r1"), ToolParser("hermes"))
    message, _ = parsers.message("assistant", "", "</think>answer", "stop")
    assert message == {"role": "assistant", "content": "answer", "reasoning": "", "reasoning_content": ""}
    message, finish = parsers.message("assistant", "", '</think><tool_call>{"name": "f", "arguments": {}}</tool_call>',
                                      "stop")
    assert message["reasoning"] == message["reasoning_content"] == "" and message["content"] is None
    assert finish == "tool_calls"


def deltas(parsers: OutputParsers, text: str, cuts: list[int]) -> list[dict]:
    """The chat deltas of text streamed in pieces cut at `cuts`."""
    stream, bounds = parsers.stream(), [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    return [stream.delta(piece, "stop" if i == len(pieces) - 1 else None)[0] for i, piece in enumerate(pieces)]


STREAMED = ["Hi <think>a</think>b", "Hi <think>a", "<think>a<thin", "x<think", "</think>ok", "<think></think>",
            "<<think>>a<</think>>", "<think>a<think>b</think>c<think>", "no tags <th",
            'pre <think>plan</think><tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>']


@pytest.mark.parametrize("tools", [None, "hermes"])
@pytest.mark.parametrize("text", STREAMED)
def test_a_stream_cut_anywhere_joins_to_the_whole_reply(text, tools):
    parsers = OutputParsers(ReasoningParser("deepseek_r1"), ToolParser(tools) if tools else None)
    message, _ = parsers.message("assistant", "", text, "stop")
    for cuts in ([], *([i] for i in range(1, len(text))), list(range(1, len(text)))):
        sent = deltas(parsers, text, cuts)
        assert all(d.get("reasoning") != "" and d.get("content") != "" for d in sent)    # no empty deltas
        assert "".join(d.get("reasoning", "") for d in sent) == message["reasoning"], cuts
        assert "".join(d.get("content", "") for d in sent) == (message["content"] or ""), cuts
        calls = [c["function"]["arguments"] for d in sent for c in d.get("tool_calls", [])]
        assert calls == [c["function"]["arguments"] for c in message.get("tool_calls", [])]


LLAMA_TEXTS = [
    'Sure: {"name": "f", "parameters": {"a": 1}}',        # vLLM's whole-reply path would take this call
    'Here. <|python_tag|>{"name": "f", "parameters": {}}',
    '{"name": "f", "parameters": {"a": 1}}',
    ' \n<|python_tag|> {"name": "f", "arguments": {}}; {"name": "g", "parameters": {"b": 2}}',
]


@pytest.mark.parametrize("text", LLAMA_TEXTS)
def test_llama3_json_takes_calls_only_where_the_output_opens_with_one(text):
    parsers = OutputParsers(None, ToolParser("llama3_json"))
    message, _ = parsers.message("assistant", "", text, "stop")
    opens_with_call = text.lstrip().removeprefix("<|python_tag|>").lstrip().startswith("{")
    assert bool(message.get("tool_calls")) == opens_with_call
    assert message["content"] == (None if opens_with_call else text)
    for cuts in ([], *([i] for i in range(1, len(text)))):
        sent = deltas(parsers, text, cuts)
        assert "".join(d.get("content", "") for d in sent) == (message["content"] or "")
        assert [c["function"] for d in sent for c in d.get("tool_calls", [])] == \
            [c["function"] for c in message.get("tool_calls", [])]


@pytest.fixture(scope="module")
def server(stories_path):
    """(url, engine): stories260K scripted to a reply, with --tool-call-parser hermes --reasoning-parser deepseek_r1."""
    options = ServerOptions(chat_template=TEMPLATE, tool_call_parser="hermes", reasoning_parser="deepseek_r1")
    with running_server(stories_path, max_model_len=512, options=options, core_hook=install_script) as running:
        yield running


def post(url: str, stream: bool, **body) -> list[dict]:
    """Choice 0's message (one item), or its stream's deltas."""
    body = {"model": "stories", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400,
            "temperature": 0, "stream": stream, **body}
    if not stream:
        response = httpx.post(f"{url}/v1/chat/completions", timeout=60, json=body)
        assert response.status_code == 200, response.text
        return [response.json()["choices"][0]["message"]]
    out = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                out += [choice["delta"] for choice in json.loads(line[len("data: "):])["choices"]]
    return out


@pytest.mark.parametrize("reply, reasoning, content", [
    ("</think>answer", "", "answer"),
    ("Hi <think>plan</think>answer", "Hi plan", "answer"),
])
def test_the_server_returns_reasoning_as_vllm_does(server, reply, reasoning, content):
    url, engine = server
    call_utility(engine, "script", "grammar", grammar_of(reply))
    [message] = post(url, False)
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == (reasoning, reasoning, content)
    sent = post(url, True)
    assert all(d.get("reasoning", None) != "" for d in sent)
    assert "".join(d.get("reasoning") or "" for d in sent) == reasoning
    assert "".join(d.get("content") or "" for d in sent) == content
