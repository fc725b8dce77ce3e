"""POST /v1/messages (Anthropic's Messages API) through the official anthropic client: replies equal to
the chat completion of the same conversation, the event stream, tool_use blocks, stop sequences, thinking
blocks, token counts, and every error in Anthropic's shape (those that name a field, and those raised
before the handler: a body that cannot be read, the API key, the body limits, an unknown path; and a
stream's failure after it began)."""
from __future__ import annotations

import contextlib
import socket

import httpx
import pytest
from test_serve_responses import servers  # noqa: F401 (plain and deepseek_r1 apps over one engine)
from test_server_helpers import chat_model_dir, openai_error, running_server

from minillm.server import serving_messages
from minillm.server.app import ServerOptions
from minillm.server.errors import APIError, EngineDeadError, RequestFailedError, anthropic_error_body
from minillm.server.limits import ServerLimits
from minillm.server.serving_messages import MessagesJob

anthropic = pytest.importorskip("anthropic")

GREEDY = {"extra_body": {"temperature": 0}}
TOOL = {"name": "get_weather", "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                         "required": ["unit"], "additionalProperties": False}}


def client(url: str):
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)


def chat(url: str, messages: list[dict], max_tokens: int, **extra) -> dict:
    response = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "stories", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_reply_is_the_chat_completion_of_the_same_conversation(servers):
    url = servers["plain"]
    message = client(url).messages.create(model="stories", max_tokens=12, system="Tell a story.",
                                          messages=[{"role": "user", "content": "Tom had a red ball."}], **GREEDY)
    expected = chat(url, [{"role": "system", "content": "Tell a story."},
                          {"role": "user", "content": "Tom had a red ball."}], 12)
    [block] = message.content
    assert block.type == "text" and block.text == expected["choices"][0]["message"]["content"]
    assert message.stop_reason == "max_tokens" and message.role == "assistant" and message.id.startswith("msg_")
    assert (message.usage.input_tokens, message.usage.output_tokens) == (expected["usage"]["prompt_tokens"], 12)
    count = client(url).messages.count_tokens(model="stories", system="Tell a story.",
                                              messages=[{"role": "user", "content": "Tom had a red ball."}])
    assert count.input_tokens == message.usage.input_tokens


def test_tool_use_and_tool_result_blocks_render_as_the_chat_messages_they_stand_for(servers):
    url = servers["plain"]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                  {"type": "tool_use", "id": "tu_1", "name": "get_weather",
                                                   "input": {"unit": "celsius"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1", "content": "sunny"}]}]
    message = client(url).messages.create(model="stories", max_tokens=10, messages=messages, tools=[TOOL],
                                          tool_choice={"type": "none"}, **GREEDY)
    expected = chat(url, [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}], "tool_calls": [
            {"id": "tu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "tu_1", "content": "sunny"}], 10)
    assert message.content[0].text == expected["choices"][0]["message"]["content"]


def test_the_event_stream_gives_the_whole_reply(servers):
    c = client(servers["plain"])
    body = dict(model="stories", max_tokens=8, messages=[{"role": "user", "content": "Lily saw a cat."}], **GREEDY)
    whole = c.messages.create(**body)
    events = list(c.messages.create(stream=True, **body))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 8
    with c.messages.stream(**body) as stream:
        assert "".join(stream.text_stream) == whole.content[0].text


# one call under "any" (a second one that max_tokens cut would be a tool_use block too, and the stop max_tokens)
@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_is_a_tool_use_block(servers, choice, stream):
    c = client(servers["plain"])
    body = dict(model="stories", max_tokens=120, messages=[{"role": "user", "content": "Weather?"}], tools=[TOOL],
                tool_choice=choice)
    if stream:
        with c.messages.stream(**body) as s:
            message = s.get_final_message()
    else:
        message = c.messages.create(**body)
    [use] = message.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input["unit"] in ("celsius", "fahrenheit")
    assert message.stop_reason == "tool_use"


def test_a_stop_sequence_is_named(servers):
    text = chat(servers["plain"], [{"role": "user", "content": "Lily"}], 40)["choices"][0]["message"]["content"]
    stop = text.split()[3]
    message = client(servers["plain"]).messages.create(
        model="stories", max_tokens=40, messages=[{"role": "user", "content": "Lily"}], stop_sequences=[stop], **GREEDY)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[:text.index(stop)]


def test_reasoning_comes_as_a_thinking_block(servers):
    body = dict(model="stories", max_tokens=10, messages=[{"role": "user", "content": "Tom had a red ball."}], **GREEDY)
    plain = client(servers["plain"]).messages.create(**body).content[0].text
    [block] = client(servers["r1"]).messages.create(**body).content        # no </think>: all thinking
    assert block.type == "thinking" and block.thinking == plain
    with client(servers["r1"]).messages.stream(**body) as stream:
        assert stream.get_final_message().content[0].thinking == plain


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10 ** 6}, "max_tokens"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"system": [{"type": "image"}]}, "system[0]"),
    ({"temperature": -1}, "temperature"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ({"tools": [TOOL], "tool_choice": {"type": "auto"}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"model": "nope"}, "model"),
])
def test_errors_are_anthropic_shaped_and_name_the_field(servers, body, param):
    response = httpx.post(f"{servers['plain']}/v1/messages", timeout=60, json={
        "model": "stories", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], **body})
    assert response.status_code in (400, 404), response.text
    data = response.json()
    assert data["type"] == "error" and data["error"]["param"] == param, data
    assert data["error"]["type"] in ("invalid_request_error", "not_found_error") and data["error"]["message"]
    assert "max_completion_tokens" not in data["error"]["message"]


def test_the_api_key_is_taken_as_anthropic_clients_send_it(stories_path, tmp_path):
    model = chat_model_dir(stories_path, tmp_path / "chat_model")
    with running_server(model, api_key="sk-local", max_model_len=128) as (url, _):
        message = anthropic.Anthropic(base_url=url, api_key="sk-local", max_retries=0).messages.create(
            model="stories", max_tokens=2, messages=[{"role": "user", "content": "Tom"}])
        assert message.usage.output_tokens == 2
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=url, api_key="sk-other", max_retries=0).messages.create(
                model="stories", max_tokens=2, messages=[{"role": "user", "content": "Tom"}])
        bearer = httpx.post(f"{url}/v1/messages", headers={"authorization": "Bearer sk-local"}, timeout=60,
                            json={"model": "stories", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
        assert bearer.status_code == 200


# ---- every error of the Messages API's routes in Anthropic's shape ------------------------------------

KEY = "sk-local"
BODY_LIMIT = 4096
MESSAGES_ROUTES = ["/v1/messages", "/v1/messages/count_tokens"]
REQUEST = {"model": "stories", "max_tokens": 4, "messages": [{"role": "user", "content": "Tom had a red ball."}]}


@pytest.fixture(scope="module")
def guarded(stories_path, tmp_path_factory):
    """URL of a server with an API key, a body limit of BODY_LIMIT bytes and a body timeout of 1 s."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    options = ServerOptions(limits=ServerLimits(max_body_bytes=BODY_LIMIT, body_timeout_s=1.0))
    with running_server(model, api_key=KEY, options=options, max_model_len=128) as (url, _):
        yield url


def anthropic_error(response, status: int, kind: str) -> dict:
    """The error object of an Anthropic-shaped error response, checked: its status and its type."""
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert body["error"]["type"] == kind and body["error"]["message"], body
    return body["error"]


def same_error_in_each_shape(post, status: int, kind: str) -> None:
    """post(path)'s error is Anthropic's (of type kind) on the Messages API's routes, OpenAI's with the
    same message on /v1/chat/completions."""
    openai = post("/v1/chat/completions")
    assert set(openai.json()) == {"error"}
    message = openai_error(openai, status)["message"]
    for path in MESSAGES_ROUTES:
        assert anthropic_error(post(path), status, kind)["message"] == message


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (405, "invalid_request_error"), (408, "invalid_request_error"),
    (413, "request_too_large"), (415, "invalid_request_error"), (429, "rate_limit_error"), (500, "api_error"),
    (503, "overloaded_error"), (504, "timeout_error"), (529, "overloaded_error"),
])
def test_each_status_has_anthropics_error_type(status, kind):
    assert anthropic_error_body(status, "why", param="p", code="c") == {
        "type": "error", "error": {"message": "why", "type": kind, "param": "p", "code": "c"}}


UNREAD_BODIES = {   # bodies refused before the handler: (content, content type)
    "malformed JSON": (b'{"model": "stories",}', "application/json"),
    "no body": (b"", "application/json"),
    "not an object": (b"[1, 2]", "application/json"),
    "not UTF-8": (b'{"model": "caf\xe9"}', "application/json"),
    "not sent as JSON": (b'{"model": "stories"}', "text/plain"),
}


@pytest.mark.parametrize("case", UNREAD_BODIES)
def test_a_body_that_cannot_be_read_is_anthropics_400(servers, case):
    content, content_type = UNREAD_BODIES[case]

    def post(path):
        return httpx.post(f"{servers['plain']}{path}", content=content, headers={"content-type": content_type},
                          timeout=60)
    same_error_in_each_shape(post, 400, "invalid_request_error")


def test_an_unknown_path_or_method_is_anthropics_404_or_405(servers):
    url = servers["plain"]
    anthropic_error(httpx.post(f"{url}/v1/messages/batches", json=REQUEST, timeout=60), 404, "not_found_error")
    wrong_method = httpx.get(f"{url}/v1/messages", timeout=60)
    anthropic_error(wrong_method, 405, "invalid_request_error")
    assert wrong_method.headers["allow"] == "POST"
    assert set(httpx.get(f"{url}/v1/chat/completions", timeout=60).json()) == {"error"}


@pytest.mark.parametrize("failure, status, kind, client_error", [
    (RuntimeError("injected"), 500, "api_error", anthropic.InternalServerError),
    (EngineDeadError("the engine loop has stopped: injected"), 500, "api_error", anthropic.InternalServerError),
    (APIError(503, "injected: no KV transfer", code="kv_transfer_unavailable"), 503, "overloaded_error",
     anthropic.ServiceUnavailableError),
], ids=["internal", "engine dead", "unavailable"])
def test_a_failure_inside_the_handler_is_anthropics(servers, monkeypatch, failure, status, kind, client_error):
    def failing(req, **kwargs):
        raise failure

    monkeypatch.setattr(serving_messages, "chat_body", failing)
    url = servers["plain"]     # a client each: uvicorn closes the connection of a request that raised
    for call in (lambda: client(url).messages.create(**REQUEST),
                 lambda: client(url).messages.count_tokens(model="stories", messages=REQUEST["messages"])):
        with pytest.raises(client_error) as caught:
            call()
        assert caught.value.status_code == status
        assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == kind
        assert "injected" in caught.value.body["error"]["message"]


def test_a_stream_that_fails_after_it_began_ends_with_anthropics_error_event(servers, monkeypatch):
    # The failure came as OpenAI's data-only event and [DONE]: the anthropic client skips an event
    # without a name, and the reply just stopped short, without message_stop and without an error.
    events_of = MessagesJob.events

    async def failing_after_the_first(self, streams):
        async with contextlib.aclosing(events_of(self, streams)) as events:
            first = await anext(events)     # message_start and ping, and as much of the reply as came with them
            yield first[:first.index("event: ping")]
            raise RequestFailedError(self.request_id, RuntimeError("injected kernel fault"))

    monkeypatch.setattr(MessagesJob, "events", failing_after_the_first)
    kinds = []
    with pytest.raises(anthropic.APIStatusError) as caught:
        for event in client(servers["plain"]).messages.create(stream=True, **REQUEST):
            kinds.append(event.type)
    assert kinds == ["message_start"]
    error = caught.value.body
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "injected kernel fault" in error["error"]["message"] and error["error"]["code"] == "engine_step_failed"
    with httpx.stream("POST", f"{servers['plain']}/v1/messages", json={**REQUEST, "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-2] == "event: error" and "[DONE]" not in "".join(lines)


def test_the_key_check_is_anthropics_401(guarded):
    def post(path):
        return httpx.post(f"{guarded}{path}", json=REQUEST, headers={"x-api-key": "sk-other"}, timeout=60)
    same_error_in_each_shape(post, 401, "authentication_error")


@pytest.mark.parametrize("how", ["declared", "chunked"])
def test_a_body_over_the_limit_is_anthropics_413(guarded, how):
    content = b'{"model": "stories", "pad": "' + b"x" * BODY_LIMIT + b'"}'

    def post(path):
        body = content if how == "declared" else iter([content[:100], content[100:]])   # chunked: no length
        return httpx.post(f"{guarded}{path}", content=body, timeout=60,
                          headers={"x-api-key": KEY, "authorization": f"Bearer {KEY}",
                                   "content-type": "application/json"})
    same_error_in_each_shape(post, 413, "request_too_large")
    with pytest.raises(anthropic.APIStatusError) as caught:
        anthropic.Anthropic(base_url=guarded, api_key=KEY, max_retries=0).messages.create(
            model="stories", max_tokens=4, messages=[{"role": "user", "content": "x" * BODY_LIMIT}])
    assert caught.value.status_code == 413 and caught.value.body["error"]["type"] == "request_too_large"


def test_a_compressed_body_is_anthropics_415(guarded):
    def post(path):
        return httpx.post(f"{guarded}{path}", json=REQUEST, timeout=60,
                          headers={"x-api-key": KEY, "authorization": f"Bearer {KEY}", "content-encoding": "gzip"})
    same_error_in_each_shape(post, 415, "invalid_request_error")


def test_a_body_that_does_not_arrive_is_anthropics_408(guarded):
    host, port = guarded.removeprefix("http://").split(":")

    def post(path):
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nx-api-key: {KEY}\r\nAuthorization: Bearer {KEY}\r\n"
                         "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"".encode())
            reply = b""
            while chunk := sock.recv(65536):      # the server answers once its body timeout has passed
                reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        return httpx.Response(int(head.split()[1]), headers=[line.split(b": ", 1) for line in head.split(b"\r\n")[1:]],
                              content=body)
    same_error_in_each_shape(post, 408, "invalid_request_error")
