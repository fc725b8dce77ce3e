"""Chat and text completions as the openai client and curl drive them: top_logprobs past the server's
max_logprobs names top_logprobs (the field that asked), and a prompt of none of its forms is told which
form it took and where it broke it."""
from __future__ import annotations

import httpx
import openai
import pytest
from test_server_helpers import chat_model_dir, openai_error, running_server

MAX_LOGPROBS = 3
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def url(stories_path, tmp_path_factory):
    """A server of stories260K with a chat template and max_logprobs 3, on the CPU."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    with running_server(model, max_model_len=256, max_logprobs=MAX_LOGPROBS) as running:
        yield running[0]


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": "stories", **body}, timeout=60)


# ---- top_logprobs past max_logprobs -----------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_chat_top_logprobs_past_max_logprobs_is_a_400_naming_top_logprobs(url, stream):
    # It named logprobs, a bool in chat: the engine's message for completions' count.
    body = {"messages": MESSAGES, "max_tokens": 2, "logprobs": True, "top_logprobs": MAX_LOGPROBS + 1,
            "stream": stream}
    error = openai_error(post(url, "/v1/chat/completions", body), 400, "top_logprobs")
    assert error["message"] == f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}] (the server's max_logprobs), " \
                               f"got {MAX_LOGPROBS + 1}"


def test_chat_top_logprobs_at_max_logprobs_is_served(url):
    body = {"messages": MESSAGES, "max_tokens": 2, "logprobs": True, "top_logprobs": MAX_LOGPROBS}
    reply = post(url, "/v1/chat/completions", body)
    assert reply.status_code == 200, reply.text
    rows = reply.json()["choices"][0]["logprobs"]["content"]
    assert [len(row["top_logprobs"]) for row in rows] == [MAX_LOGPROBS] * 2


def test_the_openai_client_sees_top_logprobs_named(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="stories", messages=MESSAGES, max_completion_tokens=2, logprobs=True,
                                       top_logprobs=MAX_LOGPROBS + 1)
    assert raised.value.param == "top_logprobs"


def test_completions_logprobs_past_max_logprobs_still_names_logprobs(url):
    openai_error(post(url, "/v1/completions", {"prompt": "Once", "max_tokens": 2, "logprobs": MAX_LOGPROBS + 1}),
                 400, "logprobs")


# ---- a prompt of none of the forms ------------------------------------------------------------------------------

BAD_PROMPTS = [
    ("null", None, "got null"),
    ("number", 5, "got an integer"),
    ("object", {"a": 1}, "got an object"),
    ("floats", [1.5, 2.0], "got a list whose first item is a number"),
    ("bools", [True, "a"], "got a list whose first item is a boolean"),
    ("ids-then-text", [1, "a"], "a list of token ids holds a string at index 1"),
    ("texts-then-ids", ["a", [1]], "a list of strings holds a list at index 1"),
    ("id-lists-then-text", [[1], "a"], "a list of token id lists holds a string at index 1"),
    ("id-list-with-text", [[1, 2], [1, "x"]], "a list of token id lists holds a string at index 1.1"),
    ("three-deep", [[[1]]], "a list of token id lists holds a list at index 0.0"),
]


@pytest.mark.parametrize("prompt,expected", [c[1:] for c in BAD_PROMPTS], ids=[c[0] for c in BAD_PROMPTS])
def test_a_prompt_of_no_form_says_which_form_it_broke(url, prompt, expected):
    # pydantic's union reported one member's error: [1.0, 2.0] was "Input should be a valid string".
    error = openai_error(post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 2}), 400, "prompt")
    assert expected in error["message"]
    assert "a list of token id lists" in error["message"] and "valid string" not in error["message"]


def test_a_prompt_with_a_lone_surrogate_keeps_its_own_error(url):
    body = '{"model": "stories", "prompt": ["ok", "\\ud800"], "max_tokens": 2}'      # JSON's escape of it
    reply = httpx.post(f"{url}/v1/completions", content=body, headers={"Content-Type": "application/json"}, timeout=60)
    error = openai_error(reply, 400, "prompt.1")
    assert "lone surrogate" in error["message"]
