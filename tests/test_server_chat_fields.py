"""vLLM's chat rendering fields (add_generation_prompt, continue_final_message, echo, add_special_tokens),
the fields this server refuses rather than ignores, and bodies that are not JSON.

A real server on loopback whose chat template is given by --chat-template; each test runs with a
healthy greedy stream in flight, and every such stream must end with the text of the same request
made alone.
"""
from __future__ import annotations

import json

import httpx
import pytest
from test_server_helpers import (CHAT_TEMPLATE, chat_template_server, openai_error, sse_events,  # noqa: F401
                                 story_streams)

MODEL = "stories"
MESSAGES = [{"role": "user", "content": "Tell me a story."}]
CONTINUED = MESSAGES + [{"role": "assistant", "content": "Once upon a"}]


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0, **fields}


# Fields vLLM accepts that would change what comes back, and that this server does not implement:
# each is a 400 naming the field, not ignored. A value that asks for nothing passes (below).
REFUSED = [
    ("tool-choice-required", "/v1/chat/completions", _chat(tool_choice="required"), "tool_choice"),
    ("tool-choice-named", "/v1/chat/completions",
     _chat(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
    # "required" with no tool to call: OpenAI refuses the empty tools array (it was taken as "none")
    ("tool-choice-required-empty-tools", "/v1/chat/completions", _chat(tools=[], tool_choice="required"),
     "tool_choice"),
    ("priority", "/v1/chat/completions", _chat(priority=3), "priority"),
    ("stream-options-without-stream", "/v1/chat/completions", _chat(stream_options={"include_usage": True}),
     "stream_options"),
    ("stream-options-stream-false", "/v1/completions",
     {"prompt": "Once", "stream": False, "stream_options": {"include_usage": False}}, "stream_options"),
    ("prompt-embeds", "/v1/completions", {"prompt": "Once", "prompt_embeds": "AAAA"}, "prompt_embeds"),
    # Rendering fields with values that cannot work.
    ("continue-and-generation-prompt", "/v1/chat/completions", _chat(messages=CONTINUED, continue_final_message=True),
     "continue_final_message"),
    ("continue-through-template-kwargs", "/v1/chat/completions",
     _chat(chat_template_kwargs={"continue_final_message": True}), "chat_template_kwargs"),
    ("add-generation-prompt-string", "/v1/chat/completions", _chat(add_generation_prompt="nope"),
     "add_generation_prompt"),
    ("echo-string", "/v1/chat/completions", _chat(echo="sure"), "echo"),
    ("add-special-tokens-int", "/v1/completions", {"prompt": "Once", "add_special_tokens": 2}, "add_special_tokens"),
    ("parallel-tool-calls-string", "/v1/chat/completions", _chat(parallel_tool_calls="x"), "parallel_tool_calls"),
    # Content parts: the part and the key that is wrong.
    ("image-part", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "image_url", "image_url": {"url": "http://x"}}]}]),
     "messages.0.content.1.type"),
    ("text-part-without-text", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages.0.content.0.text"),
]


@pytest.mark.parametrize("path,body,param", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_fields_not_implemented_or_malformed_are_400s_naming_the_field(http, healthy_stream, path, body, param):
    openai_error(http.post(path, json=body), 400, param)


@pytest.mark.parametrize("fields", [{"tool_choice": "none"}, {"tools": []},
                                    {"parallel_tool_calls": False}, {"priority": 0}, {"return_token_ids": False},
                                    {"stream_options": {"continuous_usage_stats": False}, "stream": True},
                                    {"stream_options": {}}, {"stream_options": None, "stream": False}],
                         ids=["tool-choice-none", "no-tools", "parallel-tool-calls",
                              "priority-0", "return-token-ids-false", "continuous-usage-false",
                              "empty-stream-options-no-stream", "null-stream-options-no-stream"])
def test_values_that_ask_for_nothing_pass(http, healthy_stream, fields):
    assert http.post("/v1/chat/completions", json=_chat(**fields)).status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_says_which_content_type_to_use(http, healthy_stream, content_type):
    body = json.dumps({"prompt": "Once", "max_tokens": 2}).encode()
    error = openai_error(http.post("/v1/completions", content=body, headers={"Content-Type": content_type}), 400, None)
    assert "Content-Type: application/json" in error["message"]


def test_an_empty_body_says_so(http, healthy_stream):
    error = openai_error(http.post("/v1/completions", content=b"", headers={"Content-Type": "application/json"}), 400, None)
    assert "empty" in error["message"]


def _completion_text(http, prompt_ids: list[int], max_tokens: int = 6) -> str:
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt_ids, "max_tokens": max_tokens,
                                                  "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_add_generation_prompt_false_leaves_the_assistant_turn_unopened(http, tok, healthy_stream):
    text = tok.render_chat(MESSAGES, CHAT_TEMPLATE, add_generation_prompt=False)
    assert not text.endswith("assistant:")
    ids = tok.encode(text, add_special_tokens=False)
    response = http.post("/v1/chat/completions", json=_chat(add_generation_prompt=False))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["message"]["content"] == _completion_text(http, ids)


def test_continue_final_message_continues_it_and_echo_repeats_it(http, tok, healthy_stream):
    text = tok.render_chat(CONTINUED, CHAT_TEMPLATE, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("assistant: Once upon a")
    continuation = _completion_text(http, tok.encode(text, add_special_tokens=False))
    fields = {"messages": CONTINUED, "add_generation_prompt": False, "continue_final_message": True}
    plain = http.post("/v1/chat/completions", json=_chat(**fields)).json()
    assert plain["choices"][0]["message"]["content"] == continuation
    echoed = http.post("/v1/chat/completions", json=_chat(echo=True, **fields)).json()
    assert echoed["choices"][0]["message"]["content"] == "Once upon a" + continuation
    assert echoed["usage"] == plain["usage"]     # the echoed text is no completion token
    with http.stream("POST", "/v1/chat/completions", json=_chat(echo=True, stream=True, n=2, **fields)) as response:
        events = sse_events(response.iter_lines())
    streamed: dict[int, str] = {}
    for event in events:
        for choice in event["choices"]:
            streamed[choice["index"]] = streamed.get(choice["index"], "") + (choice["delta"].get("content") or "")
    assert streamed == {0: "Once upon a" + continuation, 1: "Once upon a" + continuation}


def test_echo_repeats_nothing_when_the_last_message_is_not_the_assistants(http, healthy_stream):
    plain = http.post("/v1/chat/completions", json=_chat()).json()
    echoed = http.post("/v1/chat/completions", json=_chat(echo=True)).json()
    assert echoed["choices"][0]["message"] == plain["choices"][0]["message"]


def test_add_special_tokens_adds_bos_as_vllm_does(http, tok, healthy_stream):
    def completion(**fields) -> dict:
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1,
                                                      "temperature": 0, "echo": True, "logprobs": 0, **fields})
        assert response.status_code == 200, response.text
        return response.json()

    with_bos, without = completion(), completion(add_special_tokens=False)
    assert with_bos["choices"][0]["logprobs"]["tokens"][0] == "<s>"
    assert without["choices"][0]["logprobs"]["tokens"][0] != "<s>"
    assert with_bos["usage"]["prompt_tokens"] == without["usage"]["prompt_tokens"] + 1
    # Chat: the template writes BOS itself; add_special_tokens adds one more, as vLLM's does.
    chat = [http.post("/v1/chat/completions", json=_chat(max_tokens=1, **f)).json()["usage"]["prompt_tokens"]
            for f in ({}, {"add_special_tokens": True})]
    assert chat[1] == chat[0] + 1
    # Text that tokenizes to nothing without its BOS is an empty prompt.
    openai_error(http.post("/v1/completions", json={"prompt": "", "add_special_tokens": False}), 400, "prompt")


NULLABLE = ("n", "stream", "logprobs", "echo", "ignore_eos", "min_tokens", "skip_special_tokens",
            "include_stop_str_in_output", "add_generation_prompt", "continue_final_message", "add_special_tokens",
            "top_logprobs", "stop", "seed", "top_p", "user", "tool_choice", "parallel_tool_calls")


def test_null_optional_fields_mean_their_defaults_as_in_openais_api(http, healthy_stream):
    want = http.post("/v1/chat/completions", json=_chat()).json()
    nulls = {name: None for name in NULLABLE}
    got = http.post("/v1/chat/completions", json=_chat(**nulls, messages=[{**MESSAGES[0], "name": None}]))
    assert got.status_code == 200, got.text
    assert got.json()["choices"] == want["choices"]
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    want = http.post("/v1/completions", json=body).json()
    nulls = {name: None for name in ("n", "stream", "echo", "ignore_eos", "min_tokens", "logprobs", "best_of",
                                     "suffix", "add_special_tokens")}
    streamed = {**body, **nulls, "stream": True, "stream_options": {"include_usage": None}}
    got = http.post("/v1/completions", json=streamed)
    assert got.status_code == 200, got.text
    events = sse_events(got.text.splitlines())
    assert "".join(c["text"] for e in events for c in e["choices"]) == want["choices"][0]["text"]
    assert all("usage" not in e for e in events)        # include_usage null: no usage chunk
    # max_tokens null is the default 16 on completions (vLLM's normalize_null_max_tokens); on chat, a
    # field whose own value may be null keeps it: max_tokens null runs to the end of the context.
    sixteen = http.post("/v1/completions", json={**body, "max_tokens": None, "ignore_eos": True}).json()
    assert sixteen["usage"]["completion_tokens"] == 16
    rest = http.post("/v1/chat/completions", json=_chat(max_tokens=None, ignore_eos=True)).json()
    assert rest["usage"]["total_tokens"] == server_max_model_len(http)
    # A required field is still required.
    openai_error(http.post("/v1/completions", json={**body, "prompt": None}), 400, "prompt")
    openai_error(http.post("/v1/chat/completions", json=_chat(messages=None)), 400, "messages")


def server_max_model_len(http) -> int:
    return http.get("/v1/models").json()["data"][0]["max_model_len"]
