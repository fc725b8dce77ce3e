"""POST /v1/messages (Anthropic's Messages API) through the official anthropic client: replies equal to
the chat completion of the same conversation, the event stream, tool_use blocks, stop sequences, thinking
blocks, token counts, and errors in Anthropic's shape that name the field."""
from __future__ import annotations

import httpx
import pytest
from test_serve_responses import servers  # noqa: F401 (plain and deepseek_r1 apps over one engine)

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


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_is_a_tool_use_block(servers, choice, stream):
    c = client(servers["plain"])
    body = dict(model="stories", max_tokens=60, messages=[{"role": "user", "content": "Weather?"}], tools=[TOOL],
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
    from test_server_helpers import chat_model_dir, running_server
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
