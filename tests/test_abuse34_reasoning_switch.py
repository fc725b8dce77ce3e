"""A reasoning model's constrained output, both ways vLLM serves it: by default the thinking is free and the
grammar (response_format, structured_outputs, a forced tool call) holds what follows </think>; with
--structured-outputs-config '{"enable_in_reasoning": true}' the grammar holds the output from its first
token. The model is test_abuse34_reasoning_structured's copy of stories260K whose tokens 510 and 511 are
<think> and </think>, with a logit bias that makes it close its thinking after a few words."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from test_abuse34_reasoning_structured import END_THINK, SCHEMA, TEMPLATE, thinking_model
from test_cli import STORIES, needs_stories, run_main
from test_server_helpers import running_server

from minillm.server.app import ServerOptions

TOOL = {"type": "function", "function": {"name": "ab", "description": "Set a and b.", "parameters": SCHEMA}}
NAMED = {"type": "function", "function": {"name": "ab"}}
IN_REASONING = {"enable_in_reasoning": True}
SEEDS = range(6)


@pytest.fixture(scope="module")
def model(stories_path, tmp_path_factory):
    return thinking_model(stories_path, tmp_path_factory.mktemp("thinking"))


def serve(model, config=None, parser="deepseek_r1"):
    options = ServerOptions(chat_template=TEMPLATE, reasoning_parser=parser, structured_outputs_config=config)
    return running_server(model, max_model_len=512, options=options)


@pytest.fixture(scope="module")
def after_thinking(model):
    """A server whose grammars hold what follows </think> (vLLM's default)."""
    with serve(model) as running:
        yield running[0]


@pytest.fixture(scope="module")
def from_first_token(model):
    """A server whose grammars hold the whole output (enable_in_reasoning)."""
    with serve(model, IN_REASONING) as running:
        yield running[0]


def chat(seed, **body):
    return {"model": "stories", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
            "temperature": 1.0, "seed": seed, "logit_bias": {str(END_THINK): 19}, **body}


JSON_FORMAT = {"response_format": {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA}}}


def post(url, path, body):
    response = httpx.post(f"{url}{path}", timeout=120, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stream_lines(url, path, body):
    with httpx.stream("POST", f"{url}{path}", timeout=120, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        return [line for line in response.iter_lines() if line.startswith("data: {")]


def the_calls_arguments(calls, required):
    """The arguments of a reply's calls (one call to ab, or under "required" one or more), each checked
    against the schema."""
    assert calls and all(call["function"]["name"] == "ab" for call in calls), calls
    assert len(calls) == 1 or required, calls
    arguments = [json.loads(call["function"]["arguments"]) for call in calls]
    for each in arguments:
        jsonschema.validate(each, SCHEMA)
    return arguments


# ---- --structured-outputs-config enable_in_reasoning ------------------------------------------------------

def test_enable_in_reasoning_holds_the_json_from_the_first_token(after_thinking, from_first_token):
    thought = 0
    for seed in SEEDS:
        held = post(from_first_token, "/v1/chat/completions", chat(seed, **JSON_FORMAT))["choices"][0]
        # The grammar held the first token (the bias on </think> could not open a thought): the JSON is the reply.
        jsonschema.validate(json.loads(held["message"]["content"]), SCHEMA)
        assert held["message"]["content"].lstrip().startswith("{") and "reasoning_content" not in held["message"]
        assert held["finish_reason"] == "stop"
        free = post(after_thinking, "/v1/chat/completions", chat(seed, **JSON_FORMAT))["choices"][0]["message"]
        jsonschema.validate(json.loads(free["content"]), SCHEMA)
        thought += bool(free["reasoning_content"])
    assert thought >= 3


def test_enable_in_reasoning_needs_no_thinking_tokens(stories_path):
    # Held from the first token, the grammar watches for no </think>: a tokenizer without one is served.
    with serve(stories_path, IN_REASONING) as (url, _):
        body = {"model": "stories", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60,
                "temperature": 0, **JSON_FORMAT}
        message = post(url, "/v1/chat/completions", body)["choices"][0]["message"]
        jsonschema.validate(json.loads(message["content"]), SCHEMA)
    with serve(stories_path) as (url, _):
        refused = httpx.post(f"{url}/v1/chat/completions", timeout=60, json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"


@needs_stories
@pytest.mark.parametrize("flags, config, parser", [
    (["--structured-outputs-config", '{"enable_in_reasoning": true}'], IN_REASONING, None),
    (["--structured-outputs-config.enable_in_reasoning", "true", "--structured-outputs-config.backend=guidance",
      "--reasoning-parser", "qwen3"], {"enable_in_reasoning": True, "backend": "guidance"}, "qwen3"),
    (["--structured-outputs-config.reasoning_parser", "deepseek_r1",
      "--structured-outputs-config.disable_fallback", "true"],
     {"reasoning_parser": "deepseek_r1", "disable_fallback": True}, "deepseek_r1"),
    (["--structured-outputs-config", '{"enable_in_reasoning": false, "backend": "auto"}'],
     {"enable_in_reasoning": False, "backend": "auto"}, None),
], ids=["json", "dotted", "parser", "off"])
def test_serve_takes_the_structured_outputs_config(capsys, monkeypatch, flags, config, parser):
    seen = {}
    monkeypatch.setattr("minillm.server.app.run_server", lambda cfg, options=None, **kw: seen.update(o=options) or 0)
    status, _, err = run_main(capsys, "serve", str(STORIES), "--device", "cpu", *flags)
    assert (status, err) == (0, "")
    options = seen["o"]
    assert options.structured_outputs_config == config and options.reasoning_parser == parser
    assert options.structured_outputs_in_reasoning is config.get("enable_in_reasoning", False)


@needs_stories
@pytest.mark.parametrize("flags, words", [
    (['{"backend": "xgrammar"}'], "backend 'xgrammar' is not supported: minillm's grammars are always llguidance"),
    (['{"backend": "fast"}'], "backend must be one of auto, xgrammar"),
    (['{"reasoning_parser_plugin": "p.py"}'], "reasoning_parser_plugin 'p.py' is not supported"),
    (['{"disable_any_whitespace": false}'], "disable_any_whitespace false is not supported"),
    (['{"enable_in_reasoning": "yes"}'], "enable_in_reasoning must be a boolean"),
    (['{"enable_reasoning": true}'], "enable_reasoning is not a key of vLLM's structured outputs config"),
    (['{"reasoning_parser": "qwen3"}', "--reasoning-parser", "deepseek_r1"], "disagrees with the reasoning parser"),
    (["[true]"], "must be a JSON object"),
])
def test_serve_refuses_what_it_cannot_serve_of_the_config_by_name(capsys, flags, words):
    status, _, err = run_main(capsys, "serve", str(STORIES), "--device", "cpu", "--structured-outputs-config", *flags)
    assert status == 2 and "'--structured-outputs-config'" in err and words in err, err


# ---- forced tool calls after the reasoning ---------------------------------------------------------------

def joined_chat_stream(lines):
    """(reasoning, [calls]) of a streamed chat reply: each call's deltas joined."""
    reasoning, calls, finish = "", {}, None
    for line in lines:
        for choice in json.loads(line[len("data: "):])["choices"]:
            delta = choice["delta"]
            assert not delta.get("content"), delta
            reasoning += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                whole = calls.setdefault(call["index"], {"function": {"name": "", "arguments": ""}})
                whole["function"]["name"] += call.get("function", {}).get("name") or ""
                whole["function"]["arguments"] += call.get("function", {}).get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return reasoning, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_a_forced_call_follows_the_reasoning_whole_and_streamed(after_thinking, choice):
    # The grammar held the first token (no reasoning, the call at once) and no reasoning was split off.
    thought = 0
    for seed in SEEDS:
        body = chat(seed, tools=[TOOL], tool_choice=choice, parallel_tool_calls=False)    # one call fits max_tokens
        reply = post(after_thinking, "/v1/chat/completions", body)["choices"][0]
        message = reply["message"]
        arguments = the_calls_arguments(message["tool_calls"], choice == "required")
        assert reply["finish_reason"] == ("tool_calls" if choice == "required" else "stop")
        assert "</think>" not in message["reasoning_content"] and not message["content"]
        thought += len(message["reasoning_content"]) > 3
        reasoning, calls, finish = joined_chat_stream(stream_lines(after_thinking, "/v1/chat/completions", body))
        assert (reasoning, finish) == (message["reasoning_content"], reply["finish_reason"])
        assert the_calls_arguments(calls, choice == "required") == arguments
    assert thought >= 3


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_enable_in_reasoning_holds_a_forced_call_from_the_first_token(from_first_token, choice):
    for seed in SEEDS:
        message = post(from_first_token, "/v1/chat/completions",
                       chat(seed, tools=[TOOL], tool_choice=choice))["choices"][0]["message"]
        the_calls_arguments(message["tool_calls"], choice == "required")
        assert "reasoning_content" not in message


def test_a_forced_call_cut_short_in_its_reasoning_has_no_call(after_thinking):
    body = chat(0, tools=[TOOL], tool_choice=NAMED, max_tokens=3, logit_bias={str(END_THINK): -100})
    reply = post(after_thinking, "/v1/chat/completions", body)["choices"][0]
    # no call: vLLM leaves an empty tool_calls out of the message (vllm-project/vllm#44105)
    assert reply["finish_reason"] == "length" and "tool_calls" not in reply["message"]
    assert reply["message"]["reasoning_content"]
    reasoning, calls, finish = joined_chat_stream(stream_lines(after_thinking, "/v1/chat/completions", body))
    assert (reasoning, calls, finish) == (reply["message"]["reasoning_content"], [], "length")


def test_a_forced_call_needs_the_thinking_tags_as_tokens(stories_path):
    with serve(stories_path) as (url, _):
        response = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "stories", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "tools": [TOOL], "tool_choice": "required"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tool_choice" and "</think>" in response.json()["error"]["message"]


def test_qwen3_without_thinking_holds_the_forced_call_from_the_first_token(model):
    with serve(model, parser="qwen3") as (url, _):
        message = post(url, "/v1/chat/completions", chat(
            1, tools=[TOOL], tool_choice=NAMED, chat_template_kwargs={"enable_thinking": False}))["choices"][0]["message"]
    the_calls_arguments(message["tool_calls"], False)
    assert "reasoning_content" not in message and not message["content"]


# ---- /v1/responses and /v1/messages ----------------------------------------------------------------------

RESPONSES_TOOL = {"type": "function", "name": "ab", "description": "Set a and b.", "parameters": SCHEMA}


def responses_body(seed, choice):
    return {"model": "stories", "input": "hi", "max_output_tokens": 200, "temperature": 1.0, "seed": seed,
            "logit_bias": {str(END_THINK): 19}, "tools": [RESPONSES_TOOL], "tool_choice": choice,
            "parallel_tool_calls": False}


def without_ids(items):
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


@pytest.mark.parametrize("choice", [{"type": "function", "name": "ab"}, "required"], ids=["named", "required"])
def test_responses_give_the_reasoning_item_then_the_call(after_thinking, choice):
    thought = 0
    for seed in SEEDS[:4]:
        body = responses_body(seed, choice)
        output = post(after_thinking, "/v1/responses", body)["output"]
        kinds = [item["type"] for item in output]
        calls = kinds[1:] if kinds[0] == "reasoning" else kinds
        assert calls and set(calls) == {"function_call"} and (len(calls) == 1 or choice == "required"), output
        thought += kinds[0] == "reasoning"
        for item in output[len(kinds) - len(calls):]:
            jsonschema.validate(json.loads(item["arguments"]), SCHEMA)
        events = [json.loads(line[len("data: "):]) for line in stream_lines(after_thinking, "/v1/responses", body)]
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert events[-1]["type"] == "response.completed"
        assert without_ids(done) == without_ids(events[-1]["response"]["output"]) == without_ids(output)
    assert thought >= 2


def messages_body(max_tokens):
    return {"model": "stories", "max_tokens": max_tokens, "temperature": 0, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "ab", "description": "Set a and b.", "input_schema": SCHEMA}],
            "tool_choice": {"type": "tool", "name": "ab"}}


def streamed_blocks(url, body):
    """(types of the blocks started, indices of those stopped, stop_reason) of a streamed message."""
    events = [json.loads(line[len("data: "):]) for line in stream_lines(url, "/v1/messages", body)]
    started = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    stopped = [e["index"] for e in events if e["type"] == "content_block_stop"]
    [delta] = [e["delta"] for e in events if e["type"] == "message_delta"]
    return started, stopped, delta["stop_reason"]


def test_messages_think_before_the_forced_tool_use(after_thinking, from_first_token):
    # Messages take no logit_bias, so the model never closes its thinking: cut short there, there is no call.
    body = messages_body(12)
    reply = post(after_thinking, "/v1/messages", body)
    assert [block["type"] for block in reply["content"]] == ["thinking"] and reply["stop_reason"] == "max_tokens"
    assert streamed_blocks(after_thinking, body) == (["thinking"], [0], "max_tokens")
    body = messages_body(200)
    reply = post(from_first_token, "/v1/messages", body)
    assert [block["type"] for block in reply["content"]] == ["tool_use"] and reply["stop_reason"] == "tool_use"
    jsonschema.validate(reply["content"][0]["input"], SCHEMA)
    assert streamed_blocks(from_first_token, body) == (["tool_use"], [0], "tool_use")
