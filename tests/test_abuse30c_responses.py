"""POST /v1/responses: include ["message.output_text.logprobs"] (each output_text's logprobs, and each
streamed delta's, the same as chat completions' for the same request), through the openai SDK."""
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


# ---- vLLM's extensions, declared from one list -------------------------------------------------------------

def test_every_chat_extra_is_declared_and_passed_on():
    req = ResponsesRequest.model_validate({"model": "stories", "input": "Hi", **{n: None for n in CHAT_EXTRAS}})
    assert unknown_fields(req) == [] and set(CHAT_EXTRAS) <= set(chat_body(req))
