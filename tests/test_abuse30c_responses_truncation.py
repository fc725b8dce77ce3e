"""POST /v1/responses with truncation "auto": the earliest input items are dropped (instructions and system
items kept) until the prompt and max_output_tokens fit the context, as OpenAI's API does; "disabled" leaves a
prompt past the context a 400."""
from __future__ import annotations

import httpx
import openai
import pytest
from test_server_helpers import chat_model_dir, openai_error, running_server

MAX_MODEL_LEN = 256
INSTRUCTIONS = "Tell a story."
# Sixteen turns of about 22 tokens each: past the 256-token context together.
CONVERSATION = [{"role": "user" if i % 2 == 0 else "assistant",
                 "content": f"Day {i}: Lily saw a big dog in the park and she was happy."} for i in range(16)]


@pytest.fixture(scope="module")
def url(stories_path, tmp_path_factory):
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    with running_server(model, max_model_len=MAX_MODEL_LEN) as (base_url, _):
        yield base_url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def respond(url: str, items: list[dict], truncation: str | None, max_output_tokens: int = 16) -> httpx.Response:
    body = {"model": "stories", "input": items, "instructions": INSTRUCTIONS, "temperature": 0,
            "max_output_tokens": max_output_tokens}
    if truncation is not None:
        body["truncation"] = truncation
    return httpx.post(f"{url}/v1/responses", json=body, timeout=60)


def test_truncation_auto_drops_the_earliest_items_until_the_rest_fits(url):
    # truncation "auto" was a 400 naming truncation; OpenAI drops input items from the start of the conversation.
    assert respond(url, CONVERSATION, None).status_code == 400
    reply = client(url).responses.create(model="stories", input=CONVERSATION, instructions=INSTRUCTIONS,
                                         temperature=0, max_output_tokens=16, truncation="auto")
    assert reply.truncation == "auto" and reply.status == "incomplete"
    assert reply.usage.input_tokens + 16 <= MAX_MODEL_LEN
    # It is the reply to the longest tail of the items that fits, the instructions kept.
    fitting = [k for k in range(1, len(CONVERSATION)) if respond(url, CONVERSATION[-k:], "disabled").status_code == 200]
    kept = CONVERSATION[-max(fitting):]
    same = respond(url, kept, "disabled").json()
    assert same["usage"]["input_tokens"] == reply.usage.input_tokens and same["output"][0]["content"][0]["text"] == (
        reply.output_text)
    assert respond(url, CONVERSATION[-max(fitting) - 1:], "disabled").status_code == 400


def test_truncation_auto_streams_the_reply_to_the_kept_items(url):
    whole = client(url).responses.create(model="stories", input=CONVERSATION, instructions=INSTRUCTIONS,
                                         temperature=0, max_output_tokens=16, truncation="auto")
    events = list(client(url).responses.create(model="stories", input=CONVERSATION, instructions=INSTRUCTIONS,
                                               temperature=0, max_output_tokens=16, truncation="auto", stream=True))
    final = events[-1].response
    assert (final.truncation, final.output_text, final.usage.input_tokens) == (
        "auto", whole.output_text, whole.usage.input_tokens)


def test_truncation_auto_keeps_a_conversation_that_fits_whole(url):
    items = CONVERSATION[:3]
    auto = respond(url, items, "auto").json()
    disabled = respond(url, items, "disabled").json()
    assert auto["usage"]["input_tokens"] == disabled["usage"]["input_tokens"]
    assert auto["output"][0]["content"] == disabled["output"][0]["content"]
    assert (auto["truncation"], disabled["truncation"]) == ("auto", "disabled")


def test_truncation_auto_keeps_system_messages_among_the_items(url):
    # A system (or developer) item is kept with the instructions; only the conversation's turns are dropped.
    system = {"role": "developer", "content": "Be kind."}
    with_system = respond(url, [CONVERSATION[0], system, *CONVERSATION[1:]], "auto").json()
    num_kept = max(k for k in range(1, 16) if respond(url, [system, *CONVERSATION[-k:]], "disabled").status_code == 200)
    same = respond(url, [system, *CONVERSATION[-num_kept:]], "disabled").json()
    assert num_kept < 15 and same["usage"]["input_tokens"] == with_system["usage"]["input_tokens"]
    assert same["output"][0]["content"] == with_system["output"][0]["content"]


def test_truncation_auto_with_a_last_item_too_long_is_a_400_naming_input(url):
    long_item = {"role": "user", "content": " ".join(["Lily saw a big dog."] * 40)}
    response = respond(url, [*CONVERSATION[:3], long_item], "auto")
    error = openai_error(response, 400, "input", "context_length_exceeded")
    assert str(MAX_MODEL_LEN) in error["message"]
    # So is a last item that fits alone, but not with max_output_tokens.
    response = respond(url, [*CONVERSATION, CONVERSATION[0]], "auto", max_output_tokens=MAX_MODEL_LEN - 10)
    openai_error(response, 400, "input", "context_length_exceeded")


def test_truncation_auto_never_starts_with_an_orphan_function_call_output(url):
    # A function call's output is dropped with its call: the kept items never begin with a call's result.
    call, output = ({"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "call_1", "output": "sunny " * 45})
    last = CONVERSATION[0]
    assert respond(url, [output, last], "disabled").status_code == 200      # the output would fit...
    assert respond(url, [call, output, last], "disabled").status_code == 400    # ...but not with its call
    reply = respond(url, [*CONVERSATION[:6], call, output, last], "auto").json()
    alone = respond(url, [last], "disabled").json()
    assert reply["usage"]["input_tokens"] == alone["usage"]["input_tokens"]
    assert reply["output"][0]["content"] == alone["output"][0]["content"]


@pytest.mark.parametrize("value", ["bogus", "AUTO", ""])
def test_truncation_other_than_auto_or_disabled_is_a_400_naming_it(url, value):
    openai_error(respond(url, CONVERSATION[:1], value), 400, "truncation")


