"""Server: OpenAI's tool_choice {"type": "allowed_tools"} served on chat completions and responses as
tool_choice mode over the tools it names (refused with a 400 naming the part at fault where it is
malformed); a lone surrogate in a string field read by hand (prompt_cache_key, safety_identifier) is a
400 naming it; clients that hang up mid-stream, many at once, leave a greedy stream beside them with
its solo text and the engine with nothing running."""
from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
from test_server_helpers import (  # noqa: F401 (story_streams: the healthy fixture)
    CHAT_TEMPLATE, get_stats, openai_error, running_server, sse_events, story_streams, wait_for,
)

from minillm.server.app import ServerOptions

MODEL = "stories"
MESSAGES = [{"role": "user", "content": "Tom had a red ball"}]
F = {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}}
G = {"name": "g"}
CHAT_TOOLS = [{"type": "function", "function": F}, {"type": "function", "function": G}]
RESPONSES_TOOLS = [{"type": "function", **F}, {"type": "function", **G}]
# Renders the names of the tools it is given, and nothing else: the prompt shows which tools the request offers.
TOOL_NAMES_TEMPLATE = "{{ bos_token }}{% for t in tools or [] %}{{ t.function.name }};{% endfor %}assistant:"


@pytest.fixture(scope="module")
def server(stories_path):
    """(url, engine): stories260K with the tests' chat template, a hermes tool call parser, and request
    chat templates rendered."""
    options = ServerOptions(chat_template=CHAT_TEMPLATE, tool_call_parser="hermes", trust_request_chat_template=True)
    with running_server(stories_path, max_model_len=256, options=options) as running:
        yield running


def chat_allowed(mode: str, *names: str) -> dict:
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [
        {"type": "function", "function": {"name": name}} for name in names]}}


def responses_allowed(mode: str, *names: str) -> dict:
    return {"type": "allowed_tools", "mode": mode, "tools": [{"type": "function", "name": name} for name in names]}


def chat(url: str, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": MESSAGES, "tools": CHAT_TOOLS, "temperature": 0, "max_tokens": 80, **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


@pytest.mark.parametrize("name", ["f", "g"])
def test_chat_allowed_tools_required_calls_one_of_the_allowed_tools(server, healthy, name):
    url, _ = server
    with healthy.in_flight():
        r = chat(url, tool_choice=chat_allowed("required", name), parallel_tool_calls=False)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and [call["function"]["name"] for call in calls] == [name]
    arguments = json.loads(calls[0]["function"]["arguments"])
    assert arguments == {} if name == "g" else set(arguments) == {"a"}


def test_chat_allowed_tools_streamed_calls_only_the_allowed_tool(server):
    url, _ = server
    body = {"model": MODEL, "messages": MESSAGES, "tools": CHAT_TOOLS, "temperature": 0, "max_tokens": 80,
            "tool_choice": chat_allowed("required", "g"), "parallel_tool_calls": False, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    events = sse_events(lines)
    names = [call["function"]["name"] for e in events for c in e["choices"]
             for call in c["delta"].get("tool_calls") or [] if call.get("function", {}).get("name")]
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert names == ["g"] and finish == ["tool_calls"] and lines[-1] == "data: [DONE]"


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_chat_allowed_tools_offers_the_model_only_the_allowed_tools(server, mode):
    url, _ = server
    r = chat(url, tool_choice=chat_allowed(mode, "g"), chat_template=TOOL_NAMES_TEMPLATE, return_prompt_text=True,
             max_tokens=2)
    assert r.status_code == 200, r.text
    assert r.json()["prompt_text"] == "<s>g;assistant:"
    # Without it, every tool is offered.
    r = chat(url, tool_choice=mode, chat_template=TOOL_NAMES_TEMPLATE, return_prompt_text=True, max_tokens=2)
    assert r.json()["prompt_text"] == "<s>f;g;assistant:"


@pytest.mark.parametrize("tool_choice, param", [
    ({"type": "allowed_tools"}, "tool_choice.allowed_tools"),
    ({"type": "allowed_tools", "allowed_tools": ["f"]}, "tool_choice.allowed_tools"),
    ({"type": "allowed_tools", "allowed_tools": {"tools": [{"type": "function", "function": {"name": "f"}}]}},
     "tool_choice.allowed_tools.mode"),
    (chat_allowed("any", "f"), "tool_choice.allowed_tools.mode"),
    (chat_allowed("required"), "tool_choice.allowed_tools.tools"),
    (chat_allowed("required", "zz"), "tool_choice.allowed_tools.tools.0.function.name"),
    (chat_allowed("auto", "f", "zz"), "tool_choice.allowed_tools.tools.1.function.name"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "mcp", "server_label": "x"}]}},
     "tool_choice.allowed_tools.tools.0.type"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": ["f"]}},
     "tool_choice.allowed_tools.tools.0.type"),
    ({**chat_allowed("auto", "f"), "mode": "required"}, "tool_choice.mode"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {
        "name": "f"}}], "strict": True}}, "tool_choice.allowed_tools.strict"),
], ids=["no-object", "a-list", "no-mode", "bad-mode", "no-tools", "unknown-tool", "second-unknown", "mcp-tool",
        "a-name-string", "responses-shape", "unknown-key"])
def test_chat_allowed_tools_malformed_is_a_400_naming_the_part(server, tool_choice, param):
    url, _ = server
    error = openai_error(chat(url, tool_choice=tool_choice), 400, param)
    assert "built-in" not in error["message"]


def test_chat_allowed_tools_without_tools_is_a_400(server):
    url, _ = server
    r = chat(url, tools=None, tool_choice=chat_allowed("required", "f"))
    openai_error(r, 400, "tool_choice")


def responses(url: str, **fields) -> httpx.Response:
    body = {"model": MODEL, "input": "Tom had a red ball", "tools": RESPONSES_TOOLS, "temperature": 0,
            "max_output_tokens": 80, **fields}
    return httpx.post(f"{url}/v1/responses", json=body, timeout=60)


def test_responses_allowed_tools_required_calls_the_allowed_tool(server, healthy):
    url, _ = server
    tool_choice = responses_allowed("required", "g")
    with healthy.in_flight():
        r = responses(url, tool_choice=tool_choice, parallel_tool_calls=False)
    assert r.status_code == 200, r.text
    reply = r.json()
    calls = [item for item in reply["output"] if item["type"] == "function_call"]
    assert [(call["name"], call["arguments"]) for call in calls] == [("g", "{}")]
    assert reply["tool_choice"] == tool_choice and reply["status"] == "completed"


def test_responses_allowed_tools_auto_is_served(server):
    url, _ = server
    r = responses(url, tool_choice=responses_allowed("auto", "f"), max_output_tokens=4)
    assert r.status_code == 200, r.text
    assert r.json()["tool_choice"] == responses_allowed("auto", "f")


@pytest.mark.parametrize("tool_choice, param", [
    ({"type": "allowed_tools", "tools": [{"type": "function", "name": "f"}]}, "tool_choice.mode"),
    ({"type": "allowed_tools", "mode": "required"}, "tool_choice.tools"),
    ({"type": "allowed_tools", "mode": "required", "tools": []}, "tool_choice.tools"),
    (responses_allowed("required", "f", "zz"), "tool_choice.tools[1].name"),
    ({"type": "allowed_tools", "mode": "auto", "tools": [{"type": "web_search"}]}, "tool_choice.tools[0].type"),
    ({**responses_allowed("auto", "f"), "allowed_tools": {}}, "tool_choice.allowed_tools"),
], ids=["no-mode", "no-tools", "empty-tools", "unknown-tool", "built-in-tool", "chat-shape"])
def test_responses_allowed_tools_malformed_is_a_400_naming_the_part(server, tool_choice, param):
    url, _ = server
    openai_error(responses(url, tool_choice=tool_choice), 400, param)


def test_responses_tool_choice_of_another_type_names_what_is_served(server):
    url, _ = server
    error = openai_error(responses(url, tool_choice={"type": "bogus"}), 400, "tool_choice.type")
    assert "function or allowed_tools" in error["message"]


@pytest.mark.parametrize("field", ["prompt_cache_key", "safety_identifier"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_in_an_echoed_responses_field_is_a_400_naming_it(server, field, stream):
    url, _ = server
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "stream": stream, field: "key\ud800"}
    r = httpx.post(f"{url}/v1/responses", content=json.dumps(body).encode(), timeout=60,
                   headers={"content-type": "application/json"})
    error = openai_error(r, 400, field)
    assert "surrogate" in error["message"]


HANG_UPS = [("/v1/completions", {"prompt": "Once upon a time", "n": 3, "max_tokens": 120, "ignore_eos": True}),
            ("/v1/chat/completions", {"messages": MESSAGES, "n": 2, "max_tokens": 120, "ignore_eos": True}),
            ("/v1/responses", {"input": "Tom had a red ball", "max_output_tokens": 120, "ignore_eos": True}),
            ("/v1/messages", {"messages": MESSAGES, "max_tokens": 120})]


async def hang_up_after(client: httpx.AsyncClient, url: str, path: str, body: dict, num_lines: int) -> None:
    """Stream body and leave after num_lines lines (0: once the headers are in)."""
    body = {"model": MODEL, "stream": True, **body}
    async with client.stream("POST", f"{url}{path}", json=body) as r:
        assert r.status_code == 200
        if num_lines:
            async for _ in r.aiter_lines():
                num_lines -= 1
                if not num_lines:
                    break


async def leave_before_the_answer(client: httpx.AsyncClient, url: str, started: asyncio.Event) -> None:
    """A non-streamed completion whose client leaves while it is being generated."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True}
    task = asyncio.ensure_future(client.post(f"{url}/v1/completions", json=body))
    await started.wait()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):    # a busy machine may have answered it already
        await task


async def many_hang_ups(url: str) -> None:
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as client:
        started = asyncio.Event()
        leaving = [asyncio.ensure_future(leave_before_the_answer(client, url, started)) for _ in range(10)]
        await asyncio.gather(*(hang_up_after(client, url, path, body, i % 6)
                               for i, (path, body) in enumerate(HANG_UPS * 10)))
        started.set()
        await asyncio.gather(*leaving)


def test_many_clients_hanging_up_mid_stream_leave_the_others_and_the_engine_whole(server, healthy):
    url, _ = server
    with healthy.in_flight(fresh=True):
        asyncio.run(many_hang_ups(url))
    idle = wait_for(lambda: (s := get_stats(url))["num_running"] == 0 and s["kv_num_used_blocks"] == 0, timeout=60)
    assert idle, get_stats(url)
    # The server answers in full after them.
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 5,
                                                  "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
