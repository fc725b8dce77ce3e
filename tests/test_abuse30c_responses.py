"""POST /v1/responses through the openai SDK: include ["message.output_text.logprobs"] (each output_text's
logprobs, and each streamed delta's, the same as chat completions' for the same request), and truncation
"auto" (the earliest input items dropped, instructions and system items kept, until the prompt and
max_output_tokens fit the context, as OpenAI's API does; "disabled" leaves a prompt past the context a 400)."""
from __future__ import annotations

import httpx
import openai
import pytest
from test_server_helpers import chat_model_dir, openai_error, running_server

from minillm.server.protocol import unknown_fields
from minillm.server.serving_responses import CHAT_EXTRAS, ResponsesRequest, chat_body

STORY = "Tom had a red ball."
LOGPROBS = ["message.output_text.logprobs"]
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def url(stories_path, tmp_path_factory):
    """The base URL of a server of stories260K with a chat template, on the CPU."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    with running_server(model, max_model_len=MAX_MODEL_LEN) as (base_url, _):
        yield base_url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def chat_rows(url: str, top: int, **request) -> list[dict]:
    """Chat completions' logprobs content for the greedy reply to STORY, as JSON data."""
    reply = client(url).chat.completions.create(model="stories", messages=[{"role": "user", "content": STORY}],
                                                temperature=0, logprobs=True, top_logprobs=top, **request)
    return [row.model_dump() for row in reply.choices[0].logprobs.content]


def same_rows(rows: list[dict], expected: list[dict]) -> bool:
    """Whether rows are expected's, logprobs within float noise (a prompt served from the prefix cache is
    computed in other blocks)."""
    def values(rows):
        return [r["logprob"] for r in rows] + [t["logprob"] for r in rows for t in r["top_logprobs"]]

    def names(rows):
        return [{**r, "logprob": 0, "top_logprobs": [{**t, "logprob": 0} for t in r["top_logprobs"]]} for r in rows]

    return names(rows) == names(expected) and values(rows) == pytest.approx(values(expected), abs=1e-4)


def without_bytes(rows: list[dict]) -> list[dict]:
    """Rows in the shape of a streamed event's logprobs (OpenAI's ResponseTextDeltaEvent has no bytes)."""
    return [{"token": r["token"], "logprob": r["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in r["top_logprobs"]]}
            for r in rows]


# ---- include ["message.output_text.logprobs"] --------------------------------------------------------------

@pytest.mark.parametrize("top", [0, 3, 20])
def test_output_text_logprobs_are_chat_completions_logprobs(url, top):
    # include ["message.output_text.logprobs"] was a 400 naming include; OpenAI and vLLM serve it.
    reply = client(url).responses.create(model="stories", input=STORY, temperature=0, max_output_tokens=8,
                                         include=LOGPROBS, top_logprobs=top)
    [part] = reply.output[0].content
    rows = [row.model_dump() for row in part.logprobs]
    assert same_rows(rows, chat_rows(url, top, max_completion_tokens=8))
    assert len(rows) == reply.usage.output_tokens == 8
    assert all(len(row["top_logprobs"]) == top for row in rows)
    assert "".join(row["token"] for row in rows) == part.text


def test_without_top_logprobs_each_token_has_its_own_logprob_only(url):
    # vLLM's top_logprobs defaults to 0: the chosen tokens' logprobs, no alternatives.
    reply = client(url).responses.create(model="stories", input=STORY, temperature=0, max_output_tokens=4,
                                         include=LOGPROBS)
    rows = [row.model_dump() for row in reply.output[0].content[0].logprobs]
    assert same_rows(rows, chat_rows(url, 0, max_completion_tokens=4)) and all(r["logprob"] <= 0 for r in rows)


def test_without_include_output_text_has_no_logprobs(url):
    reply = client(url).responses.create(model="stories", input=STORY, temperature=0, max_output_tokens=4,
                                         top_logprobs=5)
    assert reply.output[0].content[0].logprobs == [] and reply.top_logprobs == 5


def streamed(url: str, **request) -> list:
    return list(client(url).responses.create(model="stories", input=STORY, temperature=0, include=LOGPROBS,
                                             stream=True, **request))


@pytest.mark.parametrize("request_fields", [{"max_output_tokens": 8}, {"extra_body": {"stop": ["."]}}],
                         ids=["cut", "stop-string"])
def test_streamed_deltas_carry_the_logprobs_of_their_tokens(url, request_fields):
    # The deltas' logprobs, in order, are the whole reply's: the stop string's token, whose text never comes,
    # has its logprob in a last delta of no text before output_text.done (or with the last text, where one
    # output of the engine brought both). The done events and the final response carry them all.
    whole = client(url).responses.create(model="stories", input=STORY, temperature=0, include=LOGPROBS,
                                         top_logprobs=2, **request_fields)
    rows = [row.model_dump() for row in whole.output[0].content[0].logprobs]
    chat_fields = {"max_completion_tokens": 8} if "max_output_tokens" in request_fields else request_fields
    assert same_rows(rows, chat_rows(url, 2, **chat_fields))
    events = streamed(url, top_logprobs=2, **request_fields)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == whole.output_text
    streamed_rows = [lp.model_dump() for e in deltas for lp in e.logprobs]
    assert same_rows(streamed_rows, without_bytes(rows))
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.model_dump() for lp in done.logprobs] == streamed_rows
    [part_done] = [e for e in events if e.type == "response.content_part.done"]
    final = events[-1].response
    assert [lp.model_dump() for lp in part_done.part.logprobs] == [
        lp.model_dump() for lp in final.output[0].content[0].logprobs]
    assert same_rows(without_bytes([lp.model_dump() for lp in part_done.part.logprobs]), streamed_rows)
    assert same_rows([lp.model_dump() for lp in part_done.part.logprobs], rows)
    assert events.index(done) > events.index(deltas[-1])


def test_the_sdk_stream_helper_final_response_has_the_logprobs(url):
    c = client(url)
    # (its final response is response.completed's: a reply that stopped)
    request = dict(model="stories", input=STORY, temperature=0, include=LOGPROBS, top_logprobs=1,
                   extra_body={"stop": ["."]})
    with c.responses.stream(**request) as stream:
        final = stream.get_final_response()
    whole = c.responses.create(**request)
    rows = [lp.model_dump() for lp in final.output[0].content[0].logprobs]
    assert rows and same_rows(rows, [lp.model_dump() for lp in whole.output[0].content[0].logprobs])
    assert len(rows) == final.usage.output_tokens


def test_a_stream_without_include_sends_no_logprobs(url):
    events = list(client(url).responses.create(model="stories", input=STORY, temperature=0, max_output_tokens=4,
                                               stream=True))
    assert all(e.logprobs == [] for e in events if e.type in ("response.output_text.delta",
                                                              "response.output_text.done"))
    assert events[-1].response.output[0].content[0].logprobs == []


def test_include_values_not_served_are_still_a_400_naming_include(url):
    response = httpx.post(f"{url}/v1/responses", timeout=60, json={
        "model": "stories", "input": "Hi", "include": [*LOGPROBS, "file_search_call.results"]})
    openai_error(response, 400, "include")


# ---- truncation ----------------------------------------------------------------------------------------------

INSTRUCTIONS = "Tell a story."
# Sixteen turns of about 22 tokens each: past the 256-token context together.
CONVERSATION = [{"role": "user" if i % 2 == 0 else "assistant",
                 "content": f"Day {i}: Lily saw a big dog in the park and she was happy."} for i in range(16)]


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
    # The output would fit (an output without its call is a 400 on /v1/responses: the chat request it would be)...
    orphan = {"model": "stories", "max_tokens": 16, "messages": [
        {"role": "system", "content": INSTRUCTIONS}, {"role": "tool", "tool_call_id": "call_1", "content": output["output"]},
        last]}
    assert httpx.post(f"{url}/v1/chat/completions", json=orphan, timeout=60).status_code == 200
    assert respond(url, [call, output, last], "disabled").status_code == 400    # ...but not with its call
    reply = respond(url, [*CONVERSATION[:6], call, output, last], "auto").json()
    alone = respond(url, [last], "disabled").json()
    assert reply["usage"]["input_tokens"] == alone["usage"]["input_tokens"]
    assert reply["output"][0]["content"] == alone["output"][0]["content"]


@pytest.mark.parametrize("value", ["bogus", "AUTO", ""])
def test_truncation_other_than_auto_or_disabled_is_a_400_naming_it(url, value):
    openai_error(respond(url, CONVERSATION[:1], value), 400, "truncation")


# ---- vLLM's extensions, declared from one list -------------------------------------------------------------

def test_every_chat_extra_is_declared_and_passed_on():
    req = ResponsesRequest.model_validate({"model": "stories", "input": "Hi", **{n: None for n in CHAT_EXTRAS}})
    assert unknown_fields(req) == [] and set(CHAT_EXTRAS) <= set(chat_body(req))
