"""The official SDKs' higher-level helpers against minillm serve: openai's parse and stream helpers (chat,
responses), pydantic_function_tool, raw and streaming responses with X-Request-Id, models pages and the async
client; anthropic's messages stream and count_tokens. Each helper's accumulated result equals the plain reply."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Literal

import pytest
from pydantic import BaseModel

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from test_server_helpers import chat_model_dir, running_server  # noqa: E402

from minillm.server.app import ServerOptions  # noqa: E402

MODEL = "stories"
MESSAGES = [{"role": "user", "content": "hi"}]


class Answer(BaseModel):
    answer: Literal["yes", "no"]


class Pick(BaseModel):
    color: Literal["red", "blue"]


@pytest.fixture(scope="module")
def url(stories_path, tmp_path_factory):
    """One server of stories260K on the CPU, with vLLM's --enable-request-id-headers."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    options = dataclasses.replace(ServerOptions(), request_id_headers=True)
    with running_server(model, options=options, max_model_len=256, max_logprobs=5) as running:
        yield running[0]


@pytest.fixture(scope="module")
def client(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def final_chat(client, **kwargs):
    """(event types, final completion) of client.chat.completions.stream."""
    with client.chat.completions.stream(model=MODEL, messages=MESSAGES, **kwargs) as stream:
        types = [event.type for event in stream]
        return types, stream.get_final_completion()


def comparable(completion) -> list[tuple]:
    """Per choice what a streamed and a whole chat completion share."""
    return [(c.index, c.finish_reason, c.message.content, c.message.parsed,
             [(t.function.name, t.function.arguments, t.function.parsed_arguments) for t in c.message.tool_calls or []],
             c.logprobs.model_dump() if c.logprobs else None) for c in completion.choices]


# ---- chat: parse and stream ---------------------------------------------------------------------------------

def test_parse_fills_parsed_and_no_refusal_for_each_choice(client):
    reply = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Answer, max_tokens=60,
                                          n=2, temperature=1, seed=3)
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and choice.message.refusal is None
        assert isinstance(choice.message.parsed, Answer)
        assert Answer.model_validate_json(choice.message.content) == choice.message.parsed


def test_parse_cut_by_max_tokens_raises_the_sdks_length_error(client):
    with pytest.raises(openai.LengthFinishReasonError) as raised:
        client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Answer, max_tokens=3)
    assert raised.value.completion.usage.completion_tokens == 3


@pytest.mark.parametrize("extra", [
    {"response_format": Answer, "logprobs": True, "top_logprobs": 2},
    {"stop": ["."], "n": 2, "logprobs": True},
    {"tools": [openai.pydantic_function_tool(Pick)], "tool_choice": {"type": "function", "function": {"name": "Pick"}}},
    {"tools": [openai.pydantic_function_tool(Pick), openai.pydantic_function_tool(Answer)], "tool_choice": "required",
     "parallel_tool_calls": False},
], ids=["response_format", "n2-logprobs", "named-tool", "required-tool"])
def test_chat_stream_helper_accumulates_the_whole_reply(client, extra):
    body = {"max_tokens": 200, "temperature": 0, **extra}
    whole = client.chat.completions.parse(model=MODEL, messages=MESSAGES, **body)
    types, final = final_chat(client, stream_options={"include_usage": True}, **body)
    assert comparable(final) == comparable(whole)
    assert final.usage.completion_tokens == whole.usage.completion_tokens
    assert types[0] == "chunk"
    if "tools" in extra:       # a call whose first delta shares the finishing chunk gets no done event from the SDK
        assert all(isinstance(c.message.tool_calls[0].function.parsed_arguments, BaseModel) for c in final.choices)
    else:
        assert types.count("content.done") == len(whole.choices)


def test_chat_stream_helper_hands_parsed_on_content_done(client):
    with client.chat.completions.stream(model=MODEL, messages=MESSAGES, response_format=Answer, max_tokens=60) as s:
        done = [event for event in s if event.type == "content.done"]
        final = s.get_final_completion()
    assert [event.parsed for event in done] == [final.choices[0].message.parsed]
    assert isinstance(done[0].parsed, Answer)


def test_beta_chat_stream_matches_chat_stream(client):
    if not hasattr(client.beta, "chat"):
        pytest.skip("this openai SDK has no client.beta.chat")
    body = {"max_tokens": 60, "response_format": Answer, "temperature": 0}
    with client.beta.chat.completions.stream(model=MODEL, messages=MESSAGES, **body) as stream:
        list(stream)
        beta = stream.get_final_completion()
    assert comparable(beta) == comparable(final_chat(client, **body)[1])


# ---- responses ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [
    {"text_format": Answer},
    {"text_format": Answer, "include": ["message.output_text.logprobs"], "top_logprobs": 2},
    {"tools": [openai.pydantic_function_tool(Pick)], "tool_choice": "required", "parallel_tool_calls": False},
], ids=["text_format", "logprobs", "tool"])
def test_responses_stream_helper_equals_parse(client, extra):
    body = {"input": "hi", "max_output_tokens": 60, "temperature": 0, **extra}
    whole = client.responses.parse(model=MODEL, **body)
    with client.responses.stream(model=MODEL, **body) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert final.status == whole.status == "completed"
    assert final.output_parsed == whole.output_parsed
    strip = {"id", "call_id"}
    assert [o.model_dump(exclude=strip) for o in final.output] == [o.model_dump(exclude=strip) for o in whole.output]
    if "tools" in extra:
        assert isinstance(final.output[0].parsed_arguments, Pick)
    else:
        assert isinstance(final.output_parsed, Answer)


def test_responses_create_streamed_text_equals_whole(client):
    body = {"input": "hi", "max_output_tokens": 8, "temperature": 0}
    whole = client.responses.create(model=MODEL, **body)
    events = list(client.responses.create(model=MODEL, stream=True, **body))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text


# ---- completions --------------------------------------------------------------------------------------------

def test_completions_stream_with_n_and_logprobs_joins_to_the_whole_reply(client):
    body = {"prompt": ["Once upon", "The dog"], "max_tokens": 5, "n": 2, "logprobs": 2, "temperature": 0}
    whole = client.completions.create(model=MODEL, **body)
    chunks = list(client.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **body))
    texts, tokens = {}, {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert texts == {c.index: c.text for c in whole.choices}
    assert tokens == {c.index: c.logprobs.tokens for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 20


# ---- raw responses, request ids and models ------------------------------------------------------------------

def test_raw_and_streaming_responses_carry_the_request_id(client):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                                           extra_headers={"X-Request-Id": "abc123"})
    assert raw.request_id == raw.headers["x-request-id"] == "abc123"
    assert raw.parse().id == "chatcmpl-abc123"
    with client.chat.completions.with_streaming_response.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                                                stream=True) as response:
        assert response.headers["x-request-id"] and response.request_id == response.headers["x-request-id"]
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = list(response.parse())
    assert chunks[-1].choices[0].finish_reason == "length"


def test_models_list_is_one_page(client):
    page = client.models.list()
    assert [m.id for m in page] == [MODEL] and not page.has_next_page()
    assert [m.id for p in page.iter_pages() for m in p.data] == [MODEL]
    raw = client.models.with_raw_response.list()
    assert raw.request_id and [m.id for m in raw.parse()] == [MODEL]


# ---- the async client ---------------------------------------------------------------------------------------

def test_async_client_streams_like_the_sync_one(url, client):
    async def run():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as ac:
            async with ac.chat.completions.stream(model=MODEL, messages=MESSAGES, response_format=Answer,
                                                  max_tokens=60, temperature=0) as stream:
                [_ async for _ in stream]
                chat = await stream.get_final_completion()
            async with ac.responses.stream(model=MODEL, input="hi", text_format=Answer, max_output_tokens=60,
                                           temperature=0) as stream:
                [_ async for _ in stream]
                response = await stream.get_final_response()
            completion = [c async for c in await ac.completions.create(
                model=MODEL, prompt="Once", max_tokens=4, n=2, logprobs=1, temperature=0, stream=True)]
            models = [m.id async for m in await ac.models.list()]
            return chat, response, completion, models

    chat, response, completion, models = asyncio.run(run())
    assert comparable(chat) == comparable(final_chat(client, response_format=Answer, max_tokens=60, temperature=0)[1])
    assert response.output_parsed == client.responses.parse(model=MODEL, input="hi", text_format=Answer,
                                                            max_output_tokens=60, temperature=0).output_parsed
    texts = {}
    for chunk in completion:
        texts[chunk.choices[0].index] = texts.get(chunk.choices[0].index, "") + chunk.choices[0].text
    whole = client.completions.create(model=MODEL, prompt="Once", max_tokens=4, n=2, temperature=0)
    assert texts == {c.index: c.text for c in whole.choices}
    assert models == [MODEL]


# ---- anthropic ----------------------------------------------------------------------------------------------

def test_anthropic_stream_helper_equals_create_and_count_tokens(url):
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    tool = {"name": "Pick", "input_schema": openai.pydantic_function_tool(Pick)["function"]["parameters"]}
    for body in ({"max_tokens": 12, "system": "be kind"},
                 {"max_tokens": 60, "tools": [tool], "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}):
        body = {"model": MODEL, "messages": MESSAGES, "extra_body": {"temperature": 0}, **body}
        whole = client.messages.create(**body)
        with client.messages.stream(**body) as stream:
            types = [event.type for event in stream]
            final = stream.get_final_message()
        assert types[0] == "message_start" and types[-1] == "message_stop"
        strip = {"id"}
        assert [b.model_dump(exclude=strip) for b in final.content] == [b.model_dump(exclude=strip) for b in whole.content]
        assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
        counted = client.messages.count_tokens(**{k: v for k, v in body.items() if k not in ("max_tokens", "extra_body")})
        assert counted.input_tokens == whole.usage.input_tokens
