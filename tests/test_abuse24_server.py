"""`minillm serve` under request shapes earlier rounds did not try, held to vLLM's server.

A real server on loopback with a chat template; each test runs with a healthy greedy stream in
flight, and every such stream must end with the text of the same request made alone.
"""
from __future__ import annotations

import json

import pytest
from test_server_helpers import sse_events
from test_server_helpers import chat_template_server, story_streams  # noqa: F401 (the server and healthy fixtures)

MODEL = "stories"

# Requests of the endpoints whose bodies declare no stream_options: the field is an unknown one there.
NO_STREAM_OPTIONS = {
    "responses": ("/v1/responses", {"model": MODEL, "input": "Tom had a ball.", "max_output_tokens": 2,
                                    "stream": True}),
    "messages": ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    "tokenize": ("/tokenize", {"model": MODEL, "prompt": "Once upon a time"}),
    "tokenize_chat": ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
    "detokenize": ("/detokenize", {"model": MODEL, "tokens": [1, 403]}),
}


@pytest.mark.parametrize("value", [{"include_usage": True}, 5])
@pytest.mark.parametrize("kind", NO_STREAM_OPTIONS)
def test_stream_options_on_an_endpoint_without_them_is_an_unknown_field(http, healthy_stream, kind, value):
    # An OpenAI client sends stream_options with every stream (the Responses API has its own); on a
    # request that does not declare the field, logging the unknown fields read it as chat's
    # StreamOptions: a 500 (AttributeError), and the connection closed.
    path, body = NO_STREAM_OPTIONS[kind]
    reply = http.post(path, json={**body, "stream_options": value})
    assert reply.status_code == 200, reply.text[:500]
    assert http.get("/health").status_code == 200        # the same connection still serves


# ---- a forced tool call cut by a stop string ---------------------------------------------------------

# A tool whose call must write '"' before it is whole: a stop string of '"' cuts every call short.
TOOL_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": TOOL_SCHEMA}}]


def _stream_finish(http, path: str, body: dict) -> list[dict]:
    """The choices of a chat stream's chunks that carry a finish reason."""
    reply = http.post(path, json={**body, "stream": True})
    assert reply.status_code == 200, reply.text[:500]
    return [c for e in sse_events(reply.text.splitlines()) for c in e["choices"] if c["finish_reason"]]


def test_a_required_tool_call_cut_by_a_stop_string_finishes_for_the_stop_string(http, healthy_stream):
    # "tool_calls" is the finish of a whole required array; a stop string that cut it before any call
    # was whole finished with "tool_calls" and no tool call at all (a client runs the calls it lists).
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 30,
            "temperature": 0, "tools": CHAT_TOOLS, "tool_choice": "required", "stop": ['"']}
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text[:500]
    [choice] = reply.json()["choices"]
    assert choice["message"]["tool_calls"] == []
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", '"')
    [last] = _stream_finish(http, "/v1/chat/completions", body)
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", '"')


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "weather"}])
def test_a_forced_tool_use_cut_by_a_stop_sequence_stops_for_the_stop_sequence(http, healthy_stream, tool_choice):
    # Anthropic's stop_reason "tool_use" asks the client to run the tool; a stop sequence that cut
    # the call short said "tool_use" (with no tool_use block, or one whose input was cut to {}).
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 30,
            "tools": [{"name": "weather", "input_schema": TOOL_SCHEMA}], "tool_choice": tool_choice,
            "stop_sequences": ['"']}
    reply = http.post("/v1/messages", json=body)
    assert reply.status_code == 200, reply.text[:500]
    assert (reply.json()["stop_reason"], reply.json()["stop_sequence"]) == ("stop_sequence", '"')
    reply = http.post("/v1/messages", json={**body, "stream": True})
    [delta] = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")
               and json.loads(line[6:])["type"] == "message_delta"]
    assert (delta["delta"]["stop_reason"], delta["delta"]["stop_sequence"]) == ("stop_sequence", '"')
