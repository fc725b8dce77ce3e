"""What a check of the server's replies against vLLM and the official SDKs left: the reasoning tokens
counted in usage (Responses' output_tokens_details, chat's completion_tokens_details); the tool_use input
of a forced call that max_tokens cut (Anthropic's messages); the keys of a whole chat or text completion."""
from __future__ import annotations

import json

import anthropic
import httpx
import jiter
import pytest
from test_abuse34_reasoning_structured import END_THINK, THINK, thinking_model
from test_server_helpers import chat_model_dir, running_server

from minillm.server.app import ServerOptions
from minillm.server.reasoning_parsers import ReasoningParser, ThinkingTagIds

TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
BIAS = {str(END_THINK): 22.0}       # </think> after a few words (without it the model never writes one)


def stream_events(url: str, path: str, body: dict) -> list[dict]:
    """The data of each server-sent event of a stream, [DONE] left out."""
    events = []
    with httpx.stream("POST", f"{url}{path}", json={"model": "stories", **body, "stream": True}, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                events.append(json.loads(line[5:]))
    return events


def post(url: str, path: str, body: dict) -> dict:
    reply = httpx.post(f"{url}{path}", json={"model": "stories", **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


# ---- reasoning tokens -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["deepseek_r1", "qwen3"])
def thinking_url(request, stories_path, tmp_path_factory):
    """A server of stories260K whose tokens 510 and 511 are <think> and </think>, under --reasoning-parser."""
    model = thinking_model(stories_path, tmp_path_factory.mktemp("thinking"))
    options = ServerOptions(chat_template=TEMPLATE, reasoning_parser=request.param)
    with running_server(model, max_model_len=256, options=options) as running:
        yield running[0]


def expected_reasoning_tokens(ids: list[int]) -> int:
    """The tokens before the first </think>, less the <think> tags among them."""
    before = ids[:ids.index(END_THINK)] if END_THINK in ids else ids
    return len(before) - before.count(THINK)


def test_count_reasoning_tokens_stops_at_the_end_tag_and_skips_the_start_tags():
    tags = ThinkingTagIds((100,), (101,))
    parser = ReasoningParser("deepseek_r1")
    assert parser.count_reasoning_tokens([5, 100, 7, 8, 101, 9, 100], tags) == 3
    assert parser.count_reasoning_tokens([5, 6, 7], tags) == 3              # cut short while thinking
    assert parser.count_reasoning_tokens([101, 5], tags) == 0
    assert parser.count_reasoning_tokens([], tags) == 0
    assert ReasoningParser("qwen3", thinking=False).count_reasoning_tokens([5, 6, 101, 7], tags) == 0
    # tags of several tokens (a tokenizer without them as added tokens), found as runs of ids
    wide = ThinkingTagIds((1, 2), (3, 4))
    assert parser.count_reasoning_tokens([1, 2, 9, 3, 9, 3, 4, 8], wide) == 3


def test_a_response_counts_its_reasoning_items_tokens(thinking_url):
    # output_tokens_details.reasoning_tokens was 0 beside a reasoning item holding every output token.
    body = {"input": "hi", "max_output_tokens": 5}
    response = post(thinking_url, "/v1/responses", body)
    assert [item["type"] for item in response["output"]] == ["reasoning"]
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == response["usage"]["output_tokens"] == 5
    last = stream_events(thinking_url, "/v1/responses", body)[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["usage"]["output_tokens_details"]["reasoning_tokens"] == 5


def mid_output_end_tag(url: str) -> tuple[dict, list[int]]:
    """(the sampling fields, the output ids) of a chat reply that closes its thinking after some words:
    the first of a few seeds whose sample does (a seeded sample is the same on every call)."""
    for seed in range(40):
        sampling = {"logit_bias": BIAS, "temperature": 1.0, "seed": seed}
        completion = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 30, "return_token_ids": True, **sampling})
        ids = completion["choices"][0]["token_ids"]
        if END_THINK in ids and 0 < ids.index(END_THINK) < len(ids) - 1:
            return sampling, ids
    pytest.fail("no seed closed the thinking mid-output")


def test_reasoning_tokens_end_at_the_end_tag(thinking_url):
    sampling, ids = mid_output_end_tag(thinking_url)
    num_reasoning = expected_reasoning_tokens(ids)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, **sampling}
    completion = post(thinking_url, "/v1/chat/completions", chat)
    assert completion["choices"][0]["message"]["content"] and completion["usage"]["completion_tokens"] == len(ids)
    assert completion["usage"]["completion_tokens_details"] == {"reasoning_tokens": num_reasoning}
    usage = stream_events(thinking_url, "/v1/chat/completions",
                          {**chat, "stream_options": {"include_usage": True}})[-1]["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": num_reasoning}
    body = {"input": "hi", "max_output_tokens": 30, **sampling}
    response = post(thinking_url, "/v1/responses", body)
    assert [item["type"] for item in response["output"]] == ["reasoning", "message"]
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == num_reasoning
    last = stream_events(thinking_url, "/v1/responses", body)[-1]
    assert last["response"]["usage"]["output_tokens_details"]["reasoning_tokens"] == num_reasoning


def test_no_reasoning_tokens_with_thinking_off(thinking_url):
    body = {"input": "hi", "max_output_tokens": 5, "chat_template_kwargs": {"enable_thinking": False}}
    response = post(thinking_url, "/v1/responses", body)
    thinking_off = response["output"][0]["type"] == "message"     # qwen3's switch; deepseek_r1 has none
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == (0 if thinking_off else 5)


# ---- Anthropic's tool_use input, cut by max_tokens -------------------------------------------------------------

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city", "days"]}


@pytest.fixture(scope="module")
def url(stories_path, tmp_path_factory):
    """A server of stories260K with a chat template, on the CPU."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    with running_server(model, max_model_len=256) as running:
        yield running[0]


def forced_call(max_tokens: int, parameters: dict = PARAMETERS) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "temperature": 0,
            "tools": [{"name": "get_weather", "input_schema": parameters}],
            "tool_choice": {"type": "tool", "name": "get_weather"}}


@pytest.mark.parametrize("max_tokens", [6, 20, 30])
def test_a_cut_tool_use_keeps_what_was_generated(url, max_tokens):
    # The cut arguments came back as "input": {} and the stream sent partial_json "{}".
    body = forced_call(max_tokens)
    events = stream_events(url, "/v1/messages", body)
    partial = "".join(e["delta"]["partial_json"] for e in events
                      if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta")
    assert partial.startswith('{"city"') and partial != "{}"
    with pytest.raises(ValueError):
        json.loads(partial)                 # cut short
    stop = [e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta"]
    assert stop == ["max_tokens"]
    message = post(url, "/v1/messages", body)
    assert message["stop_reason"] == "max_tokens"
    (block,) = message["content"]
    # the object Anthropic's SDK reads from the streamed partial JSON: the members whole, a cut value dropped
    assert block["input"] == jiter.from_json(partial.encode(), partial_mode=True)
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    sdk_body = {k: v for k, v in body.items() if k != "temperature"}
    with client.messages.stream(model="stories", **sdk_body, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.content[0].input == block["input"]
    if max_tokens >= 20:
        assert isinstance(block["input"]["city"], str)


def test_a_whole_tool_use_streams_its_input(url):
    body = forced_call(60, {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                                "additionalProperties": False})
    message = post(url, "/v1/messages", body)
    assert message["stop_reason"] == "tool_use"
    (block,) = message["content"]
    events = stream_events(url, "/v1/messages", body)
    partial = "".join(e["delta"]["partial_json"] for e in events
                      if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == block["input"] and block["input"]["city"] in ("Paris", "Rome")


# ---- the keys of whole chat and text completions ----------------------------------------------------------------

# vLLM's ChatCompletionResponse and CompletionResponse (and their choices) as its server sends them: the
# model_dump of each, every field there, null where there is nothing.
CHAT_KEYS = ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
             "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params",
             "metrics"]
CHAT_CHOICE_KEYS = ["index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids", "routed_experts"]
COMPLETION_KEYS = ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
                   "kv_transfer_params", "ec_transfer_params", "metrics"]
COMPLETION_CHOICE_KEYS = ["index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
                          "prompt_logprobs", "prompt_token_ids", "routed_experts"]


def test_a_chat_completion_has_vllms_keys(url):
    # system_fingerprint (and vLLM's null fields) were left out.
    body = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert list(body) == CHAT_KEYS and list(body["choices"][0]) == CHAT_CHOICE_KEYS
    assert [body[k] for k in CHAT_KEYS[5:7] + CHAT_KEYS[8:]] == [None] * 8
    assert body["choices"][0]["token_ids"] is None
    asked = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                               "return_token_ids": True, "prompt_logprobs": 1})
    assert list(asked) == CHAT_KEYS and len(asked["choices"][0]["token_ids"]) == 3
    assert asked["prompt_logprobs"][0] is None and len(asked["prompt_logprobs"]) == len(asked["prompt_token_ids"])


def test_a_completion_has_vllms_keys(url):
    body = post(url, "/v1/completions", {"prompt": ["Once", "Lily"], "max_tokens": 3})
    assert list(body) == COMPLETION_KEYS
    assert all(list(choice) == COMPLETION_CHOICE_KEYS for choice in body["choices"])
    assert [body[k] for k in ("service_tier", "system_fingerprint", "kv_transfer_params")] == [None] * 3
    assert all(choice[k] is None for choice in body["choices"] for k in COMPLETION_CHOICE_KEYS[5:])
    assert body["ec_transfer_params"] is None and body["metrics"] is None
    asked = post(url, "/v1/completions", {"prompt": "Once", "max_tokens": 3, "return_token_ids": True})
    (choice,) = asked["choices"]
    assert list(choice) == COMPLETION_CHOICE_KEYS and len(choice["token_ids"]) == 3 and choice["prompt_token_ids"]
