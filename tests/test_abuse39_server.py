"""Server: a stream whose request fails in its own output path (not an API error, not a dead engine)
ends with vLLM's error for that exception (a 500 for this request alone, a 400 for bad input, a 501)
while the engine serves the others (it was labelled engine_dead); vLLM's request fields each honoured as
vLLM honours them or refused with a 400 naming them (several were taken and logged as ignored)."""
from __future__ import annotations

import json

import httpx
import pytest
from core_hooks import install
from test_server_helpers import (  # noqa: F401 (story_streams: the healthy fixture)
    CHAT_TEMPLATE, call_utility, openai_error, running_server, sse_events, story_streams, wait_for,
)

from minillm.server.app import ServerOptions
from minillm.server.errors import EngineDeadError
from minillm.server.protocol import ChatCompletionRequest, CompletionRequest, to_sampling_params, unknown_fields
from minillm.server.serving_responses import ResponsesRequest, chat_body
from minillm.server.serving_chat import ChatJob
from minillm.server.serving_completion import CompletionJob

MODEL = "stories"
VICTIM = "victim"     # the `user` of the request whose output path fails


@pytest.fixture(scope="module")
def server(stories_path):
    """(url, engine): stories260K with the tests' chat template, its engine open to core_hooks' utilities."""
    with running_server(stories_path, max_model_len=256, options=ServerOptions(chat_template=CHAT_TEMPLATE),
                        core_hook=install) as running:
        yield running


def fail_after_first_chunk(monkeypatch, job_class, failure: BaseException) -> None:
    """Make job_class's choices raise `failure` for VICTIM's request once it has sent a chunk."""
    choices_of = job_class._choices

    def failing(self, *args):
        choices = choices_of(self, *args)
        if self.req.user == VICTIM:
            if getattr(self, "has_sent_a_choice", False):
                raise failure
            self.has_sent_a_choice = bool(choices)
        return choices

    monkeypatch.setattr(job_class, "_choices", failing)


def stream_lines(url: str, path: str, body: dict) -> tuple[int, list[str]]:
    with httpx.stream("POST", f"{url}{path}", json={"model": MODEL, **body, "stream": True}, timeout=60) as r:
        return r.status_code, [line for line in r.iter_lines() if line]


REQUESTS = {"completions": ("/v1/completions", {"prompt": "Tom had a red ball"}),
            "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tom had a red ball"}]})}


@pytest.mark.parametrize("failure, status, kind, message, code", [
    (KeyError("injected"), 500, "server_error", "'injected'", None),
    (RuntimeError("injected"), 500, "server_error", "injected", None),
    (AssertionError(), 500, "server_error", "AssertionError", None),
    (ValueError("injected"), 400, "invalid_request_error", "injected", None),
    (NotImplementedError("injected"), 501, "server_error", "injected", None),
    (EngineDeadError("injected"), 500, "server_error", "injected", "engine_dead"),
], ids=["KeyError", "RuntimeError", "empty-AssertionError", "ValueError", "NotImplementedError", "engine-dead"])
@pytest.mark.parametrize("endpoint", REQUESTS)
def test_a_failure_in_one_streams_output_path_is_that_requests_error(server, healthy, monkeypatch, endpoint,
                                                                      failure, status, kind, message, code):
    url, engine = server
    fail_after_first_chunk(monkeypatch, CompletionJob if endpoint == "completions" else ChatJob, failure)
    path, body = REQUESTS[endpoint]
    with healthy.in_flight():     # a greedy stream beside it, held to its solo text when the module ends
        http_status, lines = stream_lines(url, path, {**body, "max_tokens": 40, "ignore_eos": True, "user": VICTIM})
    assert http_status == 200 and lines[-1] == "data: [DONE]"
    events = sse_events(lines)
    assert any(e.get("choices") for e in events[:-1]), "the failure came before the first chunk"
    assert events[-1] == {"error": {"message": message, "type": kind, "param": None, "code": code}}
    # The engine goes on: the request was aborted mid-way, and the next one is answered in full.
    def aborted():
        return [a for a in call_utility(engine, "aborted_requests") if a[0].startswith(events[0]["id"] + "-")]
    [(_, _, _, num_tokens)] = wait_for(aborted, timeout=30)
    assert num_tokens < 40
    monkeypatch.undo()
    again = httpx.post(f"{url}{path}", json={"model": MODEL, **body, "max_tokens": 5, "ignore_eos": True,
                                             "user": VICTIM}, timeout=60)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 5
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200



# ---- vLLM's request fields: each honoured as vLLM honours it, or a 400 naming it ---------------------------

def post(url: str, endpoint: str, body: dict) -> httpx.Response:
    path, base = {**REQUESTS, "responses": ("/v1/responses", {"input": "Tom had a red ball"})}[endpoint]
    limit = {"max_output_tokens": 3} if endpoint == "responses" else {"max_tokens": 3}
    return httpx.post(f"{url}{path}", json={"model": MODEL, **base, **limit, **body}, timeout=60)


def test_vllm_xargs_reach_the_engine_as_extra_args():
    # vllm_xargs was an unknown field: logged as ignored, its data never reached SamplingParams.extra_args.
    xargs = {"tag": "a", "weight": 0.5, "ids": [1, "two"]}
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "vllm_xargs": xargs})
    assert to_sampling_params(chat, 4, None).extra_args == xargs and unknown_fields(chat) == []
    completion = CompletionRequest.model_validate({"prompt": "x", "vllm_xargs": {"tag": "a", "n": 2}})
    assert to_sampling_params(completion, 4, None).extra_args == {"tag": "a", "n": 2}
    assert chat_body(ResponsesRequest.model_validate({"input": "x", "vllm_xargs": xargs}))["vllm_xargs"] == xargs


@pytest.mark.parametrize("value, param", [
    ("x", "vllm_xargs"), ({"a": {"b": 1}}, "vllm_xargs.a"), ({"kv_transfer_params": "x"}, "vllm_xargs"),
], ids=["string", "object-value", "connector-key"])
@pytest.mark.parametrize("endpoint", ["completions", "chat", "responses"])
def test_vllm_xargs_of_another_shape_is_a_400_naming_it(server, endpoint, value, param):
    # Each was a 200 with the field logged as ignored; the connector's key would have reached the
    # KV connector unchecked.
    openai_error(post(server[0], endpoint, {"vllm_xargs": value}), 400, param)
    assert post(server[0], endpoint, {"vllm_xargs": {"a": 1}}).status_code == 200
    # vLLM's completions take strings and numbers only; its chat completions lists of them too
    lists = post(server[0], endpoint, {"vllm_xargs": {"a": [1, "b"]}})
    if endpoint == "completions":
        openai_error(lists, 400, "vllm_xargs.a")
    else:
        assert lists.status_code == 200


@pytest.mark.parametrize("endpoint, field, value", [
    ("chat", "mm_processor_kwargs", "x"), ("responses", "mm_processor_kwargs", [1]),
    ("responses", "media_io_kwargs", "x"), ("responses", "previous_input_messages", {"role": "user"}),
    ("responses", "prompt_cache_key", 5), ("responses", "max_tool_calls", "many"),
    ("responses", "service_tier", "bogus"), ("responses", "service_tier", 5),
    ("responses", "kv_transfer_params", {"do_remote_decode": True}), ("responses", "enable_response_messages", "x"),
])
def test_a_vllm_field_of_the_wrong_type_or_value_is_a_400_naming_it(server, endpoint, field, value):
    # Each was taken (logged as ignored) where vLLM's request model refuses it; kv_transfer_params
    # was dropped on /v1/responses, which has no KV transfer.
    openai_error(post(server[0], endpoint, {field: value}), 400, field)


def test_a_responses_reply_echoes_service_tier_max_tool_calls_and_background_as_vllms(server):
    body = post(server[0], "responses", {"service_tier": "flex", "max_tool_calls": "2", "prompt_cache_key": "k",
                                         "mm_processor_kwargs": {}}).json()
    assert (body["service_tier"], body["max_tool_calls"], body["background"]) == ("flex", 2, False)
    plain = post(server[0], "responses", {}).json()
    assert (plain["service_tier"], plain["max_tool_calls"]) == ("auto", None)
    assert "input_messages" not in plain and "output_messages" not in plain


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_enable_response_messages_returns_the_raw_prompt_and_output(server, stream):
    # vLLM's enable_response_messages: the rendered prompt and the output as text and token ids; it was
    # logged as ignored.
    url, engine = server
    body = {"temperature": 0, "enable_response_messages": True}
    if stream:
        with httpx.stream("POST", f"{url}/v1/responses", timeout=60, json={
                "model": MODEL, "input": "Tom had a red ball", "max_output_tokens": 3, **body, "stream": True}) as r:
            events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
        assert "input_messages" not in events[0]["response"]        # response.created: nothing generated yet
        reply = events[-1]["response"]
    else:
        reply = post(url, "responses", body).json()
    [prompt], [output] = reply["input_messages"], reply["output_messages"]
    assert prompt["type"] == output["type"] == "raw_message_tokens"
    assert len(prompt["tokens"]) == reply["usage"]["input_tokens"] and prompt["message"].endswith("assistant:")
    assert prompt["tokens"] == engine.tokenizer.encode(prompt["message"], add_special_tokens=False)
    assert len(output["tokens"]) == reply["usage"]["output_tokens"] == 3
    assert output["message"] == reply["output"][0]["content"][0]["text"]
