"""Behaviour the server shares with vLLM's: tool-call history and custom roles reach the chat template,
tools under tool_choice "none", the tool choice that needs a parser refused, max_tokens null, logit_bias
clamped, allowed_token_ids and bad_words, top_k past the vocabulary, continuous usage stats, and CORS.

A real server on loopback whose chat template renders tool calls; each test runs with a healthy greedy
stream in flight, and every such stream must end with the text of the same request made alone.
"""
from __future__ import annotations

import httpx
import pytest
from starlette.testclient import TestClient
from test_server_helpers import openai_error, running_server, sse_events, story_streams  # noqa: F401

from minillm.server.app import ServerOptions, create_app

MODEL = "stories"
# Renders every field a tool-using conversation carries, so that the prompt's tokens show what arrived.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\n' }}{% endif %}"
    "{% for m in messages %}{{ m.role }}:{% if m.reasoning_content is defined %} ({{ m.reasoning_content }}){% endif %}"
    " {{ m.content }}{% for c in m.tool_calls or [] %} call {{ c.id }} {{ c.function.name }}"
    " {{ c.function.arguments | tojson }}{% endfor %}{% if m.tool_call_id is defined %} re {{ m.tool_call_id }}"
    "{% endif %}{{ '\n' }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object"}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    {"role": "user", "content": "What is the weather?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL], "reasoning": "ask the tool"},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
    {"role": "narrator", "content": "Lily went out."},
]
RENDERED = ('<s>tools: get_weather\nuser: What is the weather?\nassistant: (ask the tool)  call call_1 get_weather'
            ' {"city": "Paris"}\ntool: sunny re call_1\nnarrator: Lily went out.\nassistant:')


@pytest.fixture(scope="module")
def server(stories_path):
    with running_server(stories_path, served_model_name=MODEL,
                        options=ServerOptions(chat_template=TOOL_TEMPLATE)) as (url, engine):
        yield url, engine


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": CONVERSATION, "max_tokens": 6, "temperature": 0, **fields}


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, **fields}


def _ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text[:500]
    return response.json()


def _with_message(index: int, **fields) -> list[dict]:
    return [{**m, **fields} if i == index else m for i, m in enumerate(CONVERSATION)]


@pytest.mark.parametrize("reasoning_field", ["reasoning", "reasoning_content"])
def test_tool_calls_tool_results_reasoning_custom_roles_and_tools_reach_the_template(http, tok, healthy_stream,
                                                                                      reasoning_field):
    ids = tok.encode(RENDERED, add_special_tokens=False)
    messages = _with_message(1, **{"reasoning": None, reasoning_field: "ask the tool"})
    reply = _ok(http.post("/v1/chat/completions", json=_chat(messages=messages, tools=TOOLS, tool_choice="none")))
    assert reply["usage"]["prompt_tokens"] == len(ids)
    alone = _ok(http.post("/v1/completions", json=_completion(prompt=ids)))
    assert reply["choices"][0]["message"]["content"] == alone["choices"][0]["text"]


def test_an_empty_tool_call_list_and_arguments_left_out_render_as_vllm_renders_them(http, tok, healthy_stream):
    no_calls = _with_message(1, tool_calls=[], content="Let me see.")
    text = RENDERED.replace('(ask the tool)  call call_1 get_weather {"city": "Paris"}', "(ask the tool) Let me see.")
    reply = _ok(http.post("/v1/chat/completions", json=_chat(messages=no_calls, tools=TOOLS, tool_choice="none")))
    assert reply["usage"]["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False))
    bare_call = {"id": "call_1", "function": {"name": "get_weather"}}      # type defaults; arguments: {}
    reply = _ok(http.post("/v1/chat/completions", json=_chat(messages=_with_message(1, tool_calls=[bare_call]),
                                                             tools=TOOLS, tool_choice="none")))
    text = RENDERED.replace('{"city": "Paris"}', "{}")
    assert reply["usage"]["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False))


def _arguments(text: str) -> list[dict]:
    return _with_message(1, tool_calls=[{**CALL, "function": {"name": "get_weather", "arguments": text}}])


MALFORMED = [
    ("tool-calls-not-a-list", _with_message(1, tool_calls="call it"), "messages.1.tool_calls"),
    ("tool-call-function-not-an-object", _with_message(1, tool_calls=[{"id": "a", "function": 5}]),
     "messages.1.tool_calls.0.function"),
    ("tool-call-without-name", _with_message(1, tool_calls=[{"id": "a", "function": {"arguments": "{}"}}]),
     "messages.1.tool_calls.0.function.name"),
    ("tool-call-type", _with_message(1, tool_calls=[{**CALL, "type": "custom"}]), "messages.1.tool_calls.0.type"),
    ("arguments-not-json", _arguments("{city"), "messages.1.tool_calls.0.function.arguments"),
    ("arguments-an-object", _with_message(1, tool_calls=[{**CALL, "function": {"name": "f", "arguments": {}}}]),
     "messages.1.tool_calls.0.function.arguments"),
    ("arguments-nested-too-deep", _arguments("[" * 100_000), "messages.1.tool_calls.0.function.arguments"),
    ("arguments-lone-surrogate", _arguments('{"city": "\\ud800"}'), "messages.1.tool_calls.0.function.arguments"),
    ("tool-call-id-a-number", _with_message(2, tool_call_id=5), "messages.2.tool_call_id"),
    ("reasoning-a-list", _with_message(1, reasoning=["a"]), "messages.1.reasoning"),
    ("role-a-number", _with_message(0, role=5), "messages.0.role"),
    ("role-empty", _with_message(0, role=""), "messages.0.role"),
]


@pytest.mark.parametrize("messages,param", [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_tool_history_is_a_400_naming_the_field(http, healthy_stream, messages, param):
    openai_error(http.post("/v1/chat/completions", json=_chat(messages=messages)), 400, param)


TOOL_CHOICES = [
    ("tools-alone-mean-auto", {"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),
    ("auto", {"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
    ("auto-without-tools", {"tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
    ("required-without-tools", {"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ("named-not-a-tool", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice", "does not match any of the specified `tools`"),
    ("unknown", {"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", 'tool_choice must be "none"'),
    ("tool-without-function", {"tools": [{"type": "function"}], "tool_choice": "none"}, "tools.0.function", ""),
    ("tool-name-a-number", {"tools": [{"function": {"name": 5}}], "tool_choice": "none"}, "tools.0.function.name",
     ""),
]


@pytest.mark.parametrize("fields,param,says", [c[1:] for c in TOOL_CHOICES], ids=[c[0] for c in TOOL_CHOICES])
def test_tool_choices_that_need_a_tool_parser_and_malformed_tools_are_400s(http, healthy_stream, fields, param, says):
    error = openai_error(http.post("/v1/chat/completions", json=_chat(**fields)), 400, param)
    assert says in error["message"]


def test_chat_template_kwargs_may_replace_the_tools(http, tok, healthy_stream):
    other = [{"type": "function", "function": {"name": "get_time"}}]
    fields = {"tools": TOOLS, "tool_choice": "none", "chat_template_kwargs": {"tools": other}}
    reply = _ok(http.post("/v1/chat/completions", json=_chat(**fields)))
    text = RENDERED.replace("tools: get_weather", "tools: get_time")
    assert reply["usage"]["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False))


def test_completions_max_tokens_null_is_16(http, healthy_stream):
    body = _ok(http.post("/v1/completions", json=_completion(max_tokens=None, ignore_eos=True)))
    assert body["usage"]["completion_tokens"] == 16


def test_logit_bias_past_100_is_clamped_as_vllm_clamps_it(http, healthy_stream):
    def text(bias: dict) -> str:
        return _ok(http.post("/v1/completions", json=_completion(logit_bias=bias)))["choices"][0]["text"]

    # Two tokens raised alike: the model's own logits choose between them, however far past 100 either is
    # raised (unclamped, the first or the last of these would be one token over and over).
    assert text({"300": 1e6, "400": 100}) == text({"300": 100, "400": 100}) == text({"300": 100, "400": 1e6})
    lowered = {str(token_id): -1e9 for token_id in range(512) if token_id not in (300, 400)}
    assert text(lowered) == text({k: -100 for k in lowered}) == text({"300": 100, "400": 100})
    openai_error(http.post("/v1/completions", json=_completion(logit_bias={"the": 1e6})), 400, "logit_bias")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_allowed_token_ids_and_bad_words_are_taken_as_vllm_takes_them(http, tok, healthy_stream, path):
    body_of = _completion if path == "/v1/completions" else _chat

    def text(stream: bool = False, **fields) -> str:
        body = body_of(max_tokens=24, ignore_eos=True, **fields)
        if stream:
            events = _streamed(http, path, body)
            return "".join(c["text"] if "text" in c else c["delta"].get("content") or ""
                           for e in events for c in e["choices"])
        choice = _ok(http.post(path, json=body))["choices"][0]
        return choice["text"] if path == "/v1/completions" else choice["message"]["content"]

    the = tok.encode("the", add_special_tokens=False)
    assert text(allowed_token_ids=the) == text(stream=True, allowed_token_ids=the) == " the" * 24
    plain = text()
    named = next(w for w in plain.split() if w.isalpha() and len(w) > 2)   # a word the reply says
    for stream in (False, True):
        banned = text(stream, bad_words=[named])
        assert named not in banned.split() and banned != plain
    openai_error(http.post(path, json=body_of(bad_words=[" "], stream=True)), 400, "bad_words")


@pytest.mark.parametrize("top_k", [513, 2**31, 10**20, 10**300])
def test_top_k_past_the_vocabulary_is_the_whole_vocabulary(http, healthy_stream, server, top_k):
    sampled = _completion(temperature=1.0, seed=7, max_tokens=12)
    want = _ok(http.post("/v1/completions", json={**sampled, "top_k": -1}))["choices"][0]["text"]
    for stream in (False, True):
        response = http.post("/v1/completions", json={**sampled, "top_k": top_k, "stream": stream})
        assert response.status_code == 200, response.text
        got = (response.json()["choices"][0]["text"] if not stream
               else "".join(c["text"] for e in sse_events(response.text.splitlines()) for c in e["choices"]))
        assert got == want
    assert server[1].is_healthy


def test_top_k_below_minus_one_is_a_400_and_zero_is_off(http, healthy_stream):
    openai_error(http.post("/v1/completions", json=_completion(top_k=-2)), 400, "top_k")
    assert _ok(http.post("/v1/completions", json=_completion(top_k=0)))["usage"]["completion_tokens"] == 6


def _streamed(http, path: str, body: dict) -> list[dict]:
    response = http.post(path, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    return sse_events(response.text.splitlines())


def _check_running_usage(events: list[dict], num_choices: int, max_tokens: int) -> None:
    """Every chunk carries its completion's usage so far; the last chunk, the whole request's."""
    *chunks, last = events
    prompt_tokens = last["usage"]["prompt_tokens"]
    so_far = {i: 0 for i in range(num_choices)}
    for chunk in chunks:
        [choice] = chunk["choices"]
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]
        assert usage["completion_tokens"] >= so_far[choice["index"]]
        so_far[choice["index"]] = usage["completion_tokens"]
    assert so_far == {i: max_tokens for i in range(num_choices)}
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == num_choices * max_tokens


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_usage_on_every_chunk(http, healthy_stream, path):
    body = _completion(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True) if path == "/v1/completions" \
        else _chat(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = _streamed(http, path, {**body, "stream_options": options})
    _check_running_usage(events, 2, 8)
    if path == "/v1/chat/completions":      # the role's chunk comes before any token
        openers = [e["usage"] for e in events if e["choices"] and "role" in e["choices"][0]["delta"]]
        assert [usage["completion_tokens"] for usage in openers] == [0, 0]
    # include_usage false (or null) turns it off, continuous_usage_stats with it (as in vLLM).
    events = _streamed(http, path, {**body, "stream_options": {"include_usage": False, "continuous_usage_stats": True}})
    assert all("usage" not in e for e in events)


def test_cors_allows_every_origin_by_default(http, healthy_stream):
    preflight = http.options("/v1/chat/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    response = http.post("/v1/completions", json=_completion(max_tokens=2), headers={"Origin": "http://app.example"})
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "*"
    events = http.post("/v1/completions", json=_completion(max_tokens=2, stream=True),
                       headers={"Origin": "http://app.example"})
    assert events.headers["access-control-allow-origin"] == "*"


def test_cors_options_and_errors_carry_the_headers(server):
    options = ServerOptions(api_key="sk-test", allowed_origins=("http://app.example",), allowed_methods=("POST",),
                            allow_credentials=True)
    client = TestClient(create_app(server[1], options))
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    allowed = client.options("/v1/completions", headers={"Origin": "http://app.example", **ask})
    assert allowed.status_code == 200      # no key needed: a browser sends none with its preflight
    assert allowed.headers["access-control-allow-origin"] == "http://app.example"
    assert allowed.headers["access-control-allow-credentials"] == "true"
    assert client.options("/v1/completions", headers={"Origin": "http://evil.example", **ask}).status_code == 400
    refused = client.post("/v1/completions", json=_completion(), headers={"Origin": "http://app.example"})
    openai_error(refused, 401)
    assert refused.headers["access-control-allow-origin"] == "http://app.example"   # the page can read why
    with pytest.raises(ValueError, match="allowed_origins"):
        ServerOptions(allowed_origins="*")
