"""POST /v1/messages as Claude-API code drives it (the anthropic client and raw HTTP): consecutive turns
of one role combined into one, an empty final assistant message, the event stream's order and shapes
with a stop sequence, errors in this API's words, and a client that hangs up mid-stream."""
from __future__ import annotations

import json
import socket

import httpx
import pytest
from core_hooks import install
from test_server_helpers import call_utility, get_stats, running_server, wait_for

from minillm.server.app import ServerOptions

anthropic = pytest.importorskip("anthropic")

# A template that refuses two user (or assistant) turns in a row, as Llama 2's, Mistral's and Gemma's do.
ALTERNATING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if not loop.first and m['role'] in ('user', 'assistant') and m['role'] == loop.previtem['role'] %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def server(stories_path):
    """(url, engine) of a server "stories" with the alternating template, on a core with core_hooks."""
    options = ServerOptions(chat_template=ALTERNATING_TEMPLATE)
    with running_server(stories_path, options=options, core_hook=install, engine_core="process",
                        max_model_len=256) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server[0], api_key="none", max_retries=0)


def reply(client, messages: list[dict], max_tokens: int = 12, **fields):
    return client.messages.create(model="stories", max_tokens=max_tokens, messages=messages, **fields, **GREEDY)


def count(client, messages: list[dict]) -> int:
    return client.messages.count_tokens(model="stories", messages=messages).input_tokens


def test_consecutive_user_messages_are_one_turn(client):
    # Anthropic's API combines them; they reached the template as two turns, which a template that
    # requires alternating roles refused (400 'chat template failed').
    apart = [{"role": "user", "content": "Tom had a red ball."}, {"role": "user", "content": "He liked it."}]
    together = [{"role": "user", "content": [{"type": "text", "text": "Tom had a red ball."},
                                             {"type": "text", "text": "He liked it."}]}]
    assert reply(client, apart).content == reply(client, together).content
    assert count(client, apart) == count(client, together)


def test_consecutive_assistant_messages_are_one_turn_text_and_tool_use_alike(client):
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"unit": "celsius"}}
    apart = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": "Let me look."},
             {"role": "assistant", "content": [call]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
             {"role": "user", "content": "And tomorrow?"}]
    together = [apart[0], {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, call]},
                {"role": "user", "content": [apart[3]["content"][0], {"type": "text", "text": "And tomorrow?"}]}]
    assert count(client, apart) == count(client, together)
    assert reply(client, apart).content == reply(client, together).content


def test_consecutive_assistant_messages_at_the_end_are_one_prefill(client):
    apart = [{"role": "user", "content": "Lily"}, {"role": "assistant", "content": "Once upon"},
             {"role": "assistant", "content": "a time"}]
    together = [apart[0], {"role": "assistant", "content": "Once upon\na time"}]
    assert reply(client, apart).content == reply(client, together).content


@pytest.mark.parametrize("empty", ["", [], [{"type": "text", "text": ""}]])
def test_an_empty_final_assistant_message_asks_for_a_new_turn(client, empty):
    # Anthropic's API takes it (the one message whose content may be empty) and answers the user; it
    # was rendered as an empty assistant turn followed by a new one (or, as an empty text block, as
    # a prefill of nothing).
    asked = [{"role": "user", "content": "Tom had a red ball."}]
    with_empty = asked + [{"role": "assistant", "content": empty}]
    assert count(client, with_empty) == count(client, asked)
    assert reply(client, with_empty).content == reply(client, asked).content


def events(url: str, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event of a streamed /v1/messages request."""
    with httpx.stream("POST", f"{url}/v1/messages", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    out = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), chunk
        out.append((name[len("event: "):], json.loads(data[len("data: "):])))
    return out


def test_the_event_stream_is_in_anthropics_order_and_names_the_stop_sequence(server, client):
    asked = [{"role": "user", "content": "Lily"}]
    text = reply(client, asked, max_tokens=30).content[0].text
    stop = text.split()[2]
    body = {"model": "stories", "max_tokens": 30, "temperature": 0, "messages": asked, "stop_sequences": ["zzz", stop]}
    stream = events(server[0], body)
    names = [name for name, _ in stream]
    assert all(data["type"] == name for name, data in stream)
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"} and names[-3:] == ["content_block_stop", "message_delta",
                                                                          "message_stop"]
    start = stream[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert stream[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [data for name, data in stream if name == "content_block_delta"]
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in deltas)
    assert "".join(d["delta"]["text"] for d in deltas) == text[:text.index(stop)]
    whole = reply(client, asked, max_tokens=30, stop_sequences=["zzz", stop])
    delta = stream[-2][1]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", stop)


def test_an_empty_tool_choice_name_is_named_as_this_api_names_it(server):
    tool = {"name": "get_weather", "input_schema": {"type": "object"}}
    response = httpx.post(f"{server[0]}/v1/messages", timeout=60, json={
        "model": "stories", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [tool],
        "tool_choice": {"type": "tool", "name": ""}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    # It was the chat API's words: tool_choice.function.name, {"type": "function", ...}.
    assert error["param"] == "tool_choice.name" and "function" not in error["message"], error


def test_a_block_a_role_does_not_take_is_named_in_plain_words(server):
    response = httpx.post(f"{server[0]}/v1/messages", timeout=60, json={
        "model": "stories", "max_tokens": 4, "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[1].content[0].type"
    assert "an assistant message" in error["message"], error


def hang_up_after(url: str, body: dict, num_deltas: int) -> None:
    """Stream body from /v1/messages on a bare socket and close it once num_deltas text deltas came."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps({**body, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        received = b""
        while received.count(b"event: content_block_delta") < num_deltas:
            chunk = sock.recv(65536)
            assert chunk, "the stream ended early"
            received += chunk


def test_a_client_that_hangs_up_mid_stream_frees_its_sequence(server):
    url, engine = server
    num_aborted = len(call_utility(engine, "aborted_requests"))
    call_utility(engine, "pace_steps", 0.05)
    try:
        hang_up_after(url, {"model": "stories", "max_tokens": 200, "messages": [{"role": "user", "content": "Lily"}]},
                      num_deltas=3)
        aborted = wait_for(lambda: call_utility(engine, "aborted_requests")[num_aborted:], timeout=60)
    finally:
        call_utility(engine, "pace_steps", 0)
    [(_, _, _, num_output_tokens)] = aborted
    assert num_output_tokens < 200
    freed = wait_for(lambda: (s := get_stats(url))["num_running"] == 0 and s["kv_num_used_blocks"] == 0, timeout=60)
    assert freed, "the request kept its blocks after its client left"


@pytest.mark.parametrize("kind", ["image", "document"])
def test_an_image_or_document_in_a_tool_result_is_refused_as_one(server, kind):
    # Anthropic's API takes them there; the 400 said "must be a text block", as of a malformed block.
    block = {"type": kind, "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    response = httpx.post(f"{server[0]}/v1/messages", timeout=60, json={
        "model": "stories", "max_tokens": 4, "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "a map:"}, block]}]}]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages[2].content[0].content[1].type", error
    assert f"{kind} blocks are not supported" in error["message"], error


def test_a_run_of_consecutive_messages_is_joined_once(monkeypatch):
    # Joined pairwise, each join copied the parts so far: 300,000 one-word messages (a 10 MB body) took
    # minutes of the server's thread, quadratic in the run's length.
    from minillm.server import serving_messages
    joins = []
    real_joined = serving_messages._joined
    monkeypatch.setattr(serving_messages, "_joined", lambda group: joins.append(len(group)) or real_joined(group))
    messages = [{"role": "user", "content": f"w{i}"} for i in range(1000)]
    messages += [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"},
                 {"role": "user", "content": "c"}]
    request = serving_messages.MessagesRequest(model="stories", max_tokens=4, messages=messages)
    user, assistant, last = serving_messages.chat_body(request)["messages"]
    assert joins == [1000, 2]
    assert [part["text"] for part in user["content"]] == [f"w{i}" for i in range(1000)]
    assert assistant["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert last == {"role": "user", "content": "c"}
