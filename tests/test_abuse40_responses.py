"""POST /v1/responses through the openai SDK, whole and through its stream helper: a completed response
and one cut by max_output_tokens end as OpenAI's API ends them (response.completed; response.incomplete
with status "incomplete" and incomplete_details.reason "max_output_tokens", the cut item incomplete),
the terminal event's response the same as the whole one, completed_at set only on a completed one;
prompt_cache_key and safety_identifier are echoed as OpenAI's response echoes them."""
from __future__ import annotations

import httpx
import openai
import pytest
from test_server_helpers import chat_model_dir, openai_error, running_server

STORY = "Tom had a red ball."


@pytest.fixture(scope="module")
def url(stories_path, tmp_path_factory):
    """The base URL of a server of stories260K with a chat template, on the CPU."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    with running_server(model, max_model_len=256) as (base_url, _):
        yield base_url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def same_response(streamed, whole) -> None:
    """The streamed response holds what the whole one holds, ids and times aside."""
    assert (streamed.status, streamed.incomplete_details, streamed.output_text, streamed.usage.output_tokens) == (
        whole.status, whole.incomplete_details, whole.output_text, whole.usage.output_tokens)
    assert [(item.type, item.status) for item in streamed.output] == [(item.type, item.status) for item in whole.output]


def test_a_completed_response_has_completed_at_whole_and_from_the_stream_helper(url):
    c = client(url)
    request = dict(model="stories", input=STORY, temperature=0, extra_body={"stop": ["."]})
    whole = c.responses.create(**request)
    assert whole.status == "completed" and whole.incomplete_details is None
    assert isinstance(whole.completed_at, (int, float)) and whole.completed_at >= whole.created_at
    with c.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert events[-1].type == "response.completed" and events[0].response.completed_at is None
    assert final.completed_at >= final.created_at and final.id == events[0].response.id
    same_response(final, whole)


def test_a_response_cut_by_max_output_tokens_is_incomplete_whole_and_streamed(url):
    c = client(url)
    request = dict(model="stories", input=STORY, temperature=0, max_output_tokens=3)
    whole = c.responses.create(**request)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.completed_at is None and whole.error is None
    assert whole.output[-1].status == "incomplete" and whole.usage.output_tokens == 3
    with c.responses.stream(**request) as stream:
        events = list(stream)
    terminal = events[-1]
    assert terminal.type == "response.incomplete" and terminal.response.completed_at is None
    assert [e.type for e in events].count("response.incomplete") == 1 and "response.completed" not in [
        e.type for e in events]
    same_response(terminal.response, whole)
    # The items of the output_item.done events are the terminal response's.
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.id for item in done] == [item.id for item in terminal.response.output]


def test_prompt_cache_key_and_safety_identifier_are_echoed(url):
    reply = client(url).responses.create(model="stories", input=STORY, max_output_tokens=2,
                                         prompt_cache_key="story-k", safety_identifier="user-7f3a")
    assert (reply.prompt_cache_key, reply.safety_identifier) == ("story-k", "user-7f3a")
    plain = client(url).responses.create(model="stories", input=STORY, max_output_tokens=2)
    assert (plain.prompt_cache_key, plain.safety_identifier) == (None, None)


@pytest.mark.parametrize("field", ["safety_identifier", "prompt_cache_key"])
def test_an_echoed_identifier_that_is_no_string_is_a_400_naming_it(url, field):
    r = httpx.post(f"{url}/v1/responses", json={"model": "stories", "input": STORY, field: {"id": 7}}, timeout=60)
    openai_error(r, 400, param=field)
