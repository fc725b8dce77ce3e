"""`minillm serve` under request shapes earlier rounds did not try, held to vLLM's server.

A real server on loopback with a chat template; each test runs with a healthy greedy stream in
flight, and every such stream must end with the text of the same request made alone.
"""
from __future__ import annotations

import json
import logging
import socket
import threading

import httpx
import pytest
import uvicorn
from test_server_helpers import running_router, sse_events, wait_for
from test_server_helpers import chat_template_server, story_streams  # noqa: F401 (the server and healthy fixtures)

from minillm.router import RouterConfig

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
    assert "tool_calls" not in choice["message"]     # none: vLLM leaves an empty list out
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


# ---- the router passes the client's headers as it sent them ------------------------------------------

@pytest.fixture(scope="module")
def router_url(server):
    """A router whose prefill and decode server is the module's server."""
    with running_router(RouterConfig((server[0],), (server[0],))) as url:
        yield url


@pytest.mark.parametrize("header", ["x-request-id", "x-api-key", "authorization"])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/models"])
def test_the_router_passes_a_header_that_is_not_ascii_as_the_client_sent_it(router_url, healthy_stream, header, path):
    # HTTP carries header values as bytes (a server reads them as Latin-1, as a minillm server does);
    # the router handed them to httpx as str, which httpx refuses to encode past ASCII: a 500.
    headers = {header: "caf\u00e9".encode("latin-1")}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    if path == "/v1/models":
        reply = httpx.get(router_url + path, headers=headers, timeout=60)
    else:
        reply = httpx.post(router_url + path, json=body, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text[:500]


@pytest.fixture
def router_log_kept():
    """The router logger's handlers, propagation and level as they were before run_router set them."""
    logger = logging.getLogger("minillm.router")
    kept = (list(logger.handlers), logger.propagate, logger.level)
    yield
    logger.handlers[:], logger.propagate = kept[0], kept[1]
    logger.setLevel(kept[2])


def test_the_router_answers_bytes_that_are_not_http_after_the_responses_due_as_a_server_does(
        server, healthy_stream, monkeypatch, router_log_kept):
    # `minillm router` ran uvicorn's own protocol: a request pipelined before bytes that are not HTTP
    # lost its response to a plain-text 400 written in its place (a server answers it, then a JSON 400).
    import minillm.router as router_module
    served = {}
    monkeypatch.setattr(router_module.uvicorn.Server, "run", lambda self, sockets=None: served.update(config=self.config))
    config = RouterConfig((server[0],), (server[0],))
    router_module.run_router(config, host="127.0.0.1", port=0)
    monkeypatch.undo()
    http = uvicorn.Server(uvicorn.Config(served["config"].app, **router_module.router_uvicorn_settings(config),
                                         log_config=None))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: http.started, timeout=30)
        with socket.create_connection(sock.getsockname(), timeout=30) as client:
            client.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\nNOT HTTP\r\n\r\n")
            received = b""
            while chunk := client.recv(65536):
                received += chunk
    finally:
        http.should_exit = True
        thread.join(30)
        sock.close()
    first, second = received.split(b"HTTP/1.1 ")[1:]
    assert first.startswith(b"200 ") and json.loads(first.split(b"\r\n\r\n", 1)[1])["data"][0]["id"] == MODEL
    assert second.startswith(b"400 ") and b"content-type: application/json" in second
    assert json.loads(second.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "invalid_http_request"
