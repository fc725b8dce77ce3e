"""Server, property-based: request bodies of every generating and tokenizing route with fields of any
JSON type (null, booleans, 2**63, NaN and Infinity as JSON tokens, lone surrogates, empty and nested
values), and bodies that are no JSON object, each answered 200 or with a 4xx error that names the field
at fault, never a 5xx and never a hang, while a greedy stream beside them keeps its solo text."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from test_server_helpers import (  # noqa: F401 (story_streams: the healthy fixture)
    CHAT_TEMPLATE, running_server, story_streams,
)

from minillm.server.app import ServerOptions

MODEL = "stories"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}}}}}, {"type": "function", "function": {"name": "g"}}]
MESSAGES = [{"role": "user", "content": "Tom had a red ball"}]
# Each route: a body it serves, and the fields a client may send it (the fuzzed ones).
ROUTES = {
    "/v1/completions": ({"prompt": "Once upon a time", "max_tokens": 4}, (
        "prompt", "max_tokens", "n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "logprobs",
        "echo", "logit_bias", "stream", "stream_options", "response_format", "structured_outputs", "prompt_logprobs",
        "truncate_prompt_tokens", "allowed_token_ids", "bad_words", "include_stop_str_in_output", "use_beam_search",
        "priority", "stream_interval", "vllm_xargs", "repetition_detection", "cache_salt", "return_token_ids",
        "add_special_tokens", "model")),
    "/v1/chat/completions": ({"messages": MESSAGES, "max_tokens": 4}, (
        "messages", "max_tokens", "max_completion_tokens", "n", "temperature", "logprobs", "top_logprobs", "tools",
        "tool_choice", "parallel_tool_calls", "response_format", "structured_outputs", "stream", "stream_options",
        "chat_template_kwargs", "documents", "add_generation_prompt", "continue_final_message", "echo",
        "reasoning_effort", "include_reasoning", "stop", "min_tokens", "prompt_logprobs", "return_prompt_text")),
    "/v1/responses": ({"input": "Tom had a red ball", "max_output_tokens": 4}, (
        "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice", "text",
        "reasoning", "stream", "include", "top_logprobs", "store", "metadata", "parallel_tool_calls", "truncation",
        "service_tier", "prompt_cache_key", "safety_identifier", "max_tool_calls")),
    "/v1/messages": ({"messages": MESSAGES, "max_tokens": 4}, (
        "messages", "system", "max_tokens", "temperature", "top_p", "top_k", "stop_sequences", "stream", "tools",
        "tool_choice", "metadata", "thinking")),
    "/tokenize": ({"prompt": "Tom had a red ball"}, ("prompt", "add_special_tokens", "return_token_strs", "messages")),
    "/detokenize": ({"tokens": [1, 2, 3]}, ("tokens",)),
}

SCALARS = st.sampled_from([None, True, False, 0, 1, -1, 2, 16, 2**31, 2**63, -2**63 - 1, 10**30, 0.5, -0.0, 1e308,
                           float("nan"), float("inf"), float("-inf"), "", "5", "auto", "required", "none", "x" * 3000,
                           "\ud800", "a\udfffb", "\u0000", "function", "json_object"])
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(["type", "name", "function", "mode", "tools", "allowed_tools", "include_usage", "json", "regex",
                     "choice", "schema", "json_schema", "role", "content", "text", "format", "effort", "\ud800"]),
    inner, max_size=3), max_leaves=6)
# Values that reach deeper: well-formed shapes with a wrong piece somewhere inside.
SHAPED = st.sampled_from([
    TOOLS, [{"type": "function"}], [{"type": "custom", "name": "f"}],
    {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [{"type": "function",
                                                                               "function": {"name": "g"}}]}},
    {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "f"}]},
    {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "mcp"}]}},
    {"type": "function", "function": {"name": "f"}}, {"type": "function", "name": "zz"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}, {"type": "json_object"},
    {"regex": "[ab]+"}, {"choice": ["yes", "no"]}, {"json": {"type": "string", "maxLength": 3}},
    {"include_usage": True, "continuous_usage_stats": True}, {"format": {"type": "json_object"}},
    [{"role": "assistant", "content": "The end"}], [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f",
                                                                                         "arguments": "{"}}]}],
    {"1": 100, "2": -100}, {"enable_thinking": False}, ["\n", "."], [0, 1, 2**40],
])
VALUES = st.one_of(SCALARS, JSON, SHAPED)


def post(url: str, path: str, body: dict) -> tuple[int, dict | None, list[str]]:
    """(status, the error object of a non-200 answer, a 200 stream's data lines); NaN, Infinity and lone
    surrogates are written as the JSON tokens and escapes a client's encoder writes."""
    content = json.dumps({"model": MODEL, **body}, allow_nan=True).encode("utf-8", "surrogatepass")
    with httpx.stream("POST", f"{url}{path}", content=content, timeout=60,
                      headers={"content-type": "application/json"}) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.json()["error"], []
        return 200, None, [line for line in r.iter_lines() if line.startswith("data:")]


@pytest.fixture(scope="module")
def server(stories_path):
    """(url, engine): stories260K with the tests' chat template and a hermes tool call parser."""
    options = ServerOptions(chat_template=CHAT_TEMPLATE, tool_call_parser="hermes")
    with running_server(stories_path, max_model_len=256, options=options) as running:
        yield running


@st.composite
def bodies(draw) -> tuple[str, dict, list[str]]:
    """(route, body, the fields changed): a served body with one to three fields set to drawn values."""
    path = draw(st.sampled_from(sorted(ROUTES)))
    base, fields = ROUTES[path]
    changed = draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True))
    body = dict(base)
    for name in changed:
        body[name] = draw(VALUES)
    return path, body, changed


def stream_ended(path: str, lines: list[str]) -> bool:
    """Whether a 200 event stream ended as its API ends one, with no server error inside."""
    events = [line[5:].strip() for line in lines]
    if any('"server_error"' in event or '"api_error"' in event for event in events):
        return False
    if path in ("/v1/completions", "/v1/chat/completions"):
        return events[-1:] == ["[DONE]"]
    end = json.loads(events[-1]) if events else {}
    return end.get("type") in ("response.completed", "response.incomplete", "message_stop", "error")


@settings(max_examples=220, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=bodies())
def check_body(url: str, case: tuple[str, dict, list[str]]) -> None:
    path, body, changed = case
    status, error, lines = post(url, path, body)
    if status == 200:
        if body.get("stream") is True or (body.get("stream") in (1, "true") and path != "/tokenize"):
            assert lines and stream_ended(path, lines), (path, body, lines[-3:])
        return
    assert 400 <= status < 500, (path, body, status, error)
    assert error["message"] and error["type"] != "server_error", (path, body, error)
    # An error names a field: one the body changed, or one its value made the request reach.
    assert error["param"], (path, body, error)


def test_fuzzed_bodies_are_answered_or_refused_naming_a_field(server, healthy):
    with healthy.in_flight():     # a greedy stream beside them, held to its solo text when the module ends
        check_body(server[0])


BROKEN_BODIES = {
    "NaN token": b'{"model": NaN, "prompt": "a"}',
    "Infinity token": b'{"model": -Infinity, "prompt": "a"}',
    "invalid UTF-8": b'{"model": "stories", "prompt": "\xff\xfe"}',
    "lone surrogate key": b'{"model": "stories", "prompt": "a", "\\ud800": 1}',
    "nested too deep": b'{"model": "stories", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "number of 5000 digits": b'{"model": "stories", "prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}",
    "not an object": b"[1, 2]",
    "cut short": b'{"model": "stories", "prompt": "a"',
    "empty": b"",
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                                  "/tokenize", "/detokenize"])
def test_bodies_that_are_no_request_are_a_400(server, healthy, path):
    url, _ = server
    with healthy.in_flight():
        for name, content in BROKEN_BODIES.items():
            r = httpx.post(f"{url}{path}", content=content, headers={"content-type": "application/json"}, timeout=60)
            assert r.status_code == 400, (name, r.text[:300])
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"], (name, error)
