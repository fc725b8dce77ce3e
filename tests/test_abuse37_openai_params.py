"""OpenAI-client parameters as vLLM takes them: stream_interval (vLLM's per-request field) holds a
stream's chunks until a completion has that many new tokens, sending its first and last at once, and
a value below 1 or of another type is a 400 naming stream_interval (it was logged as unknown and
every token went out in a chunk of its own)."""
from __future__ import annotations

import httpx
import openai
import pytest
from test_abuse37_stream_interval import stream_chunks
from test_server_helpers import chat_model_dir, openai_error, running_server

MESSAGES = [{"role": "user", "content": "Once upon"}]
PATHS = {"completions": ("/v1/completions", {"prompt": "Once upon a time"}),
         "chat": ("/v1/chat/completions", {"messages": MESSAGES})}


@pytest.fixture(scope="module")
def url(stories_path, tmp_path_factory):
    """A server of stories260K with a chat template, on the CPU."""
    model = chat_model_dir(stories_path, tmp_path_factory.mktemp("chat_model"))
    with running_server(model, max_model_len=256) as running:
        yield running[0]


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": "stories", **body}, timeout=60)




def tokens_per_chunk(chunks: list[dict]) -> dict[int, list[int]]:
    """Each choice's token counts, chunk by chunk (chunks that carry tokens only)."""
    counts: dict[int, list[int]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice.get("token_ids"):
                counts.setdefault(choice["index"], []).append(len(choice["token_ids"]))
    return counts


def assert_held_to_interval(counts: list[int], interval: int, max_tokens: int) -> None:
    """Every chunk between the first and the last carries at least interval tokens."""
    assert sum(counts) == max_tokens
    assert all(n >= interval for n in counts[1:-1]), counts
    assert len(counts) <= 2 + (max_tokens - 2) // interval, counts


@pytest.mark.parametrize("value", [0, -1, "two", 1.5, "true", False], ids=["zero", "negative", "string", "float",
                                                                        "bool-string", "false"])
@pytest.mark.parametrize("endpoint", PATHS)
def test_a_stream_interval_that_is_no_positive_integer_is_a_400_naming_it(url, endpoint, value):
    path, body = PATHS[endpoint]
    openai_error(post(url, path, {**body, "max_tokens": 2, "stream": True, "stream_interval": value}),
                 400, "stream_interval")


def test_text_completion_chunks_hold_stream_interval_tokens(url):
    body = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    whole = post(url, "/v1/completions", body).json()["choices"][0]
    chunks = stream_chunks(url, "/v1/completions", {**body, "stream_interval": 4})
    assert_held_to_interval(tokens_per_chunk(chunks)[0], 4, 10)
    assert "".join(c["text"] for chunk in chunks for c in chunk["choices"]) == whole["text"]
    assert [t for chunk in chunks for c in chunk["choices"] for t in c.get("token_ids") or []] == whole["token_ids"]


def test_chat_chunks_of_each_choice_hold_stream_interval_tokens_with_logprobs(url):
    body = {"messages": MESSAGES, "max_tokens": 9, "n": 2, "seed": 3, "temperature": 1, "ignore_eos": True,
            "logprobs": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    whole = post(url, "/v1/chat/completions", {k: v for k, v in body.items() if k != "stream_options"}).json()
    chunks = stream_chunks(url, "/v1/chat/completions", {**body, "stream_interval": 3})
    counts = tokens_per_chunk(chunks)
    for index, choice in enumerate(whole["choices"]):
        assert_held_to_interval(counts[index], 3, 9)
        mine = [c for chunk in chunks for c in chunk["choices"] if c["index"] == index]
        assert "".join(c["delta"].get("content") or "" for c in mine) == choice["message"]["content"]
        assert [row for c in mine if c.get("logprobs") for row in c["logprobs"]["content"]] == \
            choice["logprobs"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == 18


def test_the_openai_client_streams_with_stream_interval_in_extra_body(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    stream = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=8, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True, "stream_interval": 8})
    texts = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert len(texts) <= 2
    whole = client.completions.create(model="stories", prompt="Once upon a time", max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True, "stream_interval": 8})
    assert "".join(texts) == whole.choices[0].text
