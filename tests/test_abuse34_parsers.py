"""--reasoning-parser and --tool-call-parser through the server, on replies that carry tags: stories260K
writes none, so a core hook holds the engine's output to a scripted text (a one-string choice, or a
grammar that emits a special token) while the server sees a free-text request and parses it."""
from __future__ import annotations

import json

import httpx
import pytest
from test_server_helpers import call_utility, running_server

from minillm.server.app import ServerOptions
from minillm.structured_output import StructuredOutputsParams

TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
TOOL_CALL_ID, TOOL_CALL_END_ID = 510, 511     # the tokens that become special <tool_call> and </tool_call>


def install_script(engine) -> None:
    """A core hook: engine.script(kind, value) holds every later request's output to
    StructuredOutputsParams(kind=value) (None: the output as the model writes it)."""
    real_queue = engine._queue_request
    state = {"constraint": None}

    def queue(request_id, prompt, params, *args, **kwargs):
        if state["constraint"] is not None:
            params.structured_outputs = StructuredOutputsParams(**state["constraint"])
        return real_queue(request_id, prompt, params, *args, **kwargs)

    def script(kind, value):
        state["constraint"] = None if kind is None else {kind: value}

    engine._queue_request, engine.script = queue, script


def model_with_added_tokens(src, dst, tags: dict[int, str], special: bool):
    """A copy of the model folder src in dst whose tokens tags' ids are the added tokens of tags' texts
    (special or not), in place of the pieces they held."""
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file():
            (dst / item.name).write_bytes(item.read_bytes())
    tokenizer = json.loads((dst / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    by_id = {i: piece for piece, i in vocab.items()}
    for token_id, tag in tags.items():
        del vocab[by_id[token_id]]
        vocab[tag] = token_id
        tokenizer["added_tokens"].append({"id": token_id, "content": tag, "single_word": False, "lstrip": False,
                                          "rstrip": False, "normalized": False, "special": special})
    (dst / "tokenizer.json").write_text(json.dumps(tokenizer))
    return dst


def special_tool_call_model(src, dst):
    """A copy of src whose tokens TOOL_CALL_ID and TOOL_CALL_END_ID are the special tokens <tool_call>
    and </tool_call> (as in models whose template wraps calls in special tokens)."""
    return model_with_added_tokens(src, dst, {TOOL_CALL_ID: "<tool_call>", TOOL_CALL_END_ID: "</tool_call>"}, True)


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    """(url, engine): the special-token model with --tool-call-parser hermes --reasoning-parser deepseek_r1."""
    model = special_tool_call_model(stories_path, tmp_path_factory.mktemp("special_tool_call"))
    options = ServerOptions(chat_template=TEMPLATE, tool_call_parser="hermes", reasoning_parser="deepseek_r1")
    with running_server(model, max_model_len=512, options=options, core_hook=install_script) as running:
        yield running


def chat(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "stories", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "temperature": 0,
        **body})


def streamed(url: str, **body) -> dict:
    """A stream's deltas of choice 0 joined: content, reasoning, tool calls by index, finish reason."""
    joined = {"content": "", "reasoning": "", "calls": {}, "finish_reason": None}
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
            "model": "stories", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400,
            "temperature": 0, "stream": True, **body}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[len("data: "):])["choices"]:
                delta = choice["delta"]
                joined["content"] += delta.get("content") or ""
                joined["reasoning"] += delta.get("reasoning") or ""
                for call in delta.get("tool_calls", []):
                    entry = joined["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                    entry["name"] += call["function"].get("name") or ""
                    entry["arguments"] += call["function"].get("arguments") or ""
                joined["finish_reason"] = choice["finish_reason"] or joined["finish_reason"]
    return joined


def grammar_of(reply: str) -> str:
    """A grammar whose one output is reply, with its <tool_call> and </tool_call> as the special tokens."""
    parts, text = [], reply.replace("</tool_call>", "\0end\0").replace("<tool_call>", "\0start\0")
    for i, piece in enumerate(text.split("\0")):
        if i % 2:
            parts.append(f"<[{TOOL_CALL_ID if piece == 'start' else TOOL_CALL_END_ID}]>")
        elif piece:
            parts.append(json.dumps(piece, ensure_ascii=False))
    return "start: " + " ".join(parts)


CALL_JSON = '{"name": "f", "arguments": {"a": 1}}'
SPECIAL_CALL = grammar_of(f"plan</think><tool_call>{CALL_JSON}</tool_call>")


def test_a_tool_call_wrapped_in_special_tokens_is_a_call(server):
    # Its tags were skipped as special tokens (skip_special_tokens defaults to true), so hermes found
    # no <tool_call> and the call's JSON came back as content; vLLM's hermes parser keeps them.
    url, engine = server
    call_utility(engine, "script", "grammar", SPECIAL_CALL)
    body = chat(url, tools=TOOLS).json()
    [choice] = body["choices"]
    assert choice["message"]["content"] is None and choice["message"]["reasoning"] == "plan"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == \
        [("f", '{"a": 1}')]
    assert choice["finish_reason"] == "tool_calls"
    joined = streamed(url, tools=TOOLS)
    assert joined == {"content": "", "reasoning": "plan", "calls": {0: {"name": "f", "arguments": '{"a": 1}'}},
                      "finish_reason": "tool_calls"}


@pytest.mark.parametrize("body", [{}, {"tools": TOOLS, "tool_choice": "none"}], ids=["no tools", "tool_choice none"])
def test_without_tools_to_call_special_tokens_are_skipped_as_asked(server, body):
    url, engine = server
    call_utility(engine, "script", "grammar", SPECIAL_CALL)
    message = chat(url, **body).json()["choices"][0]["message"]
    assert message["content"] == CALL_JSON and "tool_calls" not in message
    kept = chat(url, skip_special_tokens=False, **body).json()["choices"][0]["message"]
    assert kept["content"] == f"<tool_call>{CALL_JSON}</tool_call>" and "tool_calls" not in kept


REPLIES = [
    '<think>I may call <tool_call>{"name": "g", "arguments": {}}</tool_call></think>Sure.'
    '<tool_call>{"name": "f", "arguments": {"q": "\\"é\\"", "n": {"x": [1, {"y": null}]}}}</tool_call>\n'
    '<tool_call>{"name": "f", "arguments": {}}</tool_call> after',
    'plan</think>first <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
    'plan</think>pre <tool_call>{"name": "f", "arguments": {bad}}</tool_call>',
    "<think>cut short <tool_call>",
]


@pytest.mark.parametrize("reply", REPLIES, ids=["calls", "one call", "malformed call", "unclosed think"])
def test_a_streamed_reply_joins_to_the_whole_one(server, reply):
    url, engine = server
    call_utility(engine, "script", "grammar", grammar_of(reply))
    [choice] = chat(url, tools=TOOLS).json()["choices"]
    joined = streamed(url, tools=TOOLS)
    message = choice["message"]
    assert joined["content"] == (message["content"] or "")
    assert joined["reasoning"] == (message["reasoning"] or "")
    assert [joined["calls"][i] for i in sorted(joined["calls"])] == \
        [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message.get("tool_calls", [])]
    assert list(joined["calls"]) == list(range(len(joined["calls"])))
    assert joined["finish_reason"] == choice["finish_reason"] == ("tool_calls" if message.get("tool_calls") else "stop")
