"""`minillm serve` held to vLLM's server where a client of vLLM's would notice the difference.

A real server on loopback with a chat template; each test runs with a healthy greedy stream in
flight, and every such stream must end with the text of the same request made alone.
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from openai import OpenAI
from test_server_helpers import openai_error, raw_stream, sse_events, wait_for
from test_server_helpers import chat_template_server, story_streams  # noqa: F401 (the server and healthy fixtures)

MODEL = "stories"
MESSAGES = [{"role": "user", "content": "Tom had a ball."}]


def _completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, **fields}


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, **fields}


def _events(http, path: str, body: dict) -> list[dict]:
    response = http.post(path, json={**body, "stream": True})
    assert response.status_code == 200, response.text[:500]
    assert response.text.rstrip().endswith("data: [DONE]")
    return sse_events(response.text.splitlines())


BODIES = {"completion": ("/v1/completions", _completion(n=2)), "chat": ("/v1/chat/completions", _chat(n=2))}


@pytest.mark.parametrize("kind", BODIES)
def test_stream_options_include_the_usage_unless_told_not_to_as_in_vllm(http, healthy_stream, kind):
    # vLLM's StreamOptions has include_usage true by default: {} and {"continuous_usage_stats": true}
    # ask for the usage. Both streamed none here (continuous_usage_stats alone added nothing).
    path, body = BODIES[kind]
    [*chunks, last] = _events(http, path, {**body, "stream_options": {}})
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
    assert all(chunk["usage"] is None for chunk in chunks)
    [*chunks, last] = _events(http, path, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8
    assert chunks and all(chunk["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for chunk in chunks)
    for off in ({"include_usage": False}, {"include_usage": None, "continuous_usage_stats": True}):
        events = _events(http, path, {**body, "stream_options": off})
        assert events[-1]["choices"] and all("usage" not in event for event in events)


def test_top_logprobs_zero_without_logprobs_asks_for_nothing(http, healthy_stream):
    # vLLM's chat requests carry top_logprobs 0 by default and refuse only a count above it without
    # logprobs; 0 was a 400 here, so a client that always sends the field could not chat.
    want = http.post("/v1/chat/completions", json=_chat()).json()["choices"]
    for logprobs in (False, None):
        response = http.post("/v1/chat/completions", json=_chat(top_logprobs=0, logprobs=logprobs))
        assert response.status_code == 200, response.text
        assert response.json()["choices"] == want and want[0]["logprobs"] is None
    openai_error(http.post("/v1/chat/completions", json=_chat(top_logprobs=1)), 400, "top_logprobs")
    openai_error(http.post("/v1/chat/completions", json=_chat(top_logprobs=1, logprobs=False)), 400, "top_logprobs")


def test_load_counts_the_generation_requests_in_flight_as_vllm_does(http, server, healthy):
    # vLLM's GET /load ({"server_load": N}, outside /v1) counts the completions and chat completions
    # being answered, a stream until its last event, under --enable-server-load-tracking (the server
    # fixture's); it was a 404 here.
    healthy.check()                   # the healthy streams of earlier tests have ended: none in flight

    def load() -> int:
        response = http.get("/load")
        assert response.status_code == 200 and set(response.json()) == {"server_load"}
        return response.json()["server_load"]

    assert load() == 0
    openai_error(http.post("/v1/completions", json=_completion(max_tokens=0)), 400, "max_tokens")
    assert http.post("/v1/chat/completions", json=_chat()).status_code == 200
    assert http.post("/tokenize", json={"prompt": "Once"}).status_code == 200
    assert load() == 0
    body = _completion(max_tokens=200, ignore_eos=True, stream=True)
    socks = [raw_stream(server[0], body, num_chunks=2) for _ in range(2)]
    assert wait_for(lambda: load() == 2)
    for sock in socks:
        sock.close()                  # the client leaves: its stream ends, and with it its count
    assert wait_for(lambda: load() == 0)
    assert http.head("/load").status_code == 200


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}       # no parameters: any object
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "additionalProperties": False}}}


def _tool_chat(tool_choice, **fields) -> dict:
    return _chat(**{"tools": [WEATHER, TIME], "tool_choice": tool_choice, "max_tokens": 80, **fields})


def _streamed_calls(http, body: dict) -> tuple[list[dict], str]:
    """The tool calls a stream adds up to (deltas joined by their index), and its finish reason."""
    calls: dict[int, dict] = {}
    finish = []
    for event in _events(http, "/v1/chat/completions", body):
        [choice] = event["choices"]
        for delta in choice["delta"].get("tool_calls", []):
            call = calls.setdefault(delta["index"], {"id": delta.get("id"), "type": delta.get("type"),
                                                     "function": {"name": None, "arguments": ""}})
            call["function"]["name"] = call["function"]["name"] or delta["function"].get("name")
            call["function"]["arguments"] += delta["function"].get("arguments", "")
        assert not choice["delta"].get("content")
        finish += [choice["finish_reason"]] if choice["finish_reason"] else []
    assert len(finish) == 1
    return [calls[i] for i in sorted(calls)], finish[0]


def test_a_named_tool_choice_is_called_without_a_parser_as_in_vllm(http, server, healthy_stream):
    # vLLM serves a named tool choice without --tool-call-parser: the output is held to the tool's
    # parameters schema and comes back as the call's arguments. It was a 400 here.
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = http.post("/v1/chat/completions", json=_tool_chat(named)).json()
    [choice] = reply["choices"]
    [call] = choice["message"]["tool_calls"]
    assert choice["message"]["content"] == "" and choice["finish_reason"] == "stop"
    assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])["unit"] in "cf"
    calls, finish = _streamed_calls(http, _tool_chat(named))
    assert finish == "stop" and [c["function"] for c in calls] == [call["function"]]
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["type"] == "function"
    # The openai client reads it as its own tool call.
    client = OpenAI(base_url=f"{server[0]}/v1", api_key="none")
    message = client.chat.completions.create(**_tool_chat(named)).choices[0].message
    assert message.tool_calls[0].function.arguments == call["function"]["arguments"]
    # A tool without parameters takes any JSON object.
    reply = http.post("/v1/chat/completions", json=_tool_chat({"type": "function", "function": {"name": "get_time"}}))
    [call] = reply.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time" and call["function"]["arguments"].startswith("{")


def test_tool_choice_required_calls_the_tools_without_a_parser_as_in_vllm(http, healthy_stream):
    # vLLM holds the output to a JSON array of {"name", "parameters"} calls of the given tools and
    # returns them as tool_calls, finish_reason "tool_calls". It was a 400 here.
    body = _tool_chat("required", parallel_tool_calls=False, tools=[WEATHER, NOW])
    [choice] = http.post("/v1/chat/completions", json=body).json()["choices"]
    [call] = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == ""
    assert call["function"]["name"] in ("get_weather", "now")
    assert isinstance(json.loads(call["function"]["arguments"]), dict)
    calls, finish = _streamed_calls(http, body)
    assert finish == "tool_calls" and [c["function"] for c in calls] == [call["function"]]
    # Cut short, a reply carries the calls that were whole.
    cut = _tool_chat("required", tools=[WEATHER, NOW], max_tokens=45)
    [choice] = http.post("/v1/chat/completions", json=cut).json()["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"]
    assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in choice["message"]["tool_calls"])


@pytest.mark.parametrize("fields,param,says", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_date"}}}, "tool_choice", "does not match"),
    ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice", "name"),
    ({"tool_choice": {"type": "function"}}, "tool_choice", "function"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "tool call"),
    ({"tool_choice": "required", "structured_outputs": {"regex": "a"}}, "structured_outputs", "tool call"),
], ids=["unknown-tool", "no-name", "no-function", "with-response-format", "with-structured-outputs"])
def test_a_tool_choice_that_names_no_tool_or_meets_another_constraint_is_a_400(http, healthy_stream, fields, param,
                                                                             says):
    error = openai_error(http.post("/v1/chat/completions", json=_tool_chat(**fields)), 400, param)
    assert says in error["message"]


def test_a_cache_salt_keeps_prefix_cache_blocks_to_requests_of_the_same_salt(http, healthy_stream):
    # vLLM's cache_salt: a request shares cached prompt blocks only with requests of the same salt, so
    # one user cannot time whether another's prompt was cached. It was ignored here (blocks were
    # shared with everyone), and an empty salt was taken.
    prompt = "Ben and Mia found a tiny red boat by the blue lake near the tall old tree. " * 3

    def hits_of(**fields) -> tuple[int, str]:
        before = http.get("/v1/stats").json()["prefix_cache_hits"]
        reply = http.post("/v1/completions", json=_completion(prompt=prompt, **fields))
        assert reply.status_code == 200, reply.text
        return http.get("/v1/stats").json()["prefix_cache_hits"] - before, reply.json()["choices"][0]["text"]

    first, text = hits_of(cache_salt="user-a")
    assert first == 0                                    # nobody has asked for this prompt yet
    again = hits_of(cache_salt="user-a")
    assert again[0] >= 32 and again[1] == text           # the same salt: its blocks are shared
    assert hits_of(cache_salt="user-b") == (0, text)     # another salt finds none of them
    assert hits_of() == (0, text)                        # nor does a request with no salt
    assert hits_of()[0] >= 32                            # which has its own
    for bad in ("", 5):
        openai_error(http.post("/v1/completions", json=_completion(cache_salt=bad)), 400, "cache_salt")
    chat = http.post("/v1/chat/completions", json=_chat(cache_salt="user-a"))
    assert chat.status_code == 200, chat.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_length_penalty_at_vllms_default_passes_and_another_value_is_refused(http, healthy_stream, path):
    # vLLM's requests carry length_penalty 1.0 by default (it weighs beam search only), and clients
    # that send every field send it; any length_penalty was a 400 here.
    body = _completion() if path == "/v1/completions" else _chat()
    want = http.post(path, json=body).json()["choices"]
    for neutral in (1.0, 1, "1.0"):     # "1.0" as vLLM's model reads it (pydantic's lax mode)
        response = http.post(path, json={**body, "length_penalty": neutral})
        assert response.status_code == 200, response.text
        assert response.json()["choices"] == want
    for bad in (0.5, "0.5", "long"):
        openai_error(http.post(path, json={**body, "length_penalty": bad}), 400, "length_penalty")


@pytest.mark.parametrize("field,value", [("structural_tag", '{"structures": [], "triggers": ["<f>"]}'),
                                         ("guided_whitespace_pattern", "[ ]*"), ("best_of", 3)])
def test_vllm_fields_that_would_change_a_chat_reply_are_refused_not_ignored(http, healthy_stream, field, value):
    # vLLM's chat requests take these (a structural tag constraint, the whitespace of guided JSON, and
    # best_of, which vLLM refuses past n); here a chat completion ignored them without a word.
    openai_error(http.post("/v1/chat/completions", json=_chat(**{field: value})), 400, field)
    openai_error(http.post("/v1/completions", json=_completion(**{field: value})), 400, field)
    assert http.post("/v1/chat/completions", json=_chat(best_of=2, n=2)).status_code == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_body_of_many_messages_leaves_the_event_loop_serving(server, healthy_stream, path):
    # 150,000 small messages (6 MB) took pydantic over a second to read as a request, on the event loop:
    # every stream and /health stood still meanwhile. Read in the preprocessing pool, the loop goes on.
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 7}] * 150_000}).encode()
    done, latencies = threading.Event(), []

    def probe() -> None:
        with httpx.Client(base_url=server[0], timeout=30) as client:
            while not done.is_set():
                start = time.monotonic()
                assert client.get("/health").status_code == 200
                latencies.append(time.monotonic() - start)

    prober = threading.Thread(target=probe)
    prober.start()
    started = time.monotonic()
    try:
        response = httpx.post(f"{server[0]}{path}", content=body, headers={"Content-Type": "application/json"},
                              timeout=120)
    finally:
        took = time.monotonic() - started
        done.set()
        prober.join(60)
    error = openai_error(response, 400, "messages", "prompt_too_long")      # 1.05M characters of text
    assert "1050000" in error["message"]
    # Held against the request's own time, so a busy machine slows both sides alike: a loop held for
    # the reading of the request made one probe wait about as long as the request took.
    assert len(latencies) >= 3 and max(latencies) < took / 2, (took, sorted(latencies)[-5:])


BAD_SCHEMA = {"type": "function", "function": {"name": "broken", "parameters": {"type": "frobnicate"}}}
NEVER = {"type": "function", "function": {"name": "never", "parameters": {
    "type": "object", "properties": {"a": {"type": "string", "pattern": "[^\\s\\S]"}}, "required": ["a"]}}}

LOOP = {"type": "function", "function": {"name": "loop", "parameters": {   # found only where the engine compiles it
    "$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}


@pytest.mark.parametrize("tool", [BAD_SCHEMA, NEVER, LOOP], ids=["invalid", "unsatisfiable", "self-reference"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_forced_call_of_a_tool_whose_schema_cannot_hold_it_is_a_400_naming_the_tool(http, healthy_stream, tool,
                                                                                        stream):
    # A tool's parameters schema that does not compile (or that nothing satisfies) was a 500 from a
    # forced call of it, and the 500 closed the client's connection.
    named = {"type": "function", "function": {"name": tool["function"]["name"]}}
    cases = [(named, [WEATHER, tool], "tools.1.function.parameters")]
    if tool is not LOOP:     # in "required"'s array the loop is found only as the output runs into it
        cases.append(("required", [tool], "tools.0.function.parameters"))   # (beside WEATHER, "required" would call that)
    for choice, tools, param in cases:
        error = openai_error(http.post("/v1/chat/completions",
                                       json=_tool_chat(choice, tools=tools, stream=stream)), 400, param)
        assert "schema" in error["message"]
    assert http.get("/health").status_code == 200


def _with_defs(name: str, unit: list[str]) -> dict:
    """A tool whose parameters refer to their $defs, as pydantic (and openai.pydantic_function_tool) writes them."""
    return {"type": "function", "function": {"name": name, "parameters": {
        "$defs": {"Unit": {"enum": unit}}, "type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}},
        "required": ["unit"], "additionalProperties": False}}}


def test_tool_choice_required_takes_tools_whose_parameters_refer_to_their_defs(http, healthy_stream):
    # Under "required" the tools' schemas sit inside one array schema, where a tool's "#/$defs/..."
    # pointed at nothing: a 400 "Pointer '/$defs/Unit' does not exist". Each tool's parameters are now
    # a schema resource of their own, so two tools may also define one name differently.
    body = _tool_chat("required", tools=[_with_defs("get_weather", ["c", "f"]), NOW], parallel_tool_calls=False)
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    [choice] = reply.json()["choices"]
    [call] = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls"
    assert call["function"]["name"] != "get_weather" or json.loads(call["function"]["arguments"])["unit"] in "cf"
    same = _tool_chat("required", tools=[_with_defs("a", ["c"]), _with_defs("b", ["c"])], max_tokens=2)
    assert http.post("/v1/chat/completions", json=same).status_code == 200
    apart = _tool_chat("required", tools=[_with_defs("a", ["c"]), _with_defs("b", ["f"])])
    reply = http.post("/v1/chat/completions", json=apart)
    assert reply.status_code == 200, reply.text
    for call in reply.json()["choices"][0]["message"]["tool_calls"]:
        assert json.loads(call["function"]["arguments"]) == {"unit": "c" if call["function"]["name"] == "a" else "f"}
