"""Every reply of the server read by the official SDKs' own types in strict mode (openai's pydantic models
for chat, completions, responses and models; anthropic's for messages), and the fields they do not
declare held to the ones vLLM or the real APIs send."""
from __future__ import annotations

import json

import anthropic.types as anthropic_types
import httpx
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter
from test_server_helpers import chat_model_dir, openai_error, running_server

MESSAGES = [{"role": "user", "content": "hi"}]
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}]
RESPONSE_TOOLS = [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}]

# Fields past the SDK's types: vLLM's (stop_reason, prompt_logprobs, token_ids, prompt_token_ids, prompt_text,
# kv_transfer_params, ec_transfer_params, metrics and routed_experts, null where not asked; a text completion's
# service_tier, null; a chat message's reasoning, null without a reasoning parser; a model card's root, parent,
# max_model_len and permission) and the Responses API's store, which OpenAI sends and its SDK omits.
VLLM_FIELDS = {"stop_reason", "prompt_logprobs", "token_ids", "prompt_token_ids", "prompt_text", "kv_transfer_params",
               "ec_transfer_params", "metrics", "routed_experts", "service_tier", "reasoning", "root", "parent",
               "max_model_len", "permission", "store"}


@pytest.fixture(scope="module")
def url(stories_path, tmp_path_factory):
    """A server of stories260K with a chat template, on the CPU."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    with running_server(model, max_model_len=256, max_logprobs=5) as running:
        yield running[0]


def undeclared(value, path: str = "$") -> list[str]:
    """The paths of the fields a validated SDK object holds that its types do not declare."""
    if isinstance(value, BaseModel):
        found = [f"{path}.{key}" for key in value.model_extra or {}]
        return found + [p for name in type(value).model_fields for p in undeclared(getattr(value, name), f"{path}.{name}")]
    if isinstance(value, (list, tuple)):
        return [p for i, item in enumerate(value) for p in undeclared(item, f"{path}[{i}]")]
    if isinstance(value, dict):
        return [p for key, item in value.items() for p in undeclared(item, f"{path}.{key}")]
    return []


def strict(sdk_type, obj: dict):
    """obj read by an SDK type (a model or a TypeAdapter) in strict mode, with no field past the
    SDK's but vLLM's own."""
    if isinstance(sdk_type, TypeAdapter):
        value = sdk_type.validate_python(obj, strict=True)
    else:
        value = sdk_type.model_validate(obj, strict=True)
    extra = [p for p in undeclared(value) if p.rsplit(".", 1)[-1] not in VLLM_FIELDS]
    assert not extra, (extra, obj)
    return value


def post(url: str, path: str, body: dict) -> dict:
    reply = httpx.post(f"{url}{path}", json={"model": "stories", **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def stream(url: str, path: str, body: dict) -> list[tuple[str | None, dict]]:
    """(event name, data) of each server-sent event of a stream, checked to end as its API ends it."""
    events, name, done = [], None, False
    with httpx.stream("POST", f"{url}{path}", json={"model": "stories", **body, "stream": True}, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                assert not done, "an event after [DONE]"
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    continue
                events.append((name, json.loads(data)))
                name = None
    assert done == path.endswith("completions"), "[DONE] ends OpenAI's chat and completions streams, only those"
    return events


# ---- the Responses API ------------------------------------------------------------------------------------------

RESPONSE_BODIES = {
    "text": {"input": "hi", "max_output_tokens": 4},
    "logprobs": {"input": "hi", "max_output_tokens": 3, "include": ["message.output_text.logprobs"], "top_logprobs": 2},
    "named-tool": {"input": "hi", "max_output_tokens": 12, "tools": RESPONSE_TOOLS,
                   "tool_choice": {"type": "function", "name": "get_weather"}},
}


@pytest.mark.parametrize("body", RESPONSE_BODIES.values(), ids=RESPONSE_BODIES.keys())
def test_a_response_is_openais_response(url, body):
    # usage.input_tokens_details had no cache_write_tokens, which the SDK's InputTokensDetails requires.
    response = strict(Response, post(url, "/v1/responses", body))
    assert response.usage.input_tokens_details.cache_write_tokens == 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


@pytest.mark.parametrize("body", RESPONSE_BODIES.values(), ids=RESPONSE_BODIES.keys())
def test_every_event_of_a_response_stream_is_openais_event(url, body):
    events = stream(url, "/v1/responses", body)
    adapter = TypeAdapter(ResponseStreamEvent)
    for name, data in events:
        assert name == data["type"]
        strict(adapter, data)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    last = strict(adapter, events[-1][1])
    assert last.type in ("response.completed", "response.incomplete")
    assert last.response.usage.input_tokens_details.cache_write_tokens == 0


# ---- chat completions -------------------------------------------------------------------------------------------

CHAT_BODIES = {
    "text": {"messages": MESSAGES, "max_tokens": 4},
    "logprobs": {"messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": 2},
    "n2": {"messages": MESSAGES, "max_tokens": 3, "n": 2},
    "named-tool": {"messages": MESSAGES, "max_tokens": 12, "tools": CHAT_TOOLS,
                   "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
}


@pytest.mark.parametrize("body", CHAT_BODIES.values(), ids=CHAT_BODIES.keys())
def test_a_chat_completion_is_openais(url, body):
    completion = strict(ChatCompletion, post(url, "/v1/chat/completions", body))
    assert [choice.index for choice in completion.choices] == list(range(body.get("n", 1)))
    for choice in completion.choices:
        for row in (choice.logprobs.content if choice.logprobs else None) or []:
            assert bytes(row.bytes).decode("utf-8", "replace") == row.token
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens


@pytest.mark.parametrize("body", CHAT_BODIES.values(), ids=CHAT_BODIES.keys())
def test_every_chat_chunk_is_openais(url, body):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = [strict(ChatCompletionChunk, data) for _, data in
              stream(url, "/v1/chat/completions", {**body, "stream_options": options})]
    assert len({(c.id, c.created, c.model) for c in chunks}) == 1
    *choice_chunks, last = chunks
    assert last.choices == [] and last.usage is not None
    seen_calls: set[tuple[int, int]] = set()
    for chunk in choice_chunks:
        assert len(chunk.choices) == 1 and chunk.usage is not None
        for call in chunk.choices[0].delta.tool_calls or []:
            first = (chunk.choices[0].index, call.index) not in seen_calls
            seen_calls.add((chunk.choices[0].index, call.index))
            # id, type and name in a call's first delta only, as OpenAI and vLLM stream them
            assert (call.id is not None, call.type is not None, call.function.name is not None) == (first,) * 3
    finished = [c.choices[0] for c in choice_chunks if c.choices[0].finish_reason is not None]
    assert sorted(choice.index for choice in finished) == list(range(body.get("n", 1)))


# ---- completions ------------------------------------------------------------------------------------------------

COMPLETION_BODIES = {
    "text": {"prompt": "Once", "max_tokens": 4},
    "logprobs": {"prompt": "Once", "max_tokens": 3, "logprobs": 2},
    "two-prompts-n2": {"prompt": ["Once", "Lily"], "max_tokens": 3, "n": 2, "logprobs": 1},
}


@pytest.mark.parametrize("body", COMPLETION_BODIES.values(), ids=COMPLETION_BODIES.keys())
def test_a_completion_is_openais(url, body):
    completion = strict(Completion, post(url, "/v1/completions", body))
    num_prompts = len(body["prompt"]) if isinstance(body["prompt"], list) else 1
    assert [choice.index for choice in completion.choices] == list(range(num_prompts * body.get("n", 1)))


@pytest.mark.parametrize("body", COMPLETION_BODIES.values(), ids=COMPLETION_BODIES.keys())
def test_every_completion_chunk_is_openais(url, body):
    # The SDK reads a stream's chunks as Completion, whose finish_reason admits no null: OpenAI's legacy
    # stream (and vLLM's) sends null before the end; such a chunk is read here with the null set aside.
    chunks = [data for _, data in stream(url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})]
    *choice_chunks, last = chunks
    strict(Completion, last)
    assert last["choices"] == [] and last["usage"]["total_tokens"] > 0
    for chunk in choice_chunks:
        (choice,) = chunk["choices"]
        strict(Completion, {**chunk, "choices": [{**choice, "finish_reason": choice["finish_reason"] or "stop"}]})
        assert chunk["usage"] is None


# ---- Anthropic's messages ---------------------------------------------------------------------------------------

MESSAGE_BODIES = {
    "text": {"messages": MESSAGES, "max_tokens": 4},
    "named-tool": {"messages": MESSAGES, "max_tokens": 12, "tools": [{"name": "get_weather", "input_schema": PARAMETERS}],
                   "tool_choice": {"type": "tool", "name": "get_weather"}},
}


@pytest.mark.parametrize("body", MESSAGE_BODIES.values(), ids=MESSAGE_BODIES.keys())
def test_a_message_is_anthropics(url, body):
    strict(anthropic_types.Message, post(url, "/v1/messages", body))


@pytest.mark.parametrize("body", MESSAGE_BODIES.values(), ids=MESSAGE_BODIES.keys())
def test_every_message_event_is_anthropics(url, body):
    adapter = TypeAdapter(anthropic_types.RawMessageStreamEvent)
    events = stream(url, "/v1/messages", body)
    for name, data in events:
        assert name == data["type"]
        if name != "ping":     # Anthropic sends pings; its SDK's stream skips them, its event union omits them
            strict(adapter, data)
    assert [name for name, _ in events][-2:] == ["message_delta", "message_stop"]


def test_count_tokens_is_anthropics(url):
    strict(anthropic_types.MessageTokensCount, post(url, "/v1/messages/count_tokens", {"messages": MESSAGES}))


# ---- models and errors ------------------------------------------------------------------------------------------

def test_models_are_openais(url):
    listed = httpx.get(f"{url}/v1/models", timeout=10).json()
    assert listed["object"] == "list"
    for card in listed["data"]:
        strict(Model, card)
    strict(Model, httpx.get(f"{url}/v1/models/stories", timeout=10).json())


BAD_REQUESTS = {
    "chat": ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -1}, "temperature"),
    "completions": ("/v1/completions", {"prompt": "x", "max_tokens": "a"}, "max_tokens"),
    "responses": ("/v1/responses", {"input": 5}, "input"),
    "tokenize": ("/tokenize", {}, "prompt"),
    "detokenize": ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
}


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_a_400_is_openais_error(url, path, body, param):
    reply = httpx.post(f"{url}{path}", json={"model": "stories", **body}, timeout=10)
    assert set(reply.json()) == {"error"}
    openai_error(reply, 400, param)


def test_a_messages_400_is_anthropics_error(url):
    reply = httpx.post(f"{url}/v1/messages", json={"model": "stories", "messages": MESSAGES}, timeout=10)
    assert reply.status_code == 400
    error = anthropic_types.ErrorResponse.model_validate(reply.json(), strict=True)
    assert error.error.type == "invalid_request_error" and "max_tokens" in error.error.message
