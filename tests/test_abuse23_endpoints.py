"""/v1/responses and /v1/messages as their real clients use them, and as careless ones misuse them:
wrong types deep in input items and content blocks are 400s naming the field in that API's terms
(never a 500, never the chat request's names), with a stream of another client unharmed; replies cut
by max_tokens say so in each API's words."""
from __future__ import annotations

import json

import httpx
import pytest
from test_server_helpers import chat_model_dir, running_router, running_server, story_streams  # noqa: F401 (healthy)

from minillm.outputs import CompletionOutput
from minillm.router import RouterConfig
from minillm.server.app import ServerOptions, ServerThread, create_app
from minillm.server.serving_responses import response_status

anthropic = pytest.importorskip("anthropic")

KEY = "sk-abuse23"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    """(url, engine) of a plain app over a chat-capable stories260K (max_model_len 256); the engine
    also serves the parsed app (parsers_url)."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    with running_server(model, max_model_len=256) as running:
        yield running


@pytest.fixture(scope="module")
def parsers_url(server):
    """An app over the same engine with --enable-auto-tool-choice --tool-call-parser hermes
    --reasoning-parser deepseek_r1 --api-key KEY."""
    options = ServerOptions(served_model_name="stories", tool_call_parser="hermes", reasoning_parser="deepseek_r1",
                            api_key=KEY)
    app = ServerThread(create_app(server[1], options)).start()
    yield app.url
    app.stop()


def post(url: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    """POST body as JSON written with ASCII escapes (so a lone surrogate travels as JSON can carry it)."""
    return httpx.post(f"{url}{path}", content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json", **(headers or {})})


def error_of(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


RESPONSES = {"model": "stories", "max_output_tokens": 4}
MESSAGES = {"model": "stories", "max_tokens": 4}
USER = {"role": "user", "content": "hi"}


def _tool_use(**block) -> list[dict]:
    return [USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "tu", "name": "f", "input": {},
                                                     **block}]}]


# ---- wrong types deep in items and blocks --------------------------------------------------------

RESPONSES_CASES = [
    ({"input": [{"type": "reasoning", "summary": 1}]}, "input[0].summary"),
    ({"input": [{"type": "reasoning", "content": True}]}, "input[0].content"),
    ({"input": [USER, {"type": "function_call", "call_id": 1, "name": "f", "arguments": "{}"}]}, "input[1].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": None, "arguments": "{}"}]}, "input[0].name"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "call_id": 7, "output": "sunny"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": {"a": 1}}]}, "input[0].output"),
    ({"instructions": "Be kind.", "input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]},
     "input[0].content[0].text"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": "hi \ud800"}]}, "input"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": 1}]}, "tools[0].parameters"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "description": ["x"]}]}, "tools[0].description"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "x"}}],
      "tool_choice": {"type": "function", "name": "f"}}, "tools[0].parameters"),
]

MESSAGES_CASES = [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": 1}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     "messages[0].content[0].type"),
    ({"system": "Be kind.", "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages[0].content[0].text"),
    ({"messages": _tool_use(id=1)}, "messages[1].content[0].id"),
    ({"messages": _tool_use(name=None)}, "messages[1].content[0].name"),
    ({"messages": _tool_use(input="x")}, "messages[1].content[0].input"),
    ({"messages": [*_tool_use(), {"role": "user", "content": [{"type": "tool_result", "tool_use_id": 5,
                                                               "content": "r"}]}]}, "messages[2].content[0].tool_use_id"),
    ({"messages": [USER, {"role": "assistant", "content": [{"type": "thinking", "thinking": 1, "signature": ""}]}]},
     "messages[1].content[0].thinking"),
    ({"system": [{"type": "text", "text": "a \ud800"}], "messages": [USER]}, "system"),
    ({"messages": [USER], "tools": [{"name": "f", "input_schema": 1}]}, "tools[0].input_schema"),
    ({"messages": [USER], "tools": [{"name": "f"}], "tool_choice": {"type": "any"}}, "tools[0].input_schema"),
    ({"messages": [USER], "tools": [{"name": "f", "input_schema": {"type": "object"}, "description": 2}]},
     "tools[0].description"),
    ({"messages": [USER], "tools": [{"name": "f", "input_schema": {"type": "x"}}],
      "tool_choice": {"type": "tool", "name": "f"}}, "tools[0].input_schema"),
    ({"messages": [USER], "tools": [{"name": "f", "input_schema": SCHEMA}],
      "tool_choice": {"type": "tool", "name": 3}}, "tool_choice.name"),
    ({"messages": [USER], "tools": [{"name": "f", "input_schema": SCHEMA}],
      "tool_choice": {"type": "any", "disable_parallel_tool_use": "maybe"}}, "tool_choice.disable_parallel_tool_use"),
]


@pytest.mark.parametrize(("fields", "param"), RESPONSES_CASES)
def test_a_bad_responses_item_is_a_400_naming_it(server, healthy_stream, fields, param):
    error = error_of(post(server[0], "/v1/responses", {**RESPONSES, **fields}))
    assert error["param"] == param, error
    assert "messages" not in error["message"] and "function." not in error["message"], error


@pytest.mark.parametrize(("fields", "param"), MESSAGES_CASES)
def test_a_bad_messages_block_is_a_400_naming_it(server, healthy_stream, fields, param):
    response = post(server[0], "/v1/messages", {**MESSAGES, **fields})
    error = error_of(response)
    assert response.json()["type"] == "error" and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert "tool_calls" not in error["message"] and "function." not in error["message"], error


# ---- what the clients send, served ----------------------------------------------------------------

def test_a_function_call_output_given_as_text_parts_reads_as_its_text(server):
    def input_tokens(output) -> int:
        items = [USER, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                 {"type": "function_call_output", "call_id": "c1", "output": output}]
        response = post(server[0], "/v1/responses", {**RESPONSES, "input": items})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["input_tokens"]

    assert input_tokens([{"type": "input_text", "text": "sunny"}]) == input_tokens("sunny")


def test_disable_parallel_tool_use_holds_any_to_one_call(server):
    # tool_choice any is the "required" array; disable_parallel_tool_use caps it at one item, so the
    # reply holds at most one tool_use block however long it runs.
    tool = {"name": "f", "input_schema": SCHEMA}
    for disable in (False, True):
        response = post(server[0], "/v1/messages", {
            **MESSAGES, "max_tokens": 120, "temperature": 0, "messages": [USER], "tools": [tool],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": disable}})
        assert response.status_code == 200, response.text
        blocks = response.json()["content"]
        assert all(b["type"] == "tool_use" and b["name"] == "f" for b in blocks)
        if disable:
            assert len(blocks) <= 1


# ---- a reply cut by max_tokens --------------------------------------------------------------------

def test_a_forced_tool_use_cut_by_max_tokens_stops_for_max_tokens_whole_and_streamed(server):
    client = anthropic.Anthropic(base_url=server[0], api_key="none", max_retries=0)
    kwargs = dict(model="stories", max_tokens=5, messages=[USER], tools=[{"name": "f", "input_schema": SCHEMA}],
                  tool_choice={"type": "tool", "name": "f"})
    message = client.messages.create(**kwargs)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 5
    assert [b.type for b in message.content] == ["tool_use"]
    with client.messages.stream(**kwargs) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "max_tokens" and [b.type for b in streamed.content] == ["tool_use"]


def test_a_responses_status_follows_the_outputs_own_finish():
    # A call the parser found in an output cut short still finishes the chat choice with "tool_calls":
    # the Responses status reads the output's own finish, whole and streamed alike.
    assert response_status(CompletionOutput(0, "", [1], finish_reason="length")) == "incomplete"
    assert response_status(CompletionOutput(0, "", [1], finish_reason="stop")) == "completed"


# ---- the router in front ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def router_url(server, parsers_url):
    """A router whose decode server is the key-guarded app (the Messages API goes whole to it)."""
    with running_router(RouterConfig((server[0],), (parsers_url,))) as url:
        yield url


def test_the_router_passes_an_anthropic_clients_key_and_counts_tokens(router_url, parsers_url):
    body = {**MESSAGES, "messages": [USER]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert post(router_url, path, body, {"x-api-key": KEY}).status_code == 200
        assert post(router_url, path, body, {"x-api-key": "wrong"}).status_code == 401
    client = anthropic.Anthropic(base_url=router_url, api_key=KEY, max_retries=0)
    direct = anthropic.Anthropic(base_url=parsers_url, api_key=KEY, max_retries=0)
    count = client.messages.count_tokens(model="stories", system="Be kind.", messages=[USER])
    assert count.input_tokens == direct.messages.count_tokens(model="stories", system="Be kind.",
                                                              messages=[USER]).input_tokens > 0
    assert client.messages.create(model="stories", max_tokens=3, messages=[USER]).usage.output_tokens == 3


def test_a_wrong_key_on_the_messages_api_is_anthropics_401_naming_both_headers(parsers_url):
    response = post(parsers_url, "/v1/messages", {**MESSAGES, "messages": [USER]}, {"x-api-key": "wrong"})
    assert response.status_code == 401
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    assert "x-api-key" in body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=parsers_url, api_key="wrong", max_retries=0).messages.count_tokens(
            model="stories", messages=[USER])
    # the OpenAI routes keep OpenAI's shape
    assert "type" not in post(parsers_url, "/v1/responses", {**RESPONSES, "input": "hi"}).json()
